"""The shared vocabulary: what every package names the same way, importing nothing of ftkit.

Weight formats (by name, with their blocks' element and byte counts), the parts of an expert
slot and how a slot lays them out, the strategy names and byte sizes as people read them. The
kernels, readers, writers, the store and the tools all import them from here, so no package
imports one above it just to name a thing (tests/test_layers.py keeps that order). No torch at
import time, so the commands that only read headers stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class FormatError(ValueError):
    """A tensor's format or shape is not one this ftkit stores."""


@dataclass(frozen=True)
class Format:
    """How a tensor's values are stored along its last dimension: `block` elements per
    `block_bytes` bytes. A plain dtype is a block of one element (`block == 1`)."""

    name: str
    block: int
    block_bytes: int

    @property
    def plain(self) -> bool:
        return self.block == 1

    @property
    def itemsize(self) -> int:
        """Bytes per element of a plain dtype, as torch.dtype.itemsize (the memory plans read it)."""
        if not self.plain:
            raise FormatError(f"{self.name} is a block format: {self.block_bytes} bytes per {self.block} elements")
        return self.block_bytes


# Plain dtypes by torch's name for them (float8_e4m3fn only as HF checkpoints store DeepSeek's
# block-scaled weights, which readers dequantize: no slot or dense tensor keeps it), then GGUF's
# block formats by ggml's type name in lower case (ggml-common.h): `block` weights along the last
# dimension stored in `block_bytes` bytes. q8_0, for one, is an fp16 scale followed by 32 int8
# values (34 bytes); the K-quants and iq4_xs are super-blocks of 256 weights with packed
# sub-block scales; mxfp4 has an e8m0 (power of two) scale per 32 e2m1 weights.
# kernels/dequant.py documents each layout.
Q8_0 = "q8_0"
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("float32", 1, 4), Format("float16", 1, 2), Format("bfloat16", 1, 2), Format("float64", 1, 8),
        Format("int64", 1, 8), Format("int32", 1, 4), Format("int16", 1, 2), Format("int8", 1, 1),
        Format("uint8", 1, 1), Format("bool", 1, 1), Format("float8_e4m3fn", 1, 1),
        Format("q4_0", 32, 18), Format("q4_1", 32, 20), Format("q5_0", 32, 22), Format("q5_1", 32, 24),
        Format(Q8_0, 32, 34),
        Format("q2_k", 256, 84), Format("q3_k", 256, 110), Format("q4_k", 256, 144),
        Format("q5_k", 256, 176), Format("q6_k", 256, 210),
        Format("iq4_nl", 32, 18), Format("iq4_xs", 256, 136), Format("mxfp4", 32, 17),
    )
}
PLAIN_DTYPES = tuple(n for n, f in FORMATS.items() if f.plain)
BLOCK_FORMATS = tuple(n for n, f in FORMATS.items() if not f.plain)
# What an expert slot may hold: floats a kernel multiplies directly, or GGUF blocks as ggml
# stores them, which the CPU kernel dequantizes as it multiplies.
FLOAT_FORMATS = ("float32", "float16", "bfloat16")
EXPERT_FORMATS = (*FLOAT_FORMATS, *BLOCK_FORMATS)
# What FTW stores dense tensors (attention, norms, embeddings, routers) as: the compute dtypes,
# and from FTW v3 a GGUF's blocks as stored (STORED_DENSE_FORMATS), dequantized when loaded.
DENSE_FORMATS = ("float32", "float16", "bfloat16")
STORED_DENSE_FORMATS = (*DENSE_FORMATS, *BLOCK_FORMATS)
# Dense block formats a GPU multiplies as stored (kernels/triton/block_gemv.py splits them into
# planes), for rows of a multiple of 256 weights: what Q4_K_M and Q8_0 files hold.
PLANE_FORMATS = ("q4_k", "q6_k", "q8_0")


def format_of(name: str) -> Format:
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise FormatError(f"unknown weight format {name!r}") from None


