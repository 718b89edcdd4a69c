"""Checkpoint -> FTW, streaming: one dense tensor or one layer's experts in memory at a time."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ftkit import __version__
from ftkit.kernels.dequant import dequantize
from ftkit.kernels.quantize import QUANTIZERS, quantize
from ftkit.runtime.checkpoint import CheckpointError, open_source
from ftkit.runtime.checkpoint.quant_presets import PRESETS, expert_formats
from ftkit.runtime.engine.tokenizer import TOKENIZER_JSON, Tokenizer
from ftkit.runtime.ftw.manifest import (
    DENSE_FILE,
    MANIFEST,
    Manifest,
    write_json_atomic,
)
from ftkit.runtime.ftw.writer import BankWriter, DenseWriter, atomic_dir, rows_per_bank, sha256_file
from ftkit.runtime.models.inventory import FUSED_FROM, Inventory, take_inventory
from ftkit.vocab import (
    BLOCK_FORMATS,
    ExpertLayout,
    expert_layout,
    storage_dtype,
    stored_nbytes,
    stored_shape,
)

DEFAULT_BANK_BYTES = 4 << 30
CAST_DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class Conversion:
    inventory: Inventory
    dense: list[tuple[str, str, tuple[int, ...]]]  # (canonical, out dtype, shape), write order
    dense_bytes: int
    layout: ExpertLayout  # each MoE layer's parts in their stored formats (GGUF blocks kept), or --dtype
    rows_per_bank: int
    side_files: list[tuple[Path, str]]
    quantize: str | None = None  # the preset the float experts are quantized by (`--quantize`)
    threads: int | None = None  # the quantizer's (default: torch's)

    @property
    def spec(self):
        return self.inventory.spec

    @property
    def expert_bytes(self) -> int:
        return self.spec.num_expert_rows * self.layout.slot_bytes

    @property
    def num_banks(self) -> int:
        return -(-self.spec.num_expert_rows // self.rows_per_bank)

    @property
    def source_bytes(self) -> int:
        return sum(r.nbytes for r in self.inventory.source.tensors.values())


def _out_dtype(src: str, cast: str | None, float_only: bool) -> str:
    """A dense tensor's FTW dtype: `cast`, else as stored (GGUF blocks too: the reader
    dequantizes them exactly to float32, as converting did before FTW v3), but float32 for a
    block tensor the family routes in float32 (`float_only`)."""
    if float_only and src in BLOCK_FORMATS:
        return "float32"
    return cast or src


def prepare(src: Path, dtype: str | None = None, bank_bytes: int = DEFAULT_BANK_BYTES,
            quantize: str | None = None, threads: int | None = None) -> Conversion:
    """What converting `src` writes: the dense tensors as stored or cast to `dtype`; the experts
    as stored (GGUF blocks kept), cast to `dtype`, or, with `quantize` (a llama-quantize preset
    or block format), quantized from float into GGUF blocks as that preset lays them out."""
    if dtype is not None and dtype not in CAST_DTYPES:
        raise CheckpointError(f"--dtype must be one of {', '.join(CAST_DTYPES)}, got {dtype}")
    if quantize is not None and quantize not in PRESETS:
        raise CheckpointError(f"--quantize must be one of {', '.join(PRESETS)}, got {quantize}")
    source = open_source(src, allow_stub=False)
    inv = take_inventory(source)
    if inv.problems:
        extra = f" (and {len(inv.problems) - 1} more; run ft-diagnose)" if len(inv.problems) > 1 else ""
        raise CheckpointError(inv.problems[0] + extra)
    want = inv.family.dense_shapes(inv.spec)
    dense = []
    for canonical, shape in want.items():
        name, _ = inv.dense[canonical]
        keep = canonical.endswith(inv.family.float32_suffixes)  # the family routes these in float32
        dense.append((canonical, _out_dtype(source.tensors[name].dtype, None if keep else dtype, keep), shape))
    if quantize is not None:
        layout = expert_layout(inv.spec, _quantized_formats(inv, quantize))
    else:
        layout = expert_layout(inv.spec, dtype or [inv.layer_formats(layer) for layer in inv.spec.moe_layers])
    side_files = source.side_files()
    for path, rel in side_files:  # the tokenizer ft-run will load, loaded now (a bad one refused)
        if rel == TOKENIZER_JSON:
            Tokenizer(path.parent)
    return Conversion(
        inventory=inv,
        dense=dense,
        dense_bytes=sum(stored_nbytes(d, s) for _, d, s in dense),
        layout=layout,
        rows_per_bank=rows_per_bank(layout.slot_bytes, inv.spec.num_experts, bank_bytes),
        side_files=side_files,
        quantize=quantize,
        threads=threads,
    )


def _quantized_formats(inv: Inventory, preset: str) -> list[tuple[str, ...]]:
    """Each MoE layer's formats under `preset`, after checking that the experts are floats and
    that a quantizer writes every format."""
    stored = sorted(inv.expert_dtypes & set(BLOCK_FORMATS))
    if stored:
        raise CheckpointError(f"the experts are already quantized ({'/'.join(stored)}); --quantize takes "
                              f"float experts (convert without it to keep these blocks)")
    formats = expert_formats(inv.spec, preset)
    if missing := sorted({f for layer in formats for f in layer} - set(QUANTIZERS) - set(CAST_DTYPES)):
        raise CheckpointError(f"--quantize {preset} needs {'/'.join(missing)} at this model's shapes, "
                              f"which ftkit does not write")
    return formats


def _cast(t: torch.Tensor, src: str, dst: str, threads: int | None = None) -> torch.Tensor:
    """`t`, stored as `src`, in `dst`: blocks kept, dequantized or (from floats) quantized."""
    if src == dst:
        return t
    if src in BLOCK_FORMATS:
        t = dequantize(t, src)
    if dst in BLOCK_FORMATS:
        return quantize(t.float(), dst, threads)
    return t.to(storage_dtype(dst))


def convert(conv: Conversion, out: Path, force: bool = False, on_bytes: Callable[[int], None] = lambda n: None) -> Manifest:
    """Write `conv` to `out` atomically; returns the manifest written."""
    inv, spec, source = conv.inventory, conv.spec, conv.inventory.source
    with atomic_dir(out, force) as tmp:
        dense = DenseWriter(tmp / DENSE_FILE, conv.dense)
        for canonical, dtype, shape in conv.dense:
            name, mapped = inv.dense[canonical]
            ref = source.tensors[name]
            t = inv.family.sanitize(mapped, source.read(name), spec, inv.gguf)
            dense.write(canonical, _cast(t, ref.dtype, dtype).reshape(stored_shape(dtype, shape)))
            on_bytes(ref.nbytes)
        dense_sha = dense.close()

        banks = BankWriter(tmp, conv.layout, spec.num_expert_rows, conv.rows_per_bank)
        for moe_index, layer in enumerate(spec.moe_layers):
            for e, parts in enumerate(_layer_experts(conv, layer, on_bytes)):
                banks.write_slot(moe_index * spec.num_experts + e, parts)
        bank_list = banks.close()

        files = {}
        for path, rel in conv.side_files:
            dst = tmp / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dst)
            files[rel] = sha256_file(dst)
        manifest = Manifest(
            spec=spec,
            layout=conv.layout,
            banks=bank_list,
            dense={"file": DENSE_FILE, "sha256": dense_sha,
                   "tensors": {c: {"dtype": d, "shape": list(s)} for c, d, s in conv.dense}},
            files=files,
            writer=f"ftkit {__version__}",
            source={"kind": source.kind, "path": str(Path(source.path).absolute()),
                    "expert_layout": inv.expert_layout},
        )
        write_json_atomic(tmp / MANIFEST, manifest.to_dict())
    return manifest


def _layer_experts(conv: Conversion, layer: int, on_bytes: Callable[[int], None]):
    """Yield each expert's {part: tensor in its slot format} for one model layer, in order:
    blocks as stored (raw rows), floats cast (biases to float32), or all cast to --dtype."""
    inv, spec = conv.inventory, conv.spec
    le = inv.experts[layer]
    slot = conv.layout.for_layer(spec.moe_index(layer))
    stacked: dict[str, tuple[torch.Tensor, str]] = {}
    for part, name in le.stacked.items():
        ref = inv.source.tensors[name]
        mapped = _mapped(inv, name)
        t = inv.family.sanitize(mapped, inv.source.read(name), spec, inv.gguf)
        if mapped.transposed:  # stored for x @ W: torch's [out, in] per expert
            t = t.transpose(-1, -2)
        on_bytes(ref.nbytes)
        if part in FUSED_FROM:  # gate's rows, then up's
            first, second = FUSED_FROM[part], FUSED_FROM[part].replace("gate", "up")
            i = spec.moe_intermediate_size
            stacked[first], stacked[second] = (t[:, :i], ref.dtype), (t[:, i:], ref.dtype)
        else:
            stacked[part] = (t, ref.dtype)
    for e in range(spec.num_experts):
        parts = {}
        for p in slot.parts:
            if p.name in stacked:
                t, src = stacked[p.name]
                t = t[e]
            else:
                name = le.per[(e, p.name)]
                ref = inv.source.tensors[name]
                t, src = inv.family.sanitize(_mapped(inv, name), inv.source.read(name), spec, inv.gguf), ref.dtype
                on_bytes(ref.nbytes)
            parts[p.name] = _cast(t, src, p.dtype, conv.threads)
        yield parts


def _mapped(inv: Inventory, name: str):
    return inv.family.map_name(name, inv.gguf)
