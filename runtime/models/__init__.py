"""The family registry: one module per family, named after its HF model_type.

Adding a family is one new module plus one line in FAMILIES.
"""

from __future__ import annotations

from typing import Any

from ..checkpoint.base import CheckpointError, Source
from ..spec import ModelSpec
from . import glm4_moe, mixtral, olmoe, qwen2_moe, qwen3_moe, qwen3_next
from .base import Family, Mapped

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (qwen3_moe.FAMILY, qwen2_moe.FAMILY, olmoe.FAMILY, mixtral.FAMILY, qwen3_next.FAMILY, glm4_moe.FAMILY)
}

__all__ = ["FAMILIES", "Family", "Mapped", "family_for_config", "family_for_gguf", "resolve"]


def family_for_config(cfg: dict[str, Any]) -> Family:
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type") or (cfg.get("text_config") or {}).get("model_type")
    for fam in FAMILIES.values():
        if any(a in fam.architectures for a in archs) or model_type == fam.name:
            return fam
    named = archs[0] if archs else model_type
    raise CheckpointError(
        f"unknown architecture {named!r}; supported: "
        + ", ".join(a for f in FAMILIES.values() for a in f.architectures)
    )


def family_for_gguf(meta: dict[str, Any]) -> Family:
    arch = meta.get("general.architecture")
    for fam in FAMILIES.values():
        if arch in fam.gguf_archs:
            return fam
    raise CheckpointError(
        f"unknown GGUF architecture {arch!r}; supported: "
        + ", ".join(a for f in FAMILIES.values() for a in f.gguf_archs)
    )


def resolve(source: Source) -> tuple[Family, ModelSpec]:
    """The family and ModelSpec of an opened checkpoint."""
    if source.kind == "gguf":
        fam = family_for_gguf(source.metadata)
        # Tensors of types we cannot read still say what the model is (e.g. a Q4_K embedding).
        shapes = {**getattr(source, "unsupported_shapes", {}), **{n: r.shape for n, r in source.tensors.items()}}
        return fam, fam.spec_from_gguf(source.metadata, shapes)
    fam = family_for_config(source.config)
    return fam, fam.spec_from_config(source.config)
