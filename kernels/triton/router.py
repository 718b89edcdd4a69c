"""Softmax-then-top-k routing in one launch per call (Triton), as `layers.softmax_topk` computes it;
gpt-oss's top-k-then-softmax (`layers.topk_softmax`) too.

Torch spends five to six kernels on it (softmax, top-k's gather and sort, the renormalising sum
and division, the cast); a decode step routes once per MoE layer, and inside a CUDA graph each
kernel still costs microseconds. Same maths: float32 softmax over all experts, the k largest in
descending order, optionally divided by their sum, cast to the output dtype. `top_first`: the k
largest logits, then a float32 softmax over those k alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_topk(logits_ptr, ids_ptr, w_ptr, E, K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr,
                  BLOCK: tl.constexpr, TOP_FIRST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * E + e, mask=e < E, other=-float("inf")).to(tl.float32)
    p = x  # TOP_FIRST: the logits are ranked, the softmax follows over the k picked
    if not TOP_FIRST:
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
    j = tl.arange(0, KP)
    ids = tl.zeros([KP], tl.int64)
    w = tl.zeros([KP], tl.float32)
    left = tl.where(e < E, p, -float("inf"))
    for i in tl.static_range(K):  # the largest remaining, lowest index first among equals
        top = tl.max(left, axis=0)
        at = tl.min(tl.where(left == top, e, BLOCK), axis=0)
        ids = tl.where(j == i, at.to(tl.int64), ids)
        w = tl.where(j == i, top, w)
        left = tl.where(e == at, -float("inf"), left)
    if TOP_FIRST:  # w[0] is the largest
        w = tl.where(j < K, tl.exp(w - tl.max(tl.where(j < K, w, -float("inf")), axis=0)), 0.0)
        w = w / tl.sum(w, axis=0)
    if RENORM:
        w = w / tl.sum(w, axis=0)
    tl.store(ids_ptr + row * K + j, ids, mask=j < K)
    tl.store(w_ptr + row * K + j, w.to(w_ptr.dtype.element_ty), mask=j < K)


def softmax_topk(logits: torch.Tensor, k: int, renorm: bool, dtype: torch.dtype,
                 num_warps: int = 1, top_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [T, k], weights [T, k] of `dtype`) for CUDA logits [T, E] (E up to 4096).
    One warp per row by default: its reductions are then shuffles, no shared-memory barriers
    (H200, in a graph: 2.3 us a launch against 3.5 with four warps)."""
    t, e = logits.shape
    logits = logits.contiguous()
    ids = torch.empty((t, k), dtype=torch.int64, device=logits.device)
    w = torch.empty((t, k), dtype=dtype, device=logits.device)
    if t:
        _softmax_topk[(t,)](logits, ids, w, e, K=k, KP=triton.next_power_of_2(k), RENORM=renorm,
                            BLOCK=triton.next_power_of_2(e), TOP_FIRST=top_first, num_warps=num_warps)
    return ids, w