def stored_nbytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this logical shape occupies in format `fmt`."""
    f = format_of(fmt)
    if not f.plain and (not shape or shape[-1] % f.block):
        raise FormatError(f"{fmt} needs a last dimension divisible by {f.block}, got {tuple(shape)}")
    n = 1
    for d in shape:
        n *= d
    return n // f.block * f.block_bytes


def stored_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of a tensor's stored bytes as readers return them: the logical shape for a plain
    dtype, raw bytes per row for a block format."""
    f = format_of(fmt)
    if f.plain:
        return tuple(shape)
    return (*shape[:-1], shape[-1] // f.block * f.block_bytes)


def storage_dtype(fmt: str) -> torch.dtype:
    """The torch dtype a tensor in `fmt` is held in: its own, or uint8 bytes for blocks."""
    import torch

    return getattr(torch, fmt) if format_of(fmt).plain else torch.uint8


# Expert slot parts, in slot order. `gate` and `up` are [I, H]; `down` is [H, I]. Experts with
# biases (gpt-oss) add the BIAS_PARTS after them: `gate_bias`, `up_bias` [I], `down_bias` [H],
# float32 whatever the slot's dtype (a q8_0 block needs rows of 32; they are a few KB a slot).
EXPERT_PARTS = ("gate", "up", "down")
BIAS_PARTS = ("gate_bias", "up_bias", "down_bias")
BIAS_DTYPE = "float32"
SLOT_ALIGN = 4096  # one slot = one DMA = one O_DIRECT read
PART_ALIGN = 64  # each part starts on a cache line, so kernels can load it with full-width vectors


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Part:
    name: str
    dtype: str
    shape: tuple[int, ...]  # logical element shape
    offset: int  # bytes from the start of the slot
    nbytes: int

    def view(self, slot: torch.Tensor) -> torch.Tensor:
        """This part of a uint8 slot, in its stored dtype and shape (raw rows for blocks)."""
        raw = slot[self.offset : self.offset + self.nbytes]
        return raw.view(storage_dtype(self.dtype)).view(stored_shape(self.dtype, self.shape))


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation in place of silu(g) * u: g = min(g, limit), u clamped to
    [-limit, limit], then (u + 1) * g * sigmoid(alpha * g) (transformers' GptOssExperts)."""

    alpha: float
    limit: float


@dataclass(frozen=True)
class SlotLayout:
    """How one (layer, expert) is laid out in its slot and what its kernels compute from it:
    gate, up, down (and their float32 biases, where the experts have them), padded to SLOT_ALIGN;
    `activation` None is SwiGLU, silu(gate x) * (up x). `dtype` is gate, up and down's one
    format, or MIXED where they differ (a Q4_K_M layer: gate and up q4_k, down q6_k)."""

    dtype: str
    parts: tuple[Part, ...]
    slot_bytes: int
    activation: ClampedSwiGLU | None = None

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    @property
    def formats(self) -> tuple[str, ...]:
        """The formats of gate, up and down, in slot order (bias parts are always BIAS_DTYPE)."""
        return tuple(p.dtype for p in self.parts[: len(EXPERT_PARTS)])

    @property
    def data_bytes(self) -> int:
        """The bytes the parts hold (biases included), without the padding between and after them."""
        return sum(p.nbytes for p in self.parts)

    @property
    def biased(self) -> bool:
        return len(self.parts) > len(EXPERT_PARTS)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dtype": self.dtype,
            "alignment": SLOT_ALIGN,
            "slot_bytes": self.slot_bytes,
            "parts": [
                {"name": p.name, "dtype": p.dtype, "shape": list(p.shape), "offset": p.offset, "nbytes": p.nbytes}
                for p in self.parts
            ],
        }
        if self.activation is not None:  # absent for SwiGLU: earlier manifests stay what they were
            out["activation"] = {"kind": "clamped_swiglu", "alpha": self.activation.alpha,
                                 "limit": self.activation.limit}
        return out


class HasExpertShapes(Protocol):
    def expert_part_shapes(self) -> dict[str, tuple[int, ...]]: ...

    def expert_activation(self) -> ClampedSwiGLU | None: ...


class HasExperts(HasExpertShapes, Protocol):
    num_experts: int

    @property
    def num_moe_layers(self) -> int: ...


MIXED = "mixed"  # a layout's dtype where its parts (or its layers) differ in format


def _packed(spec: HasExpertShapes, formats: tuple[str, ...]) -> tuple[list[Part], int]:
    """The parts in `formats` (gate, up, down), then the BIAS_PARTS in BIAS_DTYPE where
    `expert_part_shapes` names them, packed from offset 0, and the bytes they span."""
    if len(formats) != len(EXPERT_PARTS):
        raise FormatError(f"an expert slot has {len(EXPERT_PARTS)} parts, got formats {formats}")
    for fmt in formats:
        if fmt not in EXPERT_FORMATS:
            raise FormatError(f"expert dtype {fmt} is not one of {', '.join(EXPERT_FORMATS)}")
    parts, off = [], 0
    shapes = spec.expert_part_shapes()
    named = [*zip(EXPERT_PARTS, formats, strict=True), *((b, BIAS_DTYPE) for b in BIAS_PARTS if b in shapes)]
    for name, fmt in named:
        n = stored_nbytes(fmt, shapes[name])
        parts.append(Part(name, fmt, shapes[name], off, n))
        off = align_up(off + n, PART_ALIGN)
    return parts, off


def slot_layout(spec: HasExpertShapes, dtype: str | tuple[str, ...], slot_bytes: int | None = None) -> SlotLayout:
    """The one slot layout for `spec`'s experts stored in `dtype` (one format, or one per part).
    `slot_bytes`: pad to this size instead of the parts' own (the largest of a model's layers)."""
    formats = (dtype,) * len(EXPERT_PARTS) if isinstance(dtype, str) else tuple(dtype)
    parts, end = _packed(spec, formats)
    own = align_up(end, SLOT_ALIGN)
    if slot_bytes is not None and (slot_bytes < own or slot_bytes % SLOT_ALIGN):
        raise FormatError(f"slot of {slot_bytes} bytes cannot hold parts of {own}")
    one = formats[0] if len(set(formats)) == 1 else MIXED
    return SlotLayout(one, tuple(parts), own if slot_bytes is None else slot_bytes, spec.expert_activation())


@dataclass(frozen=True)
class ExpertLayout:
    """Every MoE layer's slot layout (llama-quantize gives layers and parts their own formats),
    all padded to one slot size: the largest layer's, so a slot of the pool or of the device
    cache holds any expert and a row is found by one multiplication."""

    layers: tuple[SlotLayout, ...]  # by MoE layer index
    num_experts: int

    @property
    def slot_bytes(self) -> int:
        return self.layers[0].slot_bytes

    @property
    def uniform(self) -> SlotLayout | None:
        """The one layout of every layer, or None where layers differ."""
        return self.layers[0] if all(lay == self.layers[0] for lay in self.layers) else None

    @property
    def dtype(self) -> str:
        """The one format of every part of every layer, else MIXED."""
        formats = self.formats
        return formats[0] if len(formats) == 1 else MIXED

    @property
    def formats(self) -> tuple[str, ...]:
        """Every format a slot part is stored in, sorted."""
        return tuple(sorted({f for lay in self.layers for f in lay.formats}))

    @property
    def biased(self) -> bool:
        """Whether the experts have float32 biases after gate, up and down (every layer alike)."""
        return self.layers[0].biased

    @property
    def activation(self) -> ClampedSwiGLU | None:
        """The experts' activation (every layer alike: it is the spec's); None is SwiGLU."""
        return self.layers[0].activation

    def for_layer(self, moe_index: int) -> SlotLayout:
        return self.layers[moe_index]

    def for_row(self, row: int) -> SlotLayout:
        return self.layers[row // self.num_experts]

    def describe(self) -> str:
        """The formats by part, e.g. `gate q4_k, up q4_k, down q4_k|q6_k`; one word when uniform."""
        if len(self.formats) == 1:
            return self.formats[0]
        by_part = [sorted({lay.formats[i] for lay in self.layers}) for i in range(len(EXPERT_PARTS))]
        return ", ".join(f"{name} {'|'.join(f)}" for name, f in zip(EXPERT_PARTS, by_part, strict=True))

    def to_dict(self) -> dict[str, Any]:
        """FTW v2's `experts.layout`: the common slot size, each layer's parts (biases included)
        and, for the clamped SwiGLU, the activation (absent for SwiGLU, as before it existed)."""
        out: dict[str, Any] = {"alignment": SLOT_ALIGN, "slot_bytes": self.slot_bytes, "packing": PACKING,
                               "layers": [{"parts": lay.to_dict()["parts"]} for lay in self.layers]}
        if "activation" in (first := self.layers[0].to_dict()):
            out["activation"] = first["activation"]
        return out


# How block parts are laid out in a slot: ggml's blocks as GGUF stores them, row by row (a row of
# n weights is n / block blocks), not repacked; the CPU kernel and the Triton kernels
# (kernels/triton/blocks.py) read them so.
PACKING = "ggml-rows"


def expert_layout(spec: HasExperts, formats: str | list[tuple[str, ...]]) -> ExpertLayout:
    """The layout of experts whose MoE layer i is stored in `formats[i]` (gate, up, down), or
    all in one format."""
    if isinstance(formats, str):
        formats = [(formats,) * len(EXPERT_PARTS)] * spec.num_moe_layers
    if len(formats) != spec.num_moe_layers:
        raise FormatError(f"{len(formats)} layers of expert formats for {spec.num_moe_layers} MoE layers")
    slot = align_up(max(_packed(spec, tuple(f))[1] for f in formats), SLOT_ALIGN)
    return ExpertLayout(tuple(slot_layout(spec, tuple(f), slot) for f in formats), spec.num_experts)


# Where routed experts run (docs/architecture.md, "Strategies"): all on the device, missing ones
# copied in, missing ones on the CPU, the misses split between both; `auto` picks one.
FUSED, OFFLOAD, CPU, HYBRID, AUTO = "fused", "offload", "cpu", "hybrid", "auto"
STRATEGIES = (FUSED, OFFLOAD, CPU, HYBRID, AUTO)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError
