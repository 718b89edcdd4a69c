"""ft-diagnose's verdict: will a checkpoint load? Decided from headers and shapes alone.

Every source is opened from its headers (safetensors JSON headers, GGUF through the tensor-info
section, an FTW manifest plus its dense file's header), so a header-only stub gets the same
verdict as the full checkpoint. The expected dense tensors are the family's shapes for the
config: byte counts without a byte of storage, whatever the model's size. Nothing here imports
torch for an HF directory or a GGUF file (an FTW directory's reader does).
The schema of `diagnose`'s result is documented in docs/diagnose.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ftkit.errors import InputError, one_line
from ftkit.runtime.checkpoint import open_source
from ftkit.runtime.checkpoint.quant_presets import expert_formats
from ftkit.runtime.checkpoint.safetensors import read_config
from ftkit.runtime.engine.memory import ANCHOR_SLOTS, base_plan, dense_device_bytes, device_blocks
from ftkit.runtime.engine.tokenizer import TOKENIZER_JSON, Tokenizer, compile_template
from ftkit.runtime.ftw.manifest import MANIFEST
from ftkit.runtime.models import Family, family_for_config, located
from ftkit.runtime.models.inventory import Inventory, take_inventory
from ftkit.runtime.models.kv_size import kv_size
from ftkit.runtime.spec import ModelSpec
from ftkit.vocab import (
    BLOCK_FORMATS,
    EXPERT_FORMATS,
    EXPERT_PARTS,
    FORMATS,
    ExpertLayout,
    FormatError,
    expert_layout,
)

PLAN_DTYPE = FORMATS["bfloat16"]  # the memory plan's compute dtype: dense weights and KV cache
KV_TOKENS = 1000  # the KV figure is per this many tokens, and min_gpu_bytes's minimal context
FTW_LAYOUT = "ftw slots"
PRINTED = 4000  # characters a report line keeps (one_line cuts the rest)

T = TypeVar("T")


@dataclass
class Diagnosis:
    """What the checks found; `to_dict` is the JSON report."""

    path: Path
    kind: str | None = None  # safetensors | gguf | ftw
    header_only: bool = False
    config: str | None = None  # where the model's config was found
    files: int = 0  # weight files whose headers were read
    tensors: int = 0  # tensors those headers describe
    family: Family | None = None
    spec: ModelSpec | None = None
    expert_layout: str | None = None
    expert_dtype: str | None = None
    slots: ExpertLayout | None = None  # what the expert slots hold (an FTW's, or what ftw-convert writes)
    dense_formats: dict[str, str] = field(default_factory=dict)  # canonical dense name -> stored format
    problems: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)  # tensors the family does not use (not a failure)
    notes: list[str] = field(default_factory=list)  # what conversion will do that the user should know
    memory: dict[str, Any] | None = None

    def attempt(self, step: Callable[[], T]) -> T | None:
        """Run one check step; the readers' one-line error becomes a listed problem (once). Any
        other exception is a bug in a reader, not a verdict, and is not caught."""
        try:
            return step()
        except (InputError, FormatError) as e:
            problem = str(e)
        if problem not in self.problems:
            self.problems.append(problem)
        return None

    def to_dict(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "verdict": "FAIL" if self.problems else "PASS",
            "path": str(self.path),
            "kind": self.kind,
            "header_only": self.header_only,
            "config": self.config,
            "files": self.files,
            "tensors": self.tensors,
            "family": self.family.name if self.family else None,
            "architecture": spec.architecture if spec else None,
            "layers": spec.num_layers if spec else None,
            "moe_layers": spec.num_moe_layers if spec else None,
            "experts": spec.num_experts if spec else None,
            "top_k": spec.top_k if spec else None,
            "expert_layout": self.expert_layout,
            "expert_dtype": self.expert_dtype,
            # printable, as every line the report prints: a header's names can hold any bytes
            # (GGUF strings are read with surrogateescape, so invalid UTF-8 arrives as lone surrogates)
            "problems": [one_line(p, PRINTED) for p in self.problems],
            "unexpected": [one_line(u, PRINTED) for u in self.unexpected],
            "notes": [one_line(n, PRINTED) for n in self.notes],
            "memory": self.memory,
        }


def diagnose(path: Path, quantize: str | None = None) -> dict[str, Any]:
    """The loadability report of an HF directory, a GGUF file, an FTW directory or their stubs;
    `quantize`: a checkpoint's slots priced as `ftw-convert --quantize` writes them."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    d = Diagnosis(path)
    if path.is_dir() and (path / MANIFEST).is_file():
        _check_ftw(d)
        if quantize:
            d.problems.append(f"--quantize {quantize}: an FTW directory's slots are as written; it prices a conversion")
    else:
        _check_checkpoint(d, quantize)
    if d.family and d.spec:
        d.memory = d.attempt(lambda: memory_plan(d.family, d.spec, d.slots or expert_layout(d.spec, "bfloat16"),
                                                 d.dense_formats))
    return d.to_dict()


