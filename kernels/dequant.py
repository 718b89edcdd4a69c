"""GGUF block formats to float32 in torch: the exact reference every faster path is checked against.

Each format's layout is ggml's (ggml-common.h), one block of `FORMATS[fmt].block` weights in
`block_bytes` bytes. Every function takes raw rows `[..., nblocks * block_bytes]` (uint8) and
returns float32 `[..., nblocks * block]`, vectorized over all blocks at once. The arithmetic is
the gguf package's (`gguf.quants.dequantize`) operation for operation in float32, so the results
are bit for bit the same: fp16 scales widen exactly, products and sums round in the same order
(never fused into one rounding), and integer parts are combined before they become floats.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ftkit.vocab import FORMATS, FormatError

QK_K = 256  # weights per K-quant (and iq4_xs) super-block
# weights decoded at once (64 MB of float32): bounds the temporaries of a whole embedding table,
# and where another dtype is asked for, its float32 values never exist whole
CHUNK_WEIGHTS = 1 << 24
# The 16 levels of a 4-bit non-linear index (IQ4_NL, IQ4_XS) and of an e2m1 value (MXFP4), the
# latter doubled to integers; ggml pairs it with half the e8m0 scale (GGML_E8M0_TO_FP32_HALF).
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
E2M1_LEVELS_X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

Dequantizer = Callable[[torch.Tensor], torch.Tensor]  # blocks [n, block_bytes] -> float32 [n, block]
RowDequantizer = Callable[[torch.Tensor, torch.dtype], torch.Tensor]
DEQUANTIZERS: dict[str, RowDequantizer] = {}


def dequantize(raw: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Raw `fmt` rows `[..., nblocks * block_bytes]` (uint8) to float32 `[..., nblocks * block]`,
    or to its cast to `dtype` (bit for bit `.to(dtype)` of the float32 values), CHUNK_WEIGHTS at
    a time."""
    if fmt not in DEQUANTIZERS:
        raise FormatError(f"no dequantizer for weight format {fmt!r}")
    return DEQUANTIZERS[fmt](raw, dtype)


