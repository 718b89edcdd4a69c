"""Few-token products with a dense weight kept in GGUF blocks on the GPU (Triton): lm_head and
the attention projections of a Q4_K_M file, read at their quantized bytes.

A GGUF row interleaves each block's scales with its quants (Q6_K's 210-byte blocks are not even
4-byte aligned), so a kernel on the stored rows loads bytes one at a time. `pack` splits each
format's blocks into planes once, at load: quants, high bits, scales and fp16 factors each
contiguous per row, every byte kept (the planes hold exactly the stored bytes, so a plan's
counts stay `stored_nbytes`), and the kernel reads the quants in 16-byte vectors. Q6_K's low
nibbles are reordered so that, as in Q4_K, byte l of each 64 weights holds weight l (low
nibble) and weight l + 32 (high nibble); `unpack` gives the stored rows back.

`block_gemv` multiplies one to MAX_TOKENS tokens: per program BN rows over the whole reduction
in steps of C * 64 weights, each 64 a [2, 16] tile of bytes (their low and high nibbles); the
quants' products are summed per sub-block in float32 and then scaled, and Q4_K's mins are taken
off through the activations' sums (the weights are kernels/dequant.py's, exactly; the order of
sums is the kernel's own: equal to F.linear with the dequantized weight within float32
rounding). A program per token and row block, the token fastest, so the programs of one row
block run together and read its bytes once from memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftkit.kernels.dequant import dequantize
from ftkit.kernels.triton.blocks import CODES, _k_scale_min
from ftkit.vocab import FORMATS, PLANE_FORMATS

MAX_TOKENS = 8  # a batched decode step's; longer inputs multiply the dequantized weight


@dataclass(frozen=True)
class Planes:
    """A dense weight [n, k] in `fmt`'s blocks, split by `pack` (uint8 planes [n, bytes a row],
    `d` fp16): Q4_K: q the 128 nibble bytes of each block, s its 12 scale bytes, d its (d, dmin);
    Q6_K: q the low nibbles (reordered), h the 64 high-bit bytes, s the 16 int8 scales, d;
    Q8_0: q the int8 quants, d each block's scale."""

    fmt: str
    n: int
    k: int
    q: torch.Tensor
    d: torch.Tensor
    h: torch.Tensor | None = None
    s: torch.Tensor | None = None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.q, self.h, self.s, self.d) if t is not None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def device(self) -> torch.device:
        return self.q.device

    def rows(self, start: int, stop: int) -> Planes:
        """Rows start..stop-1 (views)."""
        cut = {name: t[start:stop] if t is not None else None for name, t in
               (("q", self.q), ("h", self.h), ("s", self.s), ("d", self.d))}
        return Planes(self.fmt, stop - start, self.k, **cut)

    @staticmethod
    def cat(parts: list[Planes]) -> Planes:
        """The rows of `parts` (one format, one k) one after another."""
        first = parts[0]
        if any(p.fmt != first.fmt or p.k != first.k for p in parts):
            raise ValueError("Planes.cat takes weights of one format and one row length")
        join = {name: torch.cat([getattr(p, name) for p in parts]) if getattr(first, name) is not None else None
                for name in ("q", "h", "s", "d")}
        return Planes(first.fmt, sum(p.n for p in parts), first.k, **join)


def _swap_nibbles_q6(ql: torch.Tensor) -> torch.Tensor:
    """Q6_K's low-nibble bytes [..., 2 halves, 64] (byte m of a half: weight m low, m + 64 high)
    in Q4_K's order (per 64 weights, byte l: weight l low, l + 32 high); `_unswap_nibbles_q6`
    undoes it."""
    a, b = ql[..., :32], ql[..., 32:]
    first = (a & 0x0F) | ((b & 0x0F) << 4)  # weights 0..31 low, 32..63 high
    second = (a >> 4) | (b & 0xF0)  # weights 64..95 low, 96..127 high
    return torch.stack((first, second), dim=-2).reshape(ql.shape)


