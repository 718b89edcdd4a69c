"""One decode token through a gated-DeltaNet layer's recurrent core (Qwen3-Next), in two launches.

In torch the token's causal conv, the delta-rule step and the gated RMSNorm are some fifty small
kernels a layer, each reading the [heads, Dk, Dv] float32 state or a sliver of a vector; inside
a CUDA graph each still costs microseconds, and 36 of the 48 layers of Qwen3-Next-80B are of
this kind. Here:
- `conv_step`: the depthwise causal conv over the previous K-1 inputs and this one, SiLU, and
  the shift of the conv state, per channel;
- `delta_step`: per value head, the L2-normalised query and key of its key head, the decay
  g = -exp(A_log) * softplus(a + dt_bias) and rate beta = sigmoid(b), one step of the delta
  rule on the head's state (read and written once), and the gated RMSNorm of its output.
The maths and roundings are models/qwen3_next_forward.py's (float32 state and sums, the casts where the
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