def _rows(fmt: str) -> Callable[[Dequantizer], RowDequantizer]:
    """Register a blocks `[n, block_bytes]` -> `[n, block]` function as `fmt`'s row dequantizer."""
    f = FORMATS[fmt]

    def register(per_block: Dequantizer) -> RowDequantizer:
        @functools.wraps(per_block)
        def rows(raw: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            if raw.dtype != torch.uint8 or raw.ndim == 0 or raw.shape[-1] % f.block_bytes:
                raise FormatError(
                    f"{fmt} rows must be uint8 with a last dimension divisible by {f.block_bytes}, "
                    f"got {raw.dtype} {tuple(raw.shape)}"
                )
            blocks = raw.reshape(-1, f.block_bytes)
            shape = (*raw.shape[:-1], raw.shape[-1] // f.block_bytes * f.block)
            chunk = max(1, CHUNK_WEIGHTS // f.block)
            if blocks.shape[0] <= chunk:  # a slot's part, a looked-up row, on whatever device it is
                return per_block(blocks).reshape(shape).to(dtype)
            out = torch.empty(blocks.shape[0], f.block, dtype=dtype, device=raw.device)
            for start in range(0, blocks.shape[0], chunk):
                out[start : start + chunk] = per_block(blocks[start : start + chunk])
            return out.reshape(shape)

        DEQUANTIZERS[fmt] = rows
        return rows

    return register


# ---- pieces every layout is made of ----------------------------------------------------------
def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 bytes `[n, 2]` to float32 `[n, 1]` (exact, subnormals and -0 kept)."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes `[..., k]` to their 4-bit halves `[..., 2, k]`: every low nibble, then every high one
    (how ggml packs weight j with weight j + k)."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _bits(b: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes `[..., k]` to their `width`-bit fields `[..., 8 // width, k]`, lowest field first."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=b.device).reshape(-1, 1)
    return (b.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _levels(values: tuple[int, ...], index: torch.Tensor) -> torch.Tensor:
    return _level_table(values, index.device)[index.long()]


@functools.cache
def _level_table(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """One table a device, kept: a lookup captured in a CUDA graph copies nothing from the host."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins to 8 of each (ggml's get_scale_min_k4):
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the
    nibbles of bytes 8-11, their top 2 bits in the top 2 bits of bytes 0-3 and 4-7."""
    lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat((lo & 0x3F, (mix & 0x0F) | ((lo >> 6) << 4)), dim=-1)
    mins = torch.cat((hi & 0x3F, (mix >> 4) | ((hi >> 6) << 4)), dim=-1)
    return scales, mins


# ---- 32-weight blocks ------------------------------------------------------------------------
@_rows("q4_0")
def dequantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    """fp16 d, 16 bytes of nibbles q: w = d * (q - 8)."""
    q = _nibbles(b[:, 2:]).reshape(-1, 32).to(torch.int8) - 8
    return _f16(b[:, :2]) * q.to(torch.float32)


@_rows("q4_1")
def dequantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    """fp16 d, fp16 m, 16 bytes of nibbles q: w = d * q + m."""
    q = _nibbles(b[:, 4:]).reshape(-1, 32).to(torch.float32)
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _q5(b: torch.Tensor) -> torch.Tensor:
    """The 5-bit values of a q5 block's tail: 4 bytes of high bits (bit j of the little-endian u32
    is weight j's), then 16 bytes of low nibbles."""
    high = _bits(b[:, -20:-16], 1).transpose(1, 2).reshape(-1, 32)  # byte j // 8, bit j % 8
    return _nibbles(b[:, -16:]).reshape(-1, 32) | (high << 4)


@_rows("q5_0")
def dequantize_q5_0(b: torch.Tensor) -> torch.Tensor:
    """fp16 d, high bits, nibbles: w = d * (q - 16)."""
    return _f16(b[:, :2]) * (_q5(b).to(torch.int8) - 16).to(torch.float32)


@_rows("q5_1")
def dequantize_q5_1(b: torch.Tensor) -> torch.Tensor:
    """fp16 d, fp16 m, high bits, nibbles: w = d * q + m."""
    return _f16(b[:, :2]) * _q5(b).to(torch.float32) + _f16(b[:, 2:4])


@_rows("q8_0")
def dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    """fp16 d, 32 int8 q: w = d * q."""
    return b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _f16(b[:, :2])


@_rows("iq4_nl")
def dequantize_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    """fp16 d, 16 bytes of nibble indices i: w = d * IQ4_LEVELS[i]."""
    return _f16(b[:, :2]) * _levels(IQ4_LEVELS, _nibbles(b[:, 2:]).reshape(-1, 32))


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml's GGML_E8M0_TO_FP32_HALF: 2**(e - 128) as float32, exact over all 256 codes (e < 2
    lands on the subnormals 2**-128 and 2**-127)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


@_rows("mxfp4")
def dequantize_mxfp4(b: torch.Tensor) -> torch.Tensor:
    """e8m0 exponent e, 16 bytes of e2m1 nibbles i: w = 2**(e-128) * E2M1_LEVELS_X2[i]."""
    return e8m0_half(b[:, :1]) * _levels(E2M1_LEVELS_X2, _nibbles(b[:, 1:]).reshape(-1, 32))


def mxfp4_rows_from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF's MXFP4 (transformers' integrations/mxfp4.py, as gpt-oss ships its experts) as ggml's
    mxfp4 rows, which `dequantize` reads. HF: blocks [..., G, 16] uint8, element 2j of a block in
    the low nibble of byte j and 2j + 1 in the high one; scales [..., G] e8m0 bytes; a weight is
    its e2m1 value times 2**(scale - 127). ggml: per block the scale byte, then byte j holding
    element j low and j + 16 high; its doubled levels times half the scale are the same values,
    so the scale byte carries over and only the nibbles move. Returns [..., G * 17] uint8."""
    pairs = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)  # in element order
    qs = pairs[..., :16] | (pairs[..., 16:] << 4)
    return torch.cat((scales.unsqueeze(-1), qs), dim=-1).reshape(*blocks.shape[:-2], -1)


def fp8_block_dequant(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek's block-scaled FP8 (HF `quant_method: fp8`): weight [rows, cols] float8_e4m3fn,
    scale_inv [ceil(rows / b0), ceil(cols / b1)] float32, each weight times its block's
    scale_inv, in float32, rounded once to bfloat16 (DeepSeek's reference `weight_dequant`)."""
    b0, b1 = block
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(b0, dim=0)[:rows].repeat_interleave(b1, dim=1)[:, :cols]
    return (weight.float() * scale).to(torch.bfloat16)


# ---- 256-weight super-blocks -----------------------------------------------------------------
@_rows("q2_k")
def dequantize_q2_k(b: torch.Tensor) -> torch.Tensor:
    """16 scale bytes (low nibble scale, high nibble min of each 16 weights), 64 bytes of 2-bit q
    (two halves of 128 weights, each 32 bytes read four times), fp16 d, fp16 dmin:
    w = d * scale * q - dmin * min."""
    s, d, dmin = b[:, :16], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = _bits(b[:, 16:80].reshape(-1, 2, 32), 2).reshape(-1, 16, 16).to(torch.float32)
    dl = (d * (s & 0x0F).to(torch.float32)).unsqueeze(-1)
    ml = (dmin * (s >> 4).to(torch.float32)).unsqueeze(-1)
    return (dl * q - ml).reshape(-1, QK_K)


@_rows("q3_k")
def dequantize_q3_k(b: torch.Tensor) -> torch.Tensor:
    """32 bytes of high bits h (weight j: bit j // 32 of byte j % 32), 64 bytes of low 2 bits as
    in q2_k, 12 bytes of 6-bit signed scales, fp16 d: w = d * (scale - 32) * (low - 4 * (1 - h))."""
    d = _f16(b[:, 108:110])
    high = _bits(b[:, :32], 1).reshape(-1, 16, 16)
    low = _bits(b[:, 32:96].reshape(-1, 2, 32), 2).reshape(-1, 16, 16)
    q = (low.to(torch.int8) - ((high ^ 1) << 2).to(torch.int8)).to(torch.float32)
    s = b[:, 96:108]
    # scale j: low nibble from byte j % 8 (low half for j < 8), top 2 bits from byte 8 + j % 4
    # at bit 2 * (j // 4)
    low4 = _nibbles(s[:, :8]).reshape(-1, 16)
    top2 = _bits(s[:, 8:12], 2).reshape(-1, 16)
    scale = ((low4 | (top2 << 4)).to(torch.int8) - 32).to(torch.float32)
    return ((d * scale).unsqueeze(-1) * q).reshape(-1, QK_K)


def _q45_k(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's common head (fp16 d, fp16 dmin, 12 scale bytes) applied to their 8 x 32 q:
    w = d * scale * q - dmin * min."""
    scales, mins = _k_scales(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * scales.to(torch.float32)).unsqueeze(-1)
    dm = (_f16(b[:, 2:4]) * mins.to(torch.float32)).unsqueeze(-1)
    return (d * q.to(torch.float32) - dm).reshape(-1, QK_K)


@_rows("q4_k")
def dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    """Head, then 128 bytes of nibbles: 4 runs of 32 bytes, each 64 weights (lows, then highs)."""
    return _q45_k(b, _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32))


@_rows("q5_k")
def dequantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    """Head, 32 bytes of high bits (sub-block i's bit i of each byte), nibbles as in q4_k."""
    high = _bits(b[:, 16:48], 1)  # [n, 8, 32]
    low = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return _q45_k(b, low | (high << 4))


@_rows("q6_k")
def dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    """128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 weights),
    fp16 d; two halves of 128 weights: w = d * scale * (q - 32)."""
    low = _nibbles(b[:, :128].reshape(-1, 2, 64)).reshape(-1, 2, 128)
    high = _bits(b[:, 128:192].reshape(-1, 2, 32), 2).reshape(-1, 2, 128)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(-1, 16, 16).to(torch.float32)
    scale = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    return ((_f16(b[:, 208:210]) * scale).unsqueeze(-1) * q).reshape(-1, QK_K)


@_rows("iq4_xs")
def dequantize_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """fp16 d, u16 of high scale bits (2 per 32 weights), 4 bytes of low scale nibbles, 128 bytes
    of nibble indices (16 bytes per 32 weights): w = d * (scale - 32) * IQ4_LEVELS[i]."""
    high = _bits(b[:, 2:4], 2).transpose(1, 2).reshape(-1, 8)  # u16 bits 2j, 2j+1
    low = _nibbles(b[:, 4:8]).transpose(1, 2).reshape(-1, 8)  # byte j // 2, nibble j % 2
    scale = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    i = _nibbles(b[:, 8:].reshape(-1, 8, 16)).reshape(-1, 8, 32)
    return ((_f16(b[:, :2]) * scale).unsqueeze(-1) * _levels(IQ4_LEVELS, i)).reshape(-1, QK_K)
