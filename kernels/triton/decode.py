"""A batch-1 decode step's norms, RoPE and cache writes in one launch per layer (Triton); it
also serves a few tokens at once (an extend), and one token of each of several sequences (a
batched step: each token at its own position, written into its own sequence's cache). Attention
follows in kernels/triton/attention.py.

In eager torch the step between the Q/K/V projections and the output projection is about
twenty small kernels per layer (per-head norms, rotate-half RoPE on q and k, two cache writes,
float casts, scores, mask, softmax, weighted sum); inside a CUDA graph each still costs a few
microseconds of GPU time and a node of launch work. Here `rope_store`, per head: the optional
RMSNorm over head_dim (Qwen3), rotary embedding at the step's position (read on the device), q
written out, k and v written into the static K/V rows at that position.
Numerically as `layers.rms_norm` and `apply_rope`, to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_store(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, qout_ptr, kc_ptr, vc_ptr, caches_ptr,
                eps, q_stride, k_stride, v_stride, table_start, ring, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                D: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr, BATCH: tl.constexpr,
                RING: tl.constexpr):
    h, t = tl.program_id(0), tl.program_id(1)
    kc, vc = kc_ptr, vc_ptr
    if BATCH:  # token t is its own sequence's: its position, its K and V caches' addresses
        pos = tl.load(pos_ptr + t).to(tl.int64)
        kc = tl.load(caches_ptr + t).to(tl.pointer_type(kc_ptr.dtype.element_ty))
        vc = tl.load(caches_ptr + tl.num_programs(1) + t).to(tl.pointer_type(vc_ptr.dtype.element_ty))
    else:
        pos = tl.load(pos_ptr).to(tl.int64) + t
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    rm = d < R
    partner = tl.where(d < R // 2, d + R // 2, d - R // 2)
    kh = h - HEADS
    src = q_ptr + t * q_stride + h * D
    w_ptr = qw_ptr
    if h >= HEADS:
        src = k_ptr + t * k_stride + kh * D
        w_ptr = kw_ptr
    x = tl.load(src + d, mask=dm, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=rm, other=0.0).to(tl.float32)
    dtype = q_ptr.dtype.element_ty
    if NORM:  # as layers.rms_norm: float32 statistics, cast back, then the weight
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        x = ((x * inv).to(dtype).to(tl.float32) * tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)).to(dtype)
        xp = ((xp * inv).to(dtype).to(tl.float32) * tl.load(w_ptr + partner, mask=rm, other=0.0).to(tl.float32)).to(dtype)
        x, xp = x.to(tl.float32), xp.to(tl.float32)
    c = tl.load(cos_ptr + (pos - table_start) * R + d, mask=rm, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + (pos - table_start) * R + d, mask=rm, other=0.0).to(tl.float32)
    out = tl.where(rm, x * c + tl.where(d < R // 2, -xp, xp) * s, x).to(dtype)
    if h < HEADS:
        tl.store(qout_ptr + (t * HEADS + h) * D + d, out, mask=dm)
    else:
        at = pos
        if RING:  # a sliding layer's ring: position p at row p mod ring
            at = pos % ring
        row = (at * KV_HEADS + kh) * D
        tl.store(kc + row + d, out, mask=dm)
        tl.store(vc + row + d, tl.load(v_ptr + t * v_stride + kh * D + d, mask=dm), mask=dm)


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor | None,
               k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, table_start: int = 0,
               caches: torch.Tensor | None = None, ring: int = 0) -> torch.Tensor:
    """q [T, heads*D], k, v [T, kv_heads*D] (projections; rows may be strided, as the column
    views of one Q/K/V product are); q_norm, k_norm: per-head RMSNorm weights [D] or None; cos,
    sin [positions, R]: row r holds position table_start + r; pos int64 [1] on the device: the
    first token's position; k_cache, v_cache [positions, kv_heads, D]. Writes rows pos..pos+T of
    the caches; returns the rotated q [T, heads, D].
    The batch form, `caches` given: the T tokens are T sequences' next ones, pos int64 [T] holds
    each one's position and `caches` int64 [2, T] on the device the addresses of token t's
    sequence's K cache (row 0) and V cache, contiguous, typed and laid out as k_cache and v_cache
    (which are not written then); row pos[t] of each is written. `ring` (a sliding layer's,
    models/kv.py): position p goes to row p mod ring instead."""
    kv_heads, d = k_cache.shape[1], k_cache.shape[2]
    t, heads = q.shape[0], q.shape[-1] // d
    if any(a.stride(-1) != 1 for a in (q, k, v)):
        raise ValueError("rope_store reads rows whose channels are contiguous")
    out = torch.empty((t, heads, d), dtype=q.dtype, device=q.device)
    norm = q_norm is not None
    _rope_store[(heads + kv_heads, t)](q, k, v, q_norm if norm else q, k_norm if norm else k, cos, sin, pos, out,
                                       k_cache, v_cache, caches if caches is not None else pos, eps, q.stride(0),
                                       k.stride(0), v.stride(0), table_start, ring, HEADS=heads, KV_HEADS=kv_heads,
                                       D=d, R=cos.shape[-1], BLOCK_D=triton.next_power_of_2(d), NORM=norm,
                                       BATCH=caches is not None, RING=ring > 0)
    return out
