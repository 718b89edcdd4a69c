"""A gated-DeltaNet layer's recurrent core (Qwen3-Next) on CUDA: one decode token in two
launches, and the scan over a prompt's chunks in one.

In torch the token's causal conv, the delta-rule step and the gated RMSNorm are some fifty small
kernels a layer, each reading the [heads, Dk, Dv] float32 state or a sliver of a vector; inside
a CUDA graph each still costs microseconds, and 36 of the 48 layers of Qwen3-Next-80B are of
this kind. Here:
- `conv_step`: the depthwise causal conv over the previous K-1 inputs and this one, SiLU, and
  the shift of the conv state, per channel;
- `delta_step`: per value head, the L2-normalised query and key of its key head, the decay
  g = -exp(A_log) * softplus(a + dt_bias) and rate beta = sigmoid(b), one step of the delta
  rule on the head's state (read and written once), and the gated RMSNorm of its output.
- `chunk_scan`: the sequential part of the chunked prefill, the only part that loops: per chunk,
  the new values against the carried state, the chunk's output and the state passed on. In torch
  that is a Python loop of some ten launches per 64-token chunk (a 32k-token prompt: 5,000 a
  layer, host-bound); here one program per (value head, BV value columns) keeps its [Dk, BV]
  slice of the state in registers and walks every chunk.
The maths and roundings are models/qwen3_next.py's (float32 state and sums, the casts where the
torch code casts); only the order of the float32 sums differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_step(x_ptr, s_ptr, w_ptr, out_ptr, C, KS: tl.constexpr, BC: tl.constexpr):
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    m = c < C
    row = c.to(tl.int64)
    x = tl.load(x_ptr + c, mask=m, other=0.0).to(s_ptr.dtype.element_ty)
    acc = tl.load(w_ptr + row * KS + KS - 1, mask=m, other=0.0).to(tl.float32) * x.to(tl.float32)
    for j in tl.static_range(KS - 1):  # then shift: each read index is past every one written so far
        prev = tl.load(s_ptr + row * (KS - 1) + j, mask=m, other=0.0)
        acc += tl.load(w_ptr + row * KS + j, mask=m, other=0.0).to(tl.float32) * prev.to(tl.float32)
    for j in tl.static_range(KS - 2):
        tl.store(s_ptr + row * (KS - 1) + j, tl.load(s_ptr + row * (KS - 1) + j + 1, mask=m), mask=m)
    tl.store(s_ptr + row * (KS - 1) + KS - 2, x, mask=m)
    acc = acc.to(w_ptr.dtype.element_ty).to(tl.float32)  # conv1d's output dtype, then SiLU's rounding
    tl.store(out_ptr + c, (acc * tl.sigmoid(acc)).to(w_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=m)


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(causal depthwise conv) of one token's channels x [C], given the previous inputs
    `state` [C, K-1] (shifted in place to end with x); weight [C, 1, K]. Returns [C] in x's dtype."""
    c, ks = weight.shape[0], weight.shape[-1]
    out = torch.empty(c, dtype=x.dtype, device=x.device)
    block = 256
    _conv_step[(triton.cdiv(c, block),)](x, state, weight, out, c, KS=ks, BC=block)
    return out