# ---- the memory plan ---------------------------------------------------------------------------
def cuda_flash(spec: ModelSpec) -> bool:
    """Whether ft-run's plan on this machine's GPU runs a prefill chunk with flash attention
    (models.layers.flash_behind_cache, the plan's prefill workspace). Without an NVIDIA driver
    (Linux: no /proc/driver/nvidia) there is no GPU to ask, and torch is not loaded to learn it."""
    if sys.platform.startswith("linux") and not Path("/proc/driver/nvidia").exists():
        return False
    import torch

    from ftkit.runtime.models.layers import flash_behind_cache

    return flash_behind_cache(torch.bfloat16, spec.head_dim, "cuda")


def memory_plan(family: Family, spec: ModelSpec, layout: ExpertLayout,
                dense_formats: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Host and GPU bytes to serve the model with its experts in `layout` and the dense tensors
    stored in `dense_formats` (the GPU keeps an embedding table, and lm_head in Q4_K, Q6_K or
    Q8_0, in GGUF blocks where they are: engine/memory.py's `device_blocks`). `min_gpu_bytes` is
    the smallest `--gpu-budget` that `ft-run` accepts on CUDA with `--kv-tokens` KV_TOKENS and
    `--no-prefix-cache`: the runtime's own plan (engine/memory.py) with top_k expert slots, one
    token's experts for the layer being computed. The CUDA context and allocator slack come on
    top; more slots mean fewer expert fetches."""
    slot = layout.slot_bytes
    dense = dense_device_bytes(family.dense_shapes(spec), PLAN_DTYPE, spec.family,
                               device_blocks(dense_formats or {}, cuda=True, gpu_products=True,
                                             shapes=family.dense_shapes(spec)))
    graphs = family.graphs_unsupported(spec) is None  # the runtime decodes through them
    least = base_plan(spec, dense, slot, PLAN_DTYPE, KV_TOKENS, cuda=True, graphs=graphs,
                      flash=cuda_flash(spec)).with_sizes(expert_slots=spec.top_k)
    kv = kv_size(spec, PLAN_DTYPE)
    prefix = base_plan(spec, dense, slot, PLAN_DTYPE, KV_TOKENS, prefix_tokens=spec.max_position_embeddings,
                       prefix_windows=ANCHOR_SLOTS)
    return {
        "dtype": PLAN_DTYPE.name,
        "expert_dtype": layout.describe(),
        "expert_formats": list(layout.formats),
        "expert_slot_bytes": slot,
        "expert_data_bytes": max(lay.data_bytes for lay in layout.layers),
        "host_expert_pool_bytes": spec.num_expert_rows * slot,
        "dense_bytes": dense,
        "kv_bytes_per_1k_tokens": KV_TOKENS * kv.full,
        "kv_window_bytes": kv.window_bytes,
        "prefix_cache_bytes": prefix.prefix_bytes,
        "min_gpu_bytes": least.total_bytes,
        "min_gpu_terms": dict(least.terms()),
        "min_gpu_context_tokens": KV_TOKENS,
        "min_gpu_expert_slots": spec.top_k,
    }


# ---- HF directories and GGUF files -----------------------------------------------------------
def _check_checkpoint(d: Diagnosis, quantize: str | None = None) -> None:
    source = d.attempt(lambda: open_source(d.path, allow_stub=True, strict_types=False))
    if source is None:
        if d.path.is_dir() or d.path.suffix == ".safetensors":
            d.kind = "safetensors"
            # A missing shard or a corrupt header should not hide what the model is.
            _read_config(d, d.path if d.path.is_dir() else d.path.parent)
        return
    d.kind, d.header_only, d.tensors = source.kind, source.header_only, len(source.tensors)
    if source.kind == "gguf":
        d.config, d.files = "GGUF metadata", 1
        d.attempt(lambda: _check_gguf_templates(source.metadata, source.path.name))
    else:
        d.config, d.files = str(source.config_path.relative_to(source.path)), len(source.files)
        d.attempt(lambda: _check_tokenizer(source.path))
    unsupported = getattr(source, "unsupported", {})
    inv = d.attempt(lambda: take_inventory(source))
    if inv is None:
        # The inventory lists unsupported types itself; without one, list them here.
        d.problems[:0] = [f"unsupported: GGUF type {t} for tensor {n}" for n, t in unsupported.items()]
        if source.kind == "safetensors":
            _resolve(d, source.config, d.config)  # name the family even when its config is incomplete
        return
    d.family, d.spec = inv.family, inv.spec
    d.problems += inv.problems
    d.unexpected = inv.unexpected
    d.expert_layout = inv.expert_layout
    d.expert_dtype = "/".join(sorted(inv.expert_dtypes)) or None
    d.slots = _converted_layout(inv)
    d.dense_formats = {canon: source.tensors[name].dtype for canon, (name, _) in inv.dense.items()}
    if quantize:
        d.slots = d.attempt(lambda: _quantized_layout(inv, quantize)) or d.slots
    if note := inv.skipped_note():
        d.notes.append(note)
    if note := inv.dense_note():
        d.notes.append(note)
    d.notes += list(getattr(source, "notes", ()))


def _quantized_layout(inv: Inventory, preset: str) -> ExpertLayout:
    """The slots `ftw-convert --quantize preset` writes (its refusals as problems)."""
    if stored := sorted(inv.expert_dtypes & set(BLOCK_FORMATS)):
        raise InputError(f"--quantize {preset}: the experts are already quantized ({'/'.join(stored)})")
    return expert_layout(inv.spec, expert_formats(inv.spec, preset))


def _converted_layout(inv: Inventory) -> ExpertLayout:
    """The slots ftw-convert writes: each layer's parts in their stored formats (GGUF blocks and
    an HF checkpoint's MXFP4 kept); a part that is missing, mixes
    formats, or is in one a slot cannot hold at the spec's shape priced as bfloat16 (`--dtype`)."""
    shapes = inv.spec.expert_part_shapes()

    def one(layer: int, part: str) -> str:
        formats = inv.part_formats.get((layer, part), set())
        fmt = next(iter(formats)) if len(formats) == 1 else None
        fits = fmt in EXPERT_FORMATS and shapes[part][-1] % FORMATS[fmt].block == 0
        return fmt if fits else "bfloat16"

    return expert_layout(inv.spec, [tuple(one(layer, p) for p in EXPERT_PARTS) for layer in inv.spec.moe_layers])


def _read_config(d: Diagnosis, root: Path) -> None:
    try:
        cfg_path, cfg = read_config(root)
    except InputError:
        return  # the source already reported the config problem
    d.config = str(cfg_path.relative_to(root))
    _resolve(d, cfg, d.config)


def _resolve(d: Diagnosis, cfg: dict[str, Any], where: str) -> None:
    """Family and spec from an HF config, as far as they go (problems worded as `resolve`'s)."""
    d.family = d.attempt(lambda: _at(where, lambda: family_for_config(cfg)))
    if d.family:
        d.spec = d.attempt(lambda: _at(where, lambda: d.family.spec_from_config(cfg)))


def _at(where: str, step: Callable[[], T]) -> T:
    with located(where):
        return step()


def _check_tokenizer(root: Path) -> None:
    """The tokenizer files ftw-convert carries and ft-run loads, loaded the same way."""
    if (root / TOKENIZER_JSON).is_file():
        Tokenizer(root)


def _check_gguf_templates(metadata: dict[str, Any], name: str) -> None:
    """The chat templates ftw-convert writes into tokenizer_config.json compile, as ft-run will
    compile them (the tokenizer itself is rebuilt or skipped with a note; see gguf_tokenizer)."""
    for key, value in metadata.items():
        if key == "tokenizer.chat_template" or key.startswith("tokenizer.chat_template."):
            compile_template(value, f"{name}: {key}")


# ---- FTW directories -------------------------------------------------------------------------
def _check_ftw(d: Diagnosis) -> None:
    from ftkit.runtime.ftw.reader import FTWModel  # torch: only FTW directories pay for it
    from ftkit.runtime.models.stored import dense_problems, stored_family

    d.kind, d.config, d.expert_layout = "ftw", MANIFEST, FTW_LAYOUT
    model = d.attempt(lambda: FTWModel(d.path, allow_stub=True))
    if model is None:
        return
    d.spec, d.header_only, d.expert_dtype = model.spec, model.header_only, model.layout.describe()
    d.slots = model.layout
    d.dense_formats = {name: t["dtype"] for name, t in model.manifest.dense["tensors"].items()}
    d.files, d.tensors = len(model.manifest.banks) + 1, len(model.dense_refs)
    d.family = d.attempt(lambda: stored_family(model))
    if d.family is None:
        return
    problems, d.unexpected = dense_problems(d.family, d.spec, model.dense_refs)
    d.problems += problems
    d.attempt(lambda: _check_tokenizer(d.path))
