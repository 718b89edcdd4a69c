"""The family registry: one module per family, named after its HF model_type.

Adding a family is one new module plus one line in FAMILIES, and where its forward pass differs
from the shared decoder, a `<family>_forward.py` that its `forward` names (imported when a model
is built, so the registry and the config reads stay free of torch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ftkit.errors import InputError, shown

from ..checkpoint.base import CheckpointError, Source
from ..spec import ModelSpec, SpecError
from . import (
    deepseek_v3,
    glm4_moe,
    gpt_oss,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from .base import Family, Mapped
from .config import names, text

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (qwen3_moe.FAMILY, qwen2_moe.FAMILY, olmoe.FAMILY, mixtral.FAMILY, qwen3_next.FAMILY, glm4_moe.FAMILY,
              gpt_oss.FAMILY, deepseek_v3.FAMILY, qwen3_5_moe.FAMILY)
}

__all__ = ["FAMILIES", "Family", "Mapped", "family_for_config", "family_for_gguf", "family_for_spec", "located",
           "resolve"]


def family_for_config(cfg: dict[str, Any]) -> Family:
    archs = names(cfg, "architectures")
    inner = cfg.get("text_config")
    model_type = text(cfg, "model_type") or (text(inner, "model_type") if isinstance(inner, dict) else None)
    for fam in FAMILIES.values():
        if any(a in fam.architectures for a in archs) or model_type == fam.name:
            return fam
    named = archs[0] if archs else model_type
    raise CheckpointError(
        f"unknown architecture {shown(named)}; supported: "
        + ", ".join(a for f in FAMILIES.values() for a in f.architectures)
    )


def family_for_gguf(meta: dict[str, Any]) -> Family:
    arch = meta.get("general.architecture")
    for fam in FAMILIES.values():
        if arch in fam.gguf_archs:
            return fam
    raise CheckpointError(
        f"unknown GGUF architecture {shown(arch)}; supported: "
        + ", ".join(a for f in FAMILIES.values() for a in f.gguf_archs)
    )


def family_for_spec(spec: ModelSpec) -> Family:
    """The family a stored spec (an FTW manifest's) names, once it has checked the spec."""
    fam = FAMILIES.get(spec.family)
    if fam is None:
        raise SpecError(f"unknown family {shown(spec.family)}; supported: {', '.join(FAMILIES)}")
    fam.check_spec(spec)
    return fam


@contextmanager
def located(where: object) -> Iterator[None]:
    """An input error raised inside names `where`: the config file or GGUF the values came from."""
    try:
        yield
    except InputError as e:
        raise CheckpointError(f"{where}: {e}") from None


def config_name(source: Source) -> str:
    """Where a source's config lives, as problems name it: the GGUF file, or config.json's path
    inside the checkpoint directory."""
    if source.kind == "gguf":
        return source.path.name
    return str(source.config_path.relative_to(source.path))


def resolve(source: Source) -> tuple[Family, ModelSpec]:
    """The family and ModelSpec of an opened checkpoint; a config problem names the file."""
    with located(config_name(source)):
        if source.kind == "gguf":
            fam = family_for_gguf(source.metadata)
            # Tensors of types we cannot read still say what the model is (e.g. a Q4_K embedding).
            shapes = {**getattr(source, "unsupported_shapes", {}), **{n: r.shape for n, r in source.tensors.items()}}
            return fam, fam.spec_from_gguf(source.metadata, shapes)
        fam = family_for_config(source.config)
        return fam, fam.spec_from_config(source.config)