@triton.jit
def _delta_step(qkv_ptr, z_ptr, b_ptr, a_ptr, alog_ptr, dt_ptr, s_ptr, nw_ptr, out_ptr, R, eps,
                HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    h = tl.program_id(0)
    kh = h // R  # as repeat_interleave: value head h reads key head h // R
    i, j = tl.arange(0, BK), tl.arange(0, BV)
    im, jm = i < DK, j < DV
    q = tl.load(qkv_ptr + kh * DK + i, mask=im, other=0.0).to(tl.float32)
    k = tl.load(qkv_ptr + HK * DK + kh * DK + i, mask=im, other=0.0).to(tl.float32)
    v = tl.load(qkv_ptr + 2 * HK * DK + h * DV + j, mask=jm, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    b = tl.load(b_ptr + h).to(tl.float32)
    beta = tl.sigmoid(b).to(b_ptr.dtype.element_ty).to(tl.float32)  # sigmoid in the activations' dtype
    x = tl.load(a_ptr + h).to(tl.float32) + tl.load(dt_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's threshold
    g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus
    ptr = s_ptr + h.to(tl.int64) * DK * DV + i[:, None] * DV + j[None, :]
    sm = im[:, None] & jm[None, :]
    s = tl.load(ptr, mask=sm, other=0.0) * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(ptr, s, mask=sm)
    o = tl.sum(s * q[:, None], axis=0).to(out_ptr.dtype.element_ty).to(tl.float32)
    # the gated RMSNorm over the head's values: float32 statistics, the weight times the cast-back
    # value (rounded as that product is), times silu(z) in float32, then the cast
    o = o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps)
    w = tl.load(nw_ptr + j, mask=jm, other=0.0).to(tl.float32)
    o = (w * o.to(out_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty).to(tl.float32)
    z = tl.load(z_ptr + h * DV + j, mask=jm, other=0.0).to(tl.float32)
    tl.store(out_ptr + h * DV + j, (o * z * tl.sigmoid(z)).to(out_ptr.dtype.element_ty), mask=jm)


def delta_step(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor, state: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One token: qkv [2 * Hk * Dk + Hv * Dv] (the conv's output), z [Hv * Dv], b, a [Hv] (the
    activations' dtype), A_log, dt_bias [Hv]; state [Hv, Dk, Dv] float32, advanced in place.
    Returns the gated-normed output [Hv * Dv] in qkv's dtype, ready for out_proj."""
    hv, dk, dv = state.shape
    hk = (qkv.numel() - hv * dv) // (2 * dk)
    out = torch.empty(hv * dv, dtype=qkv.dtype, device=qkv.device)
    bk, bv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    _delta_step[(hv,)](qkv, z, b, a, a_log, dt_bias, state, norm_weight, out, hv // hk, eps,
                       HK=hk, DK=dk, DV=dv, BK=bk, BV=bv, num_warps=8 if bk * bv >= 8192 else 4)
    return out


# Two stages of the loop's loads in flight: at C=64, Dk=Dv=128, BV=32 that is 139 KB of shared
# memory; the default three need 262 KB, past an H100/H200's 227 KB.
SCAN_LAUNCH = dict(num_warps=4, num_stages=2)


@triton.jit
def _chunk_scan(q_ptr, k_ptr, v_ptr, kc_ptr, intra_ptr, decay_ptr, s_ptr, out_ptr, N, C: tl.constexpr,
                DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    h = tl.program_id(0)
    c, dk, dv = tl.arange(0, C), tl.arange(0, DK), tl.program_id(1) * BV + tl.arange(0, BV)
    s_at = h.to(tl.int64) * DK * DV + dk[:, None] * DV + dv[None, :]
    state = tl.load(s_ptr + s_at)
    for i in range(N):
        n = h.to(tl.int64) * N + i  # the chunk's index in [H, N]
        at_k = n * C * DK + c[:, None] * DK + dk[None, :]
        at_v = n * C * DV + c[:, None] * DV + dv[None, :]
        v_new = tl.load(v_ptr + at_v) - tl.dot(tl.load(kc_ptr + at_k), state, input_precision=PREC)
        intra = tl.load(intra_ptr + n * C * C + c[:, None] * C + c[None, :])
        out = tl.dot(tl.load(q_ptr + at_k), state, input_precision=PREC)
        out += tl.dot(intra, v_new, input_precision=PREC)
        tl.store(out_ptr + at_v, out)
        k = tl.load(k_ptr + at_k)
        state = state * tl.load(decay_ptr + n) + tl.dot(tl.trans(k), v_new, input_precision=PREC)
    tl.store(s_ptr + s_at, state)


def chunk_scan(q: torch.Tensor, k: torch.Tensor, new_values: torch.Tensor, k_cumdecay: torch.Tensor,
               intra: torch.Tensor, chunk_decay: torch.Tensor, state: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The scan of `qwen3_next.scan_chunks` (same arguments, float32: q, k, k_cumdecay
    [H, N, C, Dk], new_values [H, N, C, Dv], intra [H, N, C, C], chunk_decay [H, N], state
    [H, Dk, Dv]). Returns (out [H, N, C, Dv], the new state), or None where the shapes do not
    suit the kernel (a dimension not a power of two or under 16)."""
    h, n, c, dk = k.shape
    dv = new_values.shape[-1]
    if any(d < 16 or d & (d - 1) for d in (c, dk, dv)):
        return None
    bv = min(32, dv)
    out = torch.empty(new_values.shape, dtype=torch.float32, device=q.device)  # row-major, as the kernel writes
    state = state.clone(memory_format=torch.contiguous_format)
    args = (x.contiguous() for x in (q, k, new_values, k_cumdecay, intra, chunk_decay))  # solve_triangular's: column-major
    _chunk_scan[(h, dv // bv)](*args, state, out, n, C=c, DK=dk, DV=dv, BV=bv, PREC="ieee", **SCAN_LAUNCH)
    return out, state
