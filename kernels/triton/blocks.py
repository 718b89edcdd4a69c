"""GGUF block formats decoded in registers (Triton): what the grouped expert kernels multiply.

`weights(base, n, k, mask, ROW, FMT, lut)` gives the float32 weights [n, k] of a matrix whose
rows of ROW weights are stored in format FMT (a float dtype or a block format) from byte `base`
on, row after row (FTW's
`ggml-rows` packing: ggml's blocks as GGUF stores them, kernels/dequant.py documents each).
`n` and `k` broadcast against each other, so the same call serves the GEMV's [rows, reduction]
tiles and the GEMM's transposed ones.

Each weight is decoded on its own: its block is found by arithmetic and the bytes it needs
(its quant, its sub-block's scale bytes, the block's fp16 scales) are gathered with byte loads.
Neighbouring weights share those bytes, so all but the first load of each hit L1; the decode
costs instructions, not memory traffic, and a decode step's experts are read at the rate their
bytes cross PCIe or the CPU computes (tens of GB/s), far below what this sustains. The
arithmetic is kernels/dequant.py's operation for operation (bit for bit in the interpreter;
on a GPU Triton may fuse a product and a sum into one rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftkit.kernels.dequant import E2M1_LEVELS_X2, IQ4_LEVELS

# Format codes the kernels specialise on (constexpr). TYPED (0): the weights are the slot
# pointer's own dtype (every part of the layout one float format: experts.py's float path, which
# does not come here).
TYPED = 0
CODES = {name: i for i, name in enumerate((
    "float32", "float16", "bfloat16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
    "iq4_nl", "iq4_xs", "mxfp4"), start=1)}
_LUT: dict[torch.device, torch.Tensor] = {}


def lut(device: torch.device) -> torch.Tensor:
    """The non-linear levels the decode GEMV gathers, float32 on `device`: IQ4's 16, then e2m1's
    doubled 16 (one tensor per device, kept: captured graphs point at it)."""
    if device not in _LUT:
        _LUT[device] = torch.tensor((*IQ4_LEVELS, *E2M1_LEVELS_X2), dtype=torch.float32, device=device)
    return _LUT[device]


def _words(levels: tuple[int, ...]) -> tuple[tl.constexpr, ...]:
    """16 small integer levels as four int32 words of bytes (level + 128; level i in byte i % 4
    of word i // 4), which `_pick` indexes in registers."""
    out = []
    for w in range(4):
        v = sum((levels[4 * w + i] + 128) << (8 * i) for i in range(4))
        out.append(tl.constexpr(v - (1 << 32) if v >= 1 << 31 else v))  # as an int32
    return tuple(out)


_IQ4_0, _IQ4_1, _IQ4_2, _IQ4_3 = _words(IQ4_LEVELS)
_E2M1_0, _E2M1_1, _E2M1_2, _E2M1_3 = _words(E2M1_LEVELS_X2)


@triton.jit
def _u8(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _i8(p, mask):
    b = _u8(p, mask)
    return (b ^ 0x80) - 0x80


@triton.jit
def _f16(p, mask):
    """The little-endian fp16 at bytes p, p + 1 as float32 (byte loads: no alignment needed)."""
    bits = (_u8(p, mask) | (_u8(p + 1, mask) << 8)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(p, j, mask):
    """Weight j of a 32-weight block whose 16 quant bytes start at p: low nibbles, then high."""
    return (_u8(p + j % 16, mask) >> (4 * (j // 16))) & 0xF


@triton.jit
def _pick(i, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr):
    """Level i (0..15) of the table `_words` packed, as float32."""
    word = tl.where(i < 8, tl.where(i < 4, W0, W1), tl.where(i < 12, W2, W3))
    return (((word >> (8 * (i % 4))) & 0xFF) - 128).to(tl.float32)


@triton.jit
def _level(i, mask, lut_ptr, OFF: tl.constexpr):
    """Level i (0..15) of IQ4's levels (OFF 0) or e2m1's doubled ones (OFF 16), float32. The
    decode GEMV gathers it from `lut` (memory-bound, the table in L1: picking it in registers
    took gpt-oss-20b's hybrid decode from 212 to 166 tok/s); the GEMM (lut_ptr None) picks it in
    registers (a gather in the dot's layout made its prefill on MXFP4 slots 21x slower:
    H200, 4096 tokens through a gpt-oss-20b layer, 214 ms against 10.2)."""
    if lut_ptr is None:
        if OFF == 0:
            v = _pick(i, _IQ4_0, _IQ4_1, _IQ4_2, _IQ4_3)
        else:
            v = _pick(i, _E2M1_0, _E2M1_1, _E2M1_2, _E2M1_3)
    else:
        v = tl.load(lut_ptr + OFF + i, mask=mask, other=0.0)
    return v


@triton.jit
def _q5(p, j, mask):
    """q5_0/q5_1's 5-bit value: the high bit j of the u32 at p, the nibble from p + 4."""
    return _nibble(p + 4, j, mask) | (((_u8(p + j // 8, mask) >> (j % 8)) & 1) << 4)


@triton.jit
def _k_scale_min(s, sb, mask):
    """Q4_K/Q5_K's 6-bit scale and min of sub-block sb (0..7) from the 12 bytes at s."""
    a = _u8(s + sb, mask)
    b = _u8(s + sb + 4, mask)
    c = _u8(s + tl.where(sb >= 4, sb - 4, sb), mask)
    low = sb < 4
    sc = tl.where(low, a & 63, (b & 0xF) | ((c >> 6) << 4))
    mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _k_low(q, j, mask):
    """Q4_K/Q5_K's nibble of weight j (0..255): 4 runs of 32 bytes, each 64 weights."""
    return (_u8(q + 32 * (j // 64) + j % 32, mask) >> (4 * ((j // 32) % 2))) & 0xF


@triton.jit
def _two_bits(q, j, mask):
    """Q2_K/Q3_K's 2-bit field of weight j (0..255): two halves of 32 bytes read four times."""
    return (_u8(q + 32 * (j // 128) + j % 32, mask) >> (2 * ((j % 128) // 32))) & 3


@triton.jit
def _block(base, n, k, ROW, BLK: tl.constexpr, BB: tl.constexpr):
    """(the byte address of weight (n, k)'s block, k's index in it)."""
    return base + n * (ROW // BLK * BB) + (k // BLK) * BB, k % BLK


@triton.jit
def weights(base, n, k, mask, ROW, FMT: tl.constexpr, lut_ptr):
    """Float32 weights (n, k) of a row-major matrix of ROW weights per row stored from the
    uint8 pointer `base` in format code FMT (`lut_ptr`: `lut`'s table, or None; see `_level`)."""
    if FMT == 1:  # float32
        p = (base + (n * ROW + k) * 4).to(tl.pointer_type(tl.float32), bitcast=True)
        w = tl.load(p, mask=mask, other=0.0)
    elif FMT == 2:  # float16
        p = (base + (n * ROW + k) * 2).to(tl.pointer_type(tl.float16), bitcast=True)
        w = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    elif FMT == 3:  # bfloat16
        p = (base + (n * ROW + k) * 2).to(tl.pointer_type(tl.bfloat16), bitcast=True)
        w = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    elif FMT == 4:  # q8_0: fp16 d, 32 int8 q
        b, j = _block(base, n, k, ROW, 32, 34)
        w = _i8(b + 2 + j, mask).to(tl.float32) * _f16(b, mask)
    elif FMT == 5:  # q4_0: fp16 d, nibbles: d * (q - 8)
        b, j = _block(base, n, k, ROW, 32, 18)
        w = _f16(b, mask) * (_nibble(b + 2, j, mask) - 8).to(tl.float32)
    elif FMT == 6:  # q4_1: fp16 d, fp16 m, nibbles: d * q + m
        b, j = _block(base, n, k, ROW, 32, 20)
        w = _f16(b, mask) * _nibble(b + 4, j, mask).to(tl.float32) + _f16(b + 2, mask)
    elif FMT == 7:  # q5_0: fp16 d, high bits, nibbles: d * (q - 16)
        b, j = _block(base, n, k, ROW, 32, 22)
        w = _f16(b, mask) * (_q5(b + 2, j, mask) - 16).to(tl.float32)
    elif FMT == 8:  # q5_1: fp16 d, fp16 m, high bits, nibbles: d * q + m
        b, j = _block(base, n, k, ROW, 32, 24)
        w = _f16(b, mask) * _q5(b + 4, j, mask).to(tl.float32) + _f16(b + 2, mask)
    elif FMT == 9:  # q2_k: 16 scale/min bytes, 64 bytes of 2-bit q, fp16 d, fp16 dmin
        b, j = _block(base, n, k, ROW, 256, 84)
        s = _u8(b + j // 16, mask)
        dl = _f16(b + 80, mask) * (s & 0xF).to(tl.float32)
        ml = _f16(b + 82, mask) * (s >> 4).to(tl.float32)
        w = dl * _two_bits(b + 16, j, mask).to(tl.float32) - ml
    elif FMT == 10:  # q3_k: high bits, 2-bit lows, 12 bytes of 6-bit scales, fp16 d
        b, j = _block(base, n, k, ROW, 256, 110)
        high = (_u8(b + j % 32, mask) >> (j // 32)) & 1
        q = _two_bits(b + 32, j, mask) - 4 * (1 - high)
        sj = j // 16
        low4 = (_u8(b + 96 + sj % 8, mask) >> (4 * (sj // 8))) & 0xF
        top2 = (_u8(b + 104 + sj % 4, mask) >> (2 * (sj // 4))) & 3
        w = (_f16(b + 108, mask) * ((low4 | (top2 << 4)) - 32).to(tl.float32)) * q.to(tl.float32)
    elif FMT == 11:  # q4_k: fp16 d, fp16 dmin, 12 scale bytes, 128 nibble bytes
        b, j = _block(base, n, k, ROW, 256, 144)
        sc, mn = _k_scale_min(b + 4, j // 32, mask)
        w = (_f16(b, mask) * sc) * _k_low(b + 16, j, mask).to(tl.float32) - _f16(b + 2, mask) * mn
    elif FMT == 12:  # q5_k: as q4_k with 32 bytes of high bits before the nibbles
        b, j = _block(base, n, k, ROW, 256, 176)
        sc, mn = _k_scale_min(b + 4, j // 32, mask)
        q = _k_low(b + 48, j, mask) | (((_u8(b + 16 + j % 32, mask) >> (j // 32)) & 1) << 4)
        w = (_f16(b, mask) * sc) * q.to(tl.float32) - _f16(b + 2, mask) * mn
    elif FMT == 13:  # q6_k: 128 low-nibble bytes, 64 of 2-bit highs, 16 int8 scales, fp16 d
        b, j = _block(base, n, k, ROW, 256, 210)
        half, r = j // 128, j % 128
        low = (_u8(b + 64 * half + r % 64, mask) >> (4 * (r // 64))) & 0xF
        high = (_u8(b + 128 + 32 * half + r % 32, mask) >> (2 * (r // 32))) & 3
        q = (low | (high << 4)) - 32
        w = (_f16(b + 208, mask) * _i8(b + 192 + j // 16, mask).to(tl.float32)) * q.to(tl.float32)
    elif FMT == 14:  # iq4_nl: fp16 d, nibble indices into IQ4's levels
        b, j = _block(base, n, k, ROW, 32, 18)
        w = _f16(b, mask) * _level(_nibble(b + 2, j, mask), mask, lut_ptr, 0)
    elif FMT == 15:  # iq4_xs: fp16 d, u16 high scale bits, 4 bytes of low ones, 128 index bytes
        b, j = _block(base, n, k, ROW, 256, 136)
        sb, jj = j // 32, j % 32
        high = (_u8(b + 2 + sb // 4, mask) >> (2 * (sb % 4))) & 3
        low = (_u8(b + 4 + sb // 2, mask) >> (4 * (sb % 2))) & 0xF
        idx = (_u8(b + 8 + 16 * sb + jj % 16, mask) >> (4 * (jj // 16))) & 0xF
        level = _level(idx, mask, lut_ptr, 0)
        w = (_f16(b, mask) * ((low | (high << 4)) - 32).to(tl.float32)) * level
    else:  # 16, mxfp4: e8m0 exponent e, nibble indices into e2m1's doubled levels
        tl.static_assert(FMT == 16)
        b, j = _block(base, n, k, ROW, 32, 17)
        e = _u8(b, mask)
        scale = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        w = scale * _level(_nibble(b + 1, j, mask), mask, lut_ptr, 16)
    return w


@triton.jit
def tile(base, n, kb, nmask, ROW, FMT: tl.constexpr, lut_ptr):
    """The decode GEMV's weights of rows n [BN] over the kb-th 256 of ROW, as [BN, 8, 32]:
    element (r, g, l) is weight (n[r], 256 kb + 32 g + l). Q4_K, Q6_K and Q8_0 (what people
    download most) decode their scales once per row and sub-block and load their quants as
    contiguous runs of bytes (vector loads); the other formats decode weight by weight."""
    g = tl.arange(0, 8)[None, :, None]
    lane = tl.arange(0, 32)[None, None, :]
    rows = n[:, None, None]
    k = kb * 256 + g * 32 + lane
    mask = nmask[:, None, None] & (k < ROW)
    one = nmask[:, None, None]
    if FMT == 11:  # q4_k: one super-block; sub-block g's nibbles are byte run g // 2's low or high halves
        b = base + rows * (ROW // 256 * 144) + kb * 144
        sc, mn = _k_scale_min(b + 4, g, one)
        q = (_u8(b + 16 + 32 * (g // 2) + lane, mask) >> (4 * (g % 2))) & 0xF
        w = (_f16(b, one) * sc) * q.to(tl.float32) - _f16(b + 2, one) * mn
    elif FMT == 13:  # q6_k: one super-block, halves of 128 weights (sub-blocks 0-3, 4-7)
        b = base + rows * (ROW // 256 * 210) + kb * 210
        half, quarter = g // 4, g % 4
        low = (_u8(b + 64 * half + 32 * (quarter % 2) + lane, mask) >> (4 * (quarter // 2))) & 0xF
        high = (_u8(b + 128 + 32 * half + lane, mask) >> (2 * quarter)) & 3
        scale = _i8(b + 192 + 2 * g + lane // 16, mask).to(tl.float32)
        w = (_f16(b + 208, one) * scale) * ((low | (high << 4)) - 32).to(tl.float32)
    elif FMT == 4:  # q8_0: eight blocks of 32
        b = base + rows * (ROW // 32 * 34) + (kb * 8 + g) * 34
        w = _i8(b + 2 + lane, mask).to(tl.float32) * _f16(b, one & (kb * 256 + g * 32 < ROW))
    else:
        w = weights(base, rows, k, mask, ROW, FMT, lut_ptr)
    return w


@triton.jit
def x256(x, kb, K):
    """Activations 256 kb .. 256 kb + 255 of a row of K as float32 [1, 8, 32] (`tile`'s order)."""
    k = kb * 256 + tl.arange(0, 8)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    return tl.load(x + k, mask=k < K, other=0.0).to(tl.float32)
