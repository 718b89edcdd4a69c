"""Qwen3-Next's forward pass: the gated DeltaNet (chunked and recurrent delta rule, its conv
state) and the gated attention, over the shared MoE decoder. The layout of the weights and the
state is described with the family, in qwen3_next.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftkit.kernels.triton import optional

from ..spec import LINEAR_ATTENTION, ModelSpec
from .decoder import Experts, KVAttend, MoEDecoder
from .kv import KVCache
from .layers import apply_rope, rms_norm

CHUNK = 64  # transformers' torch_chunk_gated_delta_rule default
# Chunks whose scan operands are formed at once: their memory (two [Hv, Dk, Dk|Dv] float32 per
# chunk, 4 MB at 32 heads of 128) stays bounded however long the prompt.
SCAN_BLOCK = 16


# ---- numerics (mirroring transformers' modeling_qwen3_next) ----------------------------------
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3NextRMSNormGated: norm in float32, weight times the cast-back value, times silu(gate)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * F.silu(gate.float())).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. q, k [H, T, Dk], v [H, T, Dv], g, beta [H, T] (float32, q/k normalised and
    q scaled); state [H, Dk, Dv]. Returns (out [H, T, Dv], new state)."""
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        kv_mem = (state * k[:, t, :, None]).sum(dim=-2)
        delta = (v[:, t] - kv_mem) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (state * q[:, t, :, None]).sum(dim=-2)
    return out, state


def delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    chunk: int = CHUNK, batched: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence, `chunk` tokens at a time (transformers' torch_chunk_gated_delta_rule
    without the batch dimension): a UT transform inside each chunk, a scan over chunks.
    `batched` (None: on CUDA) picks the scan's form: `_scan_batched`, few launches, where the
    launches are the cost, or `_scan_stepwise`, fewer flops, where the flops are (on a CPU
    the batched form is ~1.8x slower at Qwen3-Next's 128-wide heads)."""
    h, t, _ = k.shape
    pad = (chunk - t % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    n = (t + pad) // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(h, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(h, n, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    kt = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)
    decay = cum[..., -1].exp()  # [h, n]: the state's decay over each chunk
    scan = _scan_batched if (q.is_cuda if batched is None else batched) else _scan_stepwise
    out, state = scan(q, kt, intra, new_values, k_cumdecay, decay, state.to(new_values, copy=True))
    return out.reshape(h, n * chunk, -1)[:, :t], state


def _scan_stepwise(q, kt, intra, nv, kc, decay, state):
    """The scan over chunks in transformers' order (ten small ops a chunk). Arguments [h, n, ...];
    returns the output [h, n, C, Dv] and the last state."""
    out = torch.empty_like(nv)
    for i in range(nv.shape[1]):
        v_new = nv[:, i] - kc[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * decay[:, i, None, None] + kt[:, i] @ v_new
    return out, state


def _scan_batched(q, kt, intra, nv, kc, decay, state):
    """The same scan in two launches a chunk: with S the state before chunk i, its output is
    (q_i - intra_i kc_i) S + intra_i nv_i and the state after it (d_i I - k_i^T kc_i) S +
    k_i^T nv_i; all but the two products with S is formed batched, SCAN_BLOCK chunks at a time.
    On a GPU a long prompt waits on this loop's launches (512 chunks for 32k tokens in each
    linear layer), not on its 1.7x the flops."""
    h, n, c, _ = q.shape
    eye = torch.eye(kt.shape[-2], dtype=kt.dtype, device=kt.device)
    out = torch.empty(n, h, c, nv.shape[-1], dtype=nv.dtype, device=nv.device)
    for b in range(0, n, SCAN_BLOCK):
        blk = slice(b, min(b + SCAN_BLOCK, n))
        it, kc_b, nv_b, kt_b = intra[:, blk], kc[:, blk], nv[:, blk], kt[:, blk]
        # chunk-major, so a chunk's operands are contiguous; the products with S accumulate in
        # place (into `out` and into the next state), as out= would copy its addend first
        out[blk] = (it @ nv_b).transpose(0, 1)
        read, trans, after = (x.transpose(0, 1).contiguous() for x in (
            q[:, blk] - it @ kc_b, decay[:, blk, None, None] * eye - kt_b @ kc_b, kt_b @ nv_b))
        for j in range(blk.stop - b):
            out[b + j].baddbmm_(read[j], state)
            state = after[j].baddbmm_(trans[j], state)
    return out.transpose(0, 1), state


# ---- the forward pass ---------------------------------------------------------------------
class Qwen3NextDecoder(MoEDecoder):
    norm_offset = True

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], experts: Experts):
        super().__init__(spec, weights, experts)
        e = spec.extra  # the linear-attention dims; absent when no layer is linear (check_spec)
        self.hk, self.hv = e.get("linear_num_key_heads"), e.get("linear_num_value_heads")
        self.dk, self.dv = e.get("linear_key_head_dim"), e.get("linear_value_head_dim")
        self.kernel = e.get("linear_conv_kernel_dim")
        self.fused_qkvz = e.get("linear_in_proj", "qkvz") == "qkvz"

    def mixer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
              kv: KVAttend | None = None) -> torch.Tensor:
        if self.spec.layer_kinds[i] == LINEAR_ATTENTION:
            return self.linear_attention(i, x, cache)
        return self.gated_attention(i, x, cos, sin, kv or self.cached(cache))

    def gated_attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttend) -> torch.Tensor:
        s, p, t = self.spec, f"layers.{i}.attn.", x.shape[0]
        q, gate = self.linear(p + "q", x).view(t, s.num_heads, 2 * s.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(t, -1)
        q = rms_norm(q, self.w[p + "q_norm.weight"], s.rms_norm_eps, offset=True)
        k = rms_norm(self.linear(p + "k", x).view(t, s.num_kv_heads, s.head_dim), self.w[p + "k_norm.weight"],
                     s.rms_norm_eps, offset=True)
        v = self.linear(p + "v", x).view(t, s.num_kv_heads, s.head_dim)
        out = kv(i, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.linear(p + "o", out.reshape(t, -1) * torch.sigmoid(gate))

    def _projections(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q|k|v channels [T, 2*Kd + Vd], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        p, t, r = f"layers.{i}.linear_attn.", x.shape[0], self.hv // self.hk
        ba = self.linear(p + "in_proj_ba", x).view(t, self.hk, 2 * r)
        b, a = ba[..., :r].reshape(t, self.hv), ba[..., r:].reshape(t, self.hv)
        if self.fused_qkvz:
            qkvz = self.linear(p + "in_proj_qkvz", x).view(t, self.hk, 2 * self.dk + 2 * r * self.dv)
            q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
            qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        else:
            qkv, z = self.linear(p + "in_proj_qkv", x), self.linear(p + "in_proj_z", x)
        return qkv, z.reshape(t, self.hv, self.dv), b, a

    def key_heads_per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """q or k [T, Hk, Dk] -> [T, Hv, Dk]: value head h reads key head h // (Hv / Hk), the
        value heads being grouped per key head."""
        return x.repeat_interleave(self.hv // self.hk, dim=1)

    def step_kernels(self, x: torch.Tensor):
        """The fused decode-step kernels for this token, or None (the torch ops run)."""
        return _step_kernels(x)

    def linear_attention(self, i: int, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        s, w, p, t = self.spec, self.w, f"layers.{i}.linear_attn.", x.shape[0]
        qkv, z, b, a = self._projections(i, x)
        conv_w = w[p + "conv1d.weight"]
        channels = conv_w.shape[0]
        state = cache.states.get(i)
        if state is None:
            state = cache.states[i] = {
                "conv": torch.zeros(channels, self.kernel - 1, dtype=x.dtype, device=x.device),
                "ssm": torch.zeros(self.hv, self.dk, self.dv, dtype=torch.float32, device=x.device),
            }
        kernels = self.step_kernels(x) if t == 1 else None
        if kernels is not None:  # one decode token: the recurrent core in two launches
            act = kernels.conv_step(qkv[0], state["conv"], conv_w)
            out = kernels.delta_step(act, z.reshape(-1).contiguous(), b[0].contiguous(), a[0].contiguous(),
                                     w[p + "A_log"], w[p + "dt_bias"], state["ssm"], w[p + "norm.weight"],
                                     s.rms_norm_eps)
            return self.linear(p + "out_proj", out[None])
        # Causal depthwise conv over [previous inputs | these], in the weight's dtype, then SiLU.
        # States change in place: graph decode binds them to static buffers.
        seq = torch.cat((state["conv"], qkv.transpose(0, 1).to(state["conv"].dtype)), dim=-1)
        state["conv"].copy_(seq[:, seq.shape[1] - (self.kernel - 1):])
        qkv = F.silu(F.conv1d(seq[None].to(conv_w.dtype), conv_w.view(channels, 1, -1), groups=channels)[0])
        qkv = qkv.to(x.dtype).transpose(0, 1)
        kd = self.hk * self.dk
        q = qkv[:, :kd].reshape(t, self.hk, self.dk)
        k = qkv[:, kd : 2 * kd].reshape(t, self.hk, self.dk)
        v = qkv[:, 2 * kd :].reshape(t, self.hv, self.dv)
        beta = b.sigmoid()
        g = -w[p + "A_log"].float().exp() * F.softplus(a.float() + w[p + "dt_bias"])
        if self.hv != self.hk:
            q, k = self.key_heads_per_value_head(q), self.key_heads_per_value_head(k)
        q, k, v, beta, g = (y.transpose(0, 1).float().contiguous() for y in (q, k, v, beta, g))
        q, k = l2norm(q), l2norm(k)
        q = q * self.dk**-0.5
        rule = delta_rule_recurrent if t == 1 else delta_rule_chunked
        out, ssm = rule(q, k, v, g, beta, state["ssm"])
        state["ssm"].copy_(ssm)
        out = out.transpose(0, 1).to(x.dtype)  # [T, Hv, Dv]
        out = gated_rms_norm(out, z, w[p + "norm.weight"], s.rms_norm_eps)
        return self.linear(p + "out_proj", out.reshape(t, -1))


def _step_kernels(x: torch.Tensor):
    """The Triton decode-step kernels (kernels/triton/delta_rule.py) for a token on CUDA, where
    Triton is there; else None (the torch ops run)."""
    return optional("delta_rule") if x.is_cuda else None
