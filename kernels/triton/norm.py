"""RMSNorm in one launch per call (Triton), numerically as `layers.rms_norm` computes it.

Eager torch spends seven kernels on an RMSNorm (cast, square, mean, add, rsqrt, scale, cast,
weight); a decode step has four norms per layer, and inside a CUDA graph each kernel still costs
microseconds. Same maths: float32 statistics, the normalised value cast to x's dtype, then the
weight product in the promoted dtype. `offset=True` is Qwen3-Next's form instead: the value times
(1 + weight), all in float32, then the cast; `float32=True` gpt-oss's: the value times the weight
in float32, then the cast. `add_rms_norm` also takes the residual add that
precedes every norm of a decoder layer into the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, n, eps, BLOCK: tl.constexpr, ADD: tl.constexpr,
              OFFSET: tl.constexpr, FLOAT32: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < n
    x = tl.load(x_ptr + row * n + c, mask=m, other=0.0)
    if ADD:  # as torch's x + delta: summed in float32, rounded to the sum's dtype
        x = x.to(tl.float32) + tl.load(d_ptr + row * n + c, mask=m, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n + c, x, mask=m)
    dtype = x.dtype
    x = x.to(tl.float32)
    h = x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    if OFFSET:
        w = w + 1.0
    if not (OFFSET or FLOAT32):  # the product of the rounded value
        h = h.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * n + c, (w * h).to(out_ptr.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.is_contiguous() else x2.contiguous()


def _dtype(x: torch.Tensor, weight: torch.Tensor, offset: bool, float32: bool) -> torch.dtype:
    return x.dtype if offset or float32 else torch.promote_types(x.dtype, weight.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
             float32: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of a CUDA tensor (rows up to 16384 wide)."""
    n = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=_dtype(x, weight, offset, float32), device=x.device)
    if x2.shape[0]:
        _rms_norm[(x2.shape[0],)](x2, x2, weight, x2, out, n, eps, BLOCK=triton.next_power_of_2(n), ADD=False,
                                  OFFSET=offset, FLOAT32=float32)
    return out.view(*x.shape[:-1], n)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float, offset: bool = False, float32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s, weight, eps)) for s = x + delta (same shape), in one launch; the values
    are torch's for those two ops."""
    n = x.shape[-1]
    x2, d2 = _rows(x), _rows(delta)
    s = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, delta.dtype), device=x.device)
    out = torch.empty(x2.shape, dtype=_dtype(s, weight, offset, float32), device=x.device)
    if x2.shape[0]:
        _rms_norm[(x2.shape[0],)](x2, d2, weight, s, out, n, eps, BLOCK=triton.next_power_of_2(n), ADD=True,
                                  OFFSET=offset, FLOAT32=float32)
    return s.view(x.shape), out.view(x.shape)