def _unswap_nibbles_q6(q: torch.Tensor) -> torch.Tensor:
    first, second = q[..., :32], q[..., 32:]
    a = (first & 0x0F) | ((second & 0x0F) << 4)  # weights 0..31 low, 64..95 high
    b = (first >> 4) | (second & 0xF0)  # weights 32..63 low, 96..127 high
    return torch.stack((a, b), dim=-2).reshape(q.shape)


def pack(raw: torch.Tensor, fmt: str, n: int, k: int) -> Planes:
    """Stored rows uint8 [n, bytes a row] of `fmt` (one of PLANE_FORMATS) as planes, on raw's device."""
    f = FORMATS[fmt]
    if fmt not in PLANE_FORMATS or k % 256 or raw.dtype != torch.uint8 or tuple(raw.shape) != (n, k // f.block * f.block_bytes):
        raise ValueError(f"pack takes {'/'.join(PLANE_FORMATS)} rows of a multiple of 256 weights as uint8 "
                         f"[{n}, {k // f.block * f.block_bytes}], got {fmt} {raw.dtype} {tuple(raw.shape)}")
    b = raw.reshape(n, k // f.block, f.block_bytes)
    if fmt == "q8_0":
        return Planes(fmt, n, k, q=b[..., 2:].reshape(n, k).contiguous(),
                      d=b[..., :2].contiguous().view(torch.float16).reshape(n, -1))
    if fmt == "q4_k":
        return Planes(fmt, n, k, q=b[..., 16:].reshape(n, -1).contiguous(), s=b[..., 4:16].reshape(n, -1).contiguous(),
                      d=b[..., :4].contiguous().view(torch.float16).reshape(n, -1))
    ql = _swap_nibbles_q6(b[..., :128].reshape(n, -1, 2, 64))
    return Planes(fmt, n, k, q=ql.reshape(n, -1).contiguous(), h=b[..., 128:192].reshape(n, -1).contiguous(),
                  s=b[..., 192:208].reshape(n, -1).contiguous(),
                  d=b[..., 208:].contiguous().view(torch.float16).reshape(n, -1))


def unpack(p: Planes) -> torch.Tensor:
    """The stored rows again: `pack`'s inverse."""
    nb = p.k // 256 * (8 if p.fmt == "q8_0" else 1)
    d = p.d.reshape(p.n, nb, -1).view(torch.uint8)
    if p.fmt == "q8_0":
        parts = [d, p.q.reshape(p.n, nb, 32)]
    elif p.fmt == "q4_k":
        parts = [d, p.s.reshape(p.n, nb, 12), p.q.reshape(p.n, nb, 128)]
    else:
        ql = _unswap_nibbles_q6(p.q.reshape(p.n, nb, 2, 64)).reshape(p.n, nb, 128)
        parts = [ql, p.h.reshape(p.n, nb, 64), p.s.reshape(p.n, nb, 16), d]
    return torch.cat(parts, dim=-1).reshape(p.n, -1)


def dequantized(p: Planes, dtype: torch.dtype) -> torch.Tensor:
    """The weight [n, k] as `dtype` (kernels/dequant.py's values)."""
    return dequantize(unpack(p), p.fmt, dtype)


@triton.jit
def _small_float(v, zero: tl.constexpr):
    """The int32 v (0 <= v < 2^23) minus `zero` as float32, exactly: v's bits under 2^23's
    exponent, then 2^23 + zero off. An int-to-float conversion runs at a quarter of the float
    units' rate and held the decode at ~1.5 TB/s (H100, lm_head as Q4_K / Q6_K: 120 / 160 us)."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + zero)


@triton.jit
def _block_gemv(x_ptr, q_ptr, h_ptr, s_ptr, d_ptr, b_ptr, out_ptr, N, K, T, QS, HS, SS, DS,
                FMT: tl.constexpr, BN: tl.constexpr, C: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    t = pid % T
    n = (pid // T) * BN + tl.arange(0, BN)
    nm = n < N
    rows = n.to(tl.int64)
    x_row = x_ptr + t.to(tl.int64) * K
    c_ = tl.arange(0, C)
    half = tl.arange(0, 2)
    lane = tl.arange(0, 16)
    acc = tl.zeros([BN, C], tl.float32)
    for c0 in range(0, K // 64, C):
        c = c0 + c_  # chunks of 64 weights
        cm = c < K // 64
        m2 = nm[:, None] & cm[None, :]
        m4 = m2[:, :, None, None]
        l = half[None, :, None] * 16 + lane[None, None, :]  # noqa: E741 (byte l of a chunk: [1, 2, 16])
        xo = c[:, None, None] * 64 + l
        if FMT == 4:  # q8_0: a chunk is two blocks of 32 int8; half picks the block
            xo8 = c[:, None, None] * 64 + half[None, :, None] * 32
            at = rows[:, None, None, None] * QS + xo8[None] + lane[None, None, None, :]
            at = tl.max_contiguous(tl.multiple_of(at, [1, 1, 1, 16]), [1, 1, 1, 16])
            # int8 q as its byte with the sign bit flipped (q + 128), less 128
            q0 = _small_float(tl.load(q_ptr + at, mask=m4, other=0x80).to(tl.int32) ^ 0x80, 128.0)
            q1 = _small_float(tl.load(q_ptr + at + 16, mask=m4, other=0x80).to(tl.int32) ^ 0x80, 128.0)
            x0 = tl.load(x_row + xo8 + lane[None, None, :], mask=cm[:, None, None], other=0.0).to(tl.float32)
            x1 = tl.load(x_row + xo8 + 16 + lane[None, None, :], mask=cm[:, None, None], other=0.0).to(tl.float32)
            part = tl.sum(q0 * x0[None], axis=3) + tl.sum(q1 * x1[None], axis=3)  # [BN, C, 2]
            blk = c[None, :, None] * 2 + half[None, None, :]
            d = tl.load(d_ptr + rows[:, None, None] * DS + blk, mask=m2[:, :, None], other=0.0).to(tl.float32)
            acc += tl.sum(part * d, axis=2)
        else:
            at = rows[:, None, None, None] * QS + (c[:, None, None] * 32 + l)[None]
            at = tl.max_contiguous(tl.multiple_of(at, [1, 1, 1, 16]), [1, 1, 1, 16])  # 16-byte loads
            qb = tl.load(q_ptr + at, mask=m4, other=0).to(tl.int32)
            lo, hi = qb & 0xF, qb >> 4
            x_lo = tl.load(x_row + xo, mask=cm[:, None, None], other=0.0).to(tl.float32)
            x_hi = tl.load(x_row + xo + 32, mask=cm[:, None, None], other=0.0).to(tl.float32)
            blk = c // 4  # the chunk's 256-weight block
            if FMT == 11:  # q4_k: sub-blocks 2j (low nibbles) and 2j + 1 (high) of the block's chunk j
                s_lo = tl.sum(tl.sum(_small_float(lo, 0.0) * x_lo[None], axis=3), axis=2)
                s_hi = tl.sum(tl.sum(_small_float(hi, 0.0) * x_hi[None], axis=3), axis=2)
                sb = 2 * (c % 4)[None, :]
                sp = s_ptr + rows[:, None] * SS + blk[None, :] * 12
                sc_lo, mn_lo = _k_scale_min(sp, sb, m2)
                sc_hi, mn_hi = _k_scale_min(sp, sb + 1, m2)
                dp = d_ptr + rows[:, None] * DS + 2 * blk[None, :]
                d = tl.load(dp, mask=m2, other=0.0).to(tl.float32)
                dmin = tl.load(dp + 1, mask=m2, other=0.0).to(tl.float32)
                xs_lo = tl.sum(tl.sum(x_lo, axis=2), axis=1)[None, :]
                xs_hi = tl.sum(tl.sum(x_hi, axis=2), axis=1)[None, :]
                acc += ((d * sc_lo) * s_lo + (d * sc_hi) * s_hi) - ((dmin * mn_lo) * xs_lo + (dmin * mn_hi) * xs_hi)
            else:  # q6_k: the high 2 bits of weight l (+ 32) of chunk j in byte l of its half, bits 4 (j % 2) (+ 2)
                tl.static_assert(FMT == 13)
                hb = tl.load(h_ptr + rows[:, None, None, None] * HS + ((c // 2)[:, None, None] * 32 + l)[None],
                             mask=m4, other=0).to(tl.int32)
                shift = (4 * (c % 2))[None, :, None, None]
                w_lo = _small_float(lo | (((hb >> shift) & 3) << 4), 32.0)
                w_hi = _small_float(hi | (((hb >> (shift + 2)) & 3) << 4), 32.0)
                p_lo = tl.sum(w_lo * x_lo[None], axis=3)  # [BN, C, 2]: sub-blocks of 16
                p_hi = tl.sum(w_hi * x_hi[None], axis=3)
                sub = (c * 4)[None, :, None] + half[None, None, :]  # scale of weights l: 4 j + l // 16
                sp = s_ptr + rows[:, None, None] * SS + sub
                m3 = m2[:, :, None]
                sc_lo = tl.load(sp, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
                sc_hi = tl.load(sp + 2, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
                d = tl.load(d_ptr + rows[:, None] * DS + blk[None, :], mask=m2, other=0.0).to(tl.float32)
                acc += d * tl.sum(sc_lo * p_lo + sc_hi * p_hi, axis=2)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * N + n, y.to(out_ptr.dtype.element_ty), mask=nm)


def block_tiles(n: int, k: int) -> tuple[int, int, int]:
    """(BN rows, C chunks of 64 a step, warps) for an [n, k] weight, as the sweep of
    tools/bench/dense_kernels.py found fastest on an H100: lm_head-sized weights 16 rows a program
    in steps of 512 weights, attention-sized ones 8 or 4 rows in steps of 1024; four warps."""
    if n >= 65536:
        return 16, min(8, triton.next_power_of_2(k // 64)), 4
    return (8 if n >= 4096 else 4), min(16, triton.next_power_of_2(k // 64)), 4


def block_gemv(x: torch.Tensor, w: Planes, bias: torch.Tensor | None = None, bn: int | None = None,
               chunks: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """F.linear(x, W, bias) for x [..., k] of at most MAX_TOKENS tokens (CUDA, contiguous) and W
    `pack`ed; products summed in float32, one rounding to x's dtype. The tile arguments
    (benchmarks, tests) override `block_tiles`' choice."""
    tokens = x.numel() // w.k if x.numel() % w.k == 0 else 0
    if not x.is_contiguous() or not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"block_gemv takes 1 to {MAX_TOKENS} contiguous tokens of {w.k} features, got "
                         f"{tuple(x.shape)}")
    auto = block_tiles(w.n, w.k)
    bn, c, warps = bn or auto[0], chunks or auto[1], num_warps or auto[2]
    out = torch.empty((*x.shape[:-1], w.n), dtype=x.dtype, device=x.device)
    h, s = (w.h if w.h is not None else w.q), (w.s if w.s is not None else w.q)
    _block_gemv[(tokens * triton.cdiv(w.n, bn),)](
        x, w.q, h, s, w.d, bias if bias is not None else x, out, w.n, w.k, tokens, w.q.shape[1], h.shape[1],
        s.shape[1], w.d.shape[1], FMT=CODES[w.fmt], BN=bn, C=c, HAS_BIAS=bias is not None, num_warps=warps)
    return out
