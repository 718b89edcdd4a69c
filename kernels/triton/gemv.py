"""A batch-1 linear layer (Triton): y = W x (+ b) for one token, W [N, K] row-major.

A graph decode step multiplies one token by every dense projection of every layer. cuBLAS
runs these as small GEMMs, and at the smallest shapes its launch is most of the time: inside a
CUDA graph on the H200 (tools/bench/dense_kernels.py, qwen3-30b-a3b shapes, weights past the
L2), the router's 128 x 2048 product took 5.0 us through cuBLAS and 1.7 us here; the output
projection (2048 x 4096, a split-K kernel plus its reduction launch) 9.5 us and 6.3 us; the
Q/K/V product (5120 x 2048) 8.2 us and 7.7 us. lm_head (151936 x 2048) streams at 4.1-4.2 TB/s
either way (150 us; on H100 hosts 207.5 / 202.2 us here against cuBLAS's 218.4 / 204.8), so
one token's logits come here too, as every other one-token product. Each program owns BN output rows and streams them
whole over K, nothing reduced across programs (`tiles` says how many rows and how wide a step).
Same maths as F.linear: products summed in float32, the bias added in float32, one rounding to
the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv(x_ptr, w_ptr, b_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    acc = tl.zeros([BN, BK], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        x = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=nm)


def tiles(n: int, k: int) -> tuple[int, int, int]:
    """(BN, BK, warps) for an [n, k] weight. What the sweep of dense_kernels.py found fastest on
    the H200 at both decode shapes: about 1024 programs (eight per SM), four warps each, each
    step of the K loop a 2048-element tile (two 16-byte loads per thread). Fewer rows than that
    (the router) keep one row a program, eight warps and the widest step: those programs are
    too few to cover the loads' latency otherwise."""
    bn = 1
    while bn < 16 and n // (2 * bn) >= 1024:
        bn *= 2
    if n // bn < 1024:
        return bn, min(2048, triton.next_power_of_2(k)), 8
    return bn, min(2048 // bn, triton.next_power_of_2(k)), 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, bn: int | None = None,
         bk: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [1, K] or [K] (CUDA, contiguous weight [N, K]). The tile
    arguments (benchmarks, tests) override `tiles`' choice."""
    n, k = weight.shape
    if x.numel() != k or not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"gemv takes one contiguous token of {k} features and a contiguous weight, got "
                         f"{tuple(x.shape)}")
    auto = tiles(n, k)
    bn, bk, num_warps = bn or auto[0], min(bk or auto[1], triton.next_power_of_2(k)), num_warps or auto[2]
    out = torch.empty((*x.shape[:-1], n), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _gemv[(triton.cdiv(n, bn),)](x, weight, bias if bias is not None else weight, out, n, k, BN=bn, BK=bk,
                                 HAS_BIAS=bias is not None, num_warps=num_warps)
    return out
