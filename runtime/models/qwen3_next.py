"""Qwen3-Next: hybrid gated-DeltaNet / gated-attention layers over a Qwen MoE with a gated shared
expert.

Per layer, `layer_kinds` says which token mixer it has:
  linear_attention  gated DeltaNet: in_proj_qkvz / in_proj_ba projections, a causal depthwise
                    conv1d (kernel `conv_kernel`) over q|k|v, the gated delta rule with decay
                    g = -exp(A_log) * softplus(a + dt_bias) and rate beta = sigmoid(b), a gated
                    RMSNorm (plain weight, SiLU(z) gate) per value head, out_proj.
  full_attention    attention whose q_proj yields [query | gate] per head; the output is scaled by
                    sigmoid(gate) before o_proj; per-head q/k norms; partial rotary (0.25).
Every RMSNorm except the DeltaNet's gated one multiplies by (1 + weight), in float32, before the
cast back (transformers' Qwen3NextRMSNorm); canonical weights keep the checkpoint's offset form.

Linear-attention dims live in `spec.extra`: linear_num_key_heads, linear_num_value_heads,
linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim, and linear_in_proj:
  "qkvz"   HF layout: `linear_attn.in_proj_qkvz` [2*Kd + 2*Vd, H], rows grouped per key head as
           [q_h | k_h | v_h.. | z_h..] (transformers' fix_query_key_value_ordering).
  "qkv_z"  llama.cpp layout: `linear_attn.in_proj_qkv` [2*Kd + Vd, H] rows q | k | v (the conv
           channel order), `linear_attn.in_proj_z` [Vd, H].
`in_proj_ba` [2*Hv, H] is grouped per key head ([b.. | a..]) in both.

The recurrent state of a linear layer lives in the sequence's KVCache (`cache.states[layer]`):
  conv  [conv_dim, kernel-1]   the last inputs of the causal conv, in the activations' dtype
  ssm   [Hv, Dk, Dv] float32   the delta-rule memory
Prefill (T > 1) uses the chunked form of the delta rule (chunks of 64, as transformers' torch
fallback); a single token uses the recurrent form. Both are exact up to float32 rounding.

GGUF: llama.cpp's converter (arch `qwen3next`) splits in_proj_qkvz into attn_qkv + attn_gate,
stores A as -exp(A_log) (`ssm_a`), dt_bias as `ssm_dt.bias`, the conv kernel squeezed, and adds 1
to every RMSNorm weight except `ssm_norm`; `sanitize` undoes the last two.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ftkit.errors import shown
from ftkit.kernels.triton import optional

from ..checkpoint.base import CheckpointError
from ..spec import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    MAX_FFN,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    QK_NORM_HEAD,
    ModelSpec,
    SpecError,
    whole,
)
from .base import (
    GGUF_RULES,
    HF_RULES,
    Family,
    Mapped,
    gguf_common,
    layer_count,
    llama_dense_shapes,
    moe_spec,
    rules,
)
from .config import MAX_COUNT, count, flag, names, section, text
from .decoder import Experts, KVAttend, MoEDecoder
from .kv import KVCache
from .layers import apply_rope, rms_norm

CHUNK = 64  # transformers' torch_chunk_gated_delta_rule default
# Chunks whose scan operands are formed at once: their memory (two [Hv, Dk, Dk|Dv] float32 per
# chunk, 4 MB at 32 heads of 128) stays bounded however long the prompt.
SCAN_BLOCK = 16

HF_NEXT_RULES = rules(
    (r"model\.layers\.(\d+)\.linear_attn\.(in_proj_qkvz|in_proj_ba|conv1d|norm|out_proj)\.weight",
     "layers.{1}.linear_attn.{2}.weight"),
    (r"model\.layers\.(\d+)\.linear_attn\.(A_log|dt_bias)", "layers.{1}.linear_attn.{2}"),
) + HF_RULES

GGUF_NEXT_RULES = rules(
    (r"blk\.(\d+)\.post_attention_norm\.weight", "layers.{1}.mlp_norm.weight"),
    (r"blk\.(\d+)\.attn_qkv\.weight", "layers.{1}.linear_attn.in_proj_qkv.weight"),
    (r"blk\.(\d+)\.attn_gate\.weight", "layers.{1}.linear_attn.in_proj_z.weight"),
    (r"blk\.(\d+)\.ssm_ba\.weight", "layers.{1}.linear_attn.in_proj_ba.weight"),
    (r"blk\.(\d+)\.ssm_conv1d\.weight", "layers.{1}.linear_attn.conv1d.weight"),
    (r"blk\.(\d+)\.ssm_a", "layers.{1}.linear_attn.A_log"),
    (r"blk\.(\d+)\.ssm_dt\.bias", "layers.{1}.linear_attn.dt_bias"),
    (r"blk\.(\d+)\.ssm_norm\.weight", "layers.{1}.linear_attn.norm.weight"),
    (r"blk\.(\d+)\.ssm_out\.weight", "layers.{1}.linear_attn.out_proj.weight"),
) + GGUF_RULES

LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
               "linear_value_head_dim", "linear_conv_kernel_dim")
LINEAR_BOUNDS = dict(zip(LINEAR_KEYS, (MAX_HEADS, MAX_HEADS, MAX_HEAD_DIM, MAX_HEAD_DIM, MAX_HEAD_DIM), strict=True))
IN_PROJ_LAYOUTS = ("qkvz", "qkv_z")
# RMSNorms with the (1 + weight) form: llama.cpp stores them with the 1 added.
OFFSET_NORMS = ("attn_norm.weight", "mlp_norm.weight", "attn.q_norm.weight", "attn.k_norm.weight")


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
    supported_kinds = frozenset({FULL_ATTENTION, LINEAR_ATTENTION})
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
        kernels = _step_kernels(x) if t == 1 else None
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
            q, k = q.repeat_interleave(self.hv // self.hk, dim=1), k.repeat_interleave(self.hv // self.hk, dim=1)
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


# ---- the family ---------------------------------------------------------------------------
class Qwen3Next(Family):
    name = "qwen3_next"
    architectures = ("Qwen3NextForCausalLM",)
    gguf_archs = ("qwen3next",)
    hf_rules = HF_NEXT_RULES
    gguf_rules = GGUF_NEXT_RULES
    decoder_class = Qwen3NextDecoder

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        cfg = dict(cfg)
        if not names(cfg, "layer_types", MAX_LAYERS):  # older configs: every full_attention_interval-th layer is full
            layers = count(cfg, "num_hidden_layers", 0, hi=MAX_LAYERS)
            interval = count(cfg, "full_attention_interval", 0, hi=MAX_LAYERS) or 4
            cfg["layer_types"] = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
        kinds = set(cfg["layer_types"]) - {FULL_ATTENTION, LINEAR_ATTENTION}
        if kinds:
            raise SpecError(f"Qwen3-Next: unknown layer type(s) {', '.join(sorted(kinds))}")
        params = section(cfg, "rope_parameters")
        if "partial_rotary_factor" not in params and cfg.get("partial_rotary_factor") is None:
            cfg["partial_rotary_factor"] = 0.25  # transformers' default for this family
        extra: dict[str, Any] = {}
        if LINEAR_ATTENTION in cfg["layer_types"]:
            missing = [k for k in LINEAR_KEYS if cfg.get(k) is None]
            if missing:
                raise SpecError(f"Qwen3-Next config has no {', '.join(missing)}")
            extra = {k: count(cfg, k, lo=1, hi=LINEAR_BOUNDS[k]) for k in LINEAR_KEYS}
            extra["linear_in_proj"] = text(cfg, "linear_in_proj", "qkvz")
        bias = flag(cfg, "attention_bias", False)
        shared = count(cfg, "shared_expert_intermediate_size", 0, hi=MAX_FFN)
        return moe_spec(
            self, cfg, "moe_intermediate_size", dense_ffn=True,
            shared_expert_intermediate_size=shared, shared_expert_gate=bool(shared),
            qk_norm=QK_NORM_HEAD, attention_bias=bias, attention_out_bias=bias, extra=extra,
        )

    def check_spec(self, spec: ModelSpec) -> None:
        """Linear-attention layers need their dims in `spec.extra`, value heads grouped per key head."""
        super().check_spec(spec)
        if LINEAR_ATTENTION not in spec.layer_kinds:
            return
        e = spec.extra
        for k in LINEAR_KEYS:
            whole(e.get(k), k, 1, LINEAR_BOUNDS[k])
        if e["linear_num_value_heads"] % e["linear_num_key_heads"]:
            raise SpecError("Qwen3-Next: linear_num_value_heads is not a multiple of linear_num_key_heads")
        if e.get("linear_in_proj", "qkvz") not in IN_PROJ_LAYOUTS:
            raise SpecError(f"Qwen3-Next: linear_in_proj {shown(e['linear_in_proj'])} is not one of {', '.join(IN_PROJ_LAYOUTS)}")

    def gguf_config(self, g: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        meta = g["_meta"]
        arch = meta.get("general.architecture")

        def m(key: str) -> Any:
            return meta.get(f"{arch}.{key}")

        layers = layer_count(g)
        # A layer is linear iff it has a DeltaNet tensor; fall back on the interval key.
        kinds = [LINEAR_ATTENTION if f"blk.{i}.ssm_a" in tensor_shapes else FULL_ATTENTION for i in range(layers)]
        if not any(f"blk.{i}.ssm_a" in tensor_shapes or f"blk.{i}.attn_q.weight" in tensor_shapes for i in range(layers)):
            interval = count(meta, f"{arch}.full_attention_interval", 0, hi=MAX_LAYERS) or 4
            kinds = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
        out: dict[str, Any] = dict(
            intermediate_size=g["ffn"], moe_intermediate_size=g["expert_ffn"],
            shared_expert_intermediate_size=g["shared_ffn"], norm_topk_prob=True, layer_types=kinds,
            linear_in_proj="qkv_z",
        )
        rotary, head_dim = count(meta, f"{arch}.rope.dimension_count", 0, hi=MAX_HEAD_DIM), count(g, "head_dim", 0, hi=MAX_HEAD_DIM)
        if rotary and head_dim:
            out["partial_rotary_factor"] = rotary / head_dim
        if LINEAR_ATTENTION in kinds:
            ssm = ("group_count", "state_size", "time_step_rank", "inner_size", "conv_kernel")
            if any(m(f"ssm.{k}") is None for k in ssm):
                raise SpecError("qwen3next GGUF lacks ssm.* metadata (conv_kernel, state_size, group_count, "
                                "time_step_rank, inner_size)")
            k_heads, k_dim, v_heads, inner, kernel = (count(meta, f"{arch}.ssm.{k}", lo=1, hi=MAX_COUNT) for k in ssm)
            out.update(linear_num_key_heads=k_heads, linear_key_head_dim=k_dim, linear_num_value_heads=v_heads,
                       linear_value_head_dim=inner // v_heads, linear_conv_kernel_dim=kernel)
        return out

    def spec_from_gguf(self, meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> ModelSpec:
        g = gguf_common(meta, tensor_shapes)
        # Newer converters append the multi-token-prediction block(s) as extra blk.N layers and
        # count them in block_count; we serve the main layers only (the rest map as unexpected).
        nextn = count(meta, f"{meta.get('general.architecture')}.nextn_predict_layers", 0, hi=MAX_LAYERS)
        g["num_hidden_layers"] = count(g, "num_hidden_layers", 0, hi=MAX_COUNT) - nextn
        g["_meta"] = meta
        fields = self.gguf_config(g, tensor_shapes)
        del g["_meta"]
        g.update(architectures=list(self.architectures), num_experts=g["experts"],
                 num_experts_per_tok=g["experts_used"], **fields)
        return self.spec_from_config(g)

    def sanitize(self, mapped: Mapped, tensor: torch.Tensor, spec: ModelSpec, gguf: bool) -> torch.Tensor:
        name = mapped.canonical or ""
        if name.endswith("shared_gate.weight") and tensor.dim() == 1:
            return tensor.reshape(1, -1)
        if not gguf:
            return tensor
        if name.endswith(OFFSET_NORMS) or name == "final_norm.weight":
            return (_float(tensor, name) - 1).to(tensor.dtype)  # llama.cpp stores 1 + weight
        if name.endswith("linear_attn.A_log"):
            return torch.log(-_float(tensor, name)).to(tensor.dtype)  # llama.cpp stores A = -exp(A_log)
        return tensor

    def dense_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        h, e = spec.hidden_size, spec.extra
        out = llama_dense_shapes(spec)
        for i, kind in enumerate(spec.layer_kinds):
            p = f"layers.{i}."
            if kind == FULL_ATTENTION:  # q_proj yields query and gate for every head
                out[p + "attn.q.weight"] = (2 * spec.num_heads * spec.head_dim, h)
                if spec.attention_bias:
                    out[p + "attn.q.bias"] = (2 * spec.num_heads * spec.head_dim,)
                continue
            for name in [n for n in out if n.startswith(p + "attn.")]:
                del out[name]
            kd = e["linear_num_key_heads"] * e["linear_key_head_dim"]
            vd = e["linear_num_value_heads"] * e["linear_value_head_dim"]
            hv, q = e["linear_num_value_heads"], p + "linear_attn."
            if e.get("linear_in_proj", "qkvz") == "qkvz":
                out[q + "in_proj_qkvz.weight"] = (2 * kd + 2 * vd, h)
            else:
                out[q + "in_proj_qkv.weight"] = (2 * kd + vd, h)
                out[q + "in_proj_z.weight"] = (vd, h)
            out[q + "in_proj_ba.weight"] = (2 * hv, h)
            out[q + "conv1d.weight"] = (2 * kd + vd, 1, e["linear_conv_kernel_dim"])
            out[q + "A_log"] = (hv,)
            out[q + "dt_bias"] = (hv,)
            out[q + "norm.weight"] = (e["linear_value_head_dim"],)
            out[q + "out_proj.weight"] = (h, vd)
        return out

    def recurrent_state_bytes(self, spec: ModelSpec, dtype: torch.dtype) -> int:
        """Bytes of one sequence's linear-attention state (conv inputs in `dtype`, the delta-rule
        memory in float32), independent of its length; what a snapshot copies."""
        e = spec.extra
        layers = spec.layer_kinds.count(LINEAR_ATTENTION)
        if not layers:
            return 0
        channels = 2 * e["linear_num_key_heads"] * e["linear_key_head_dim"] + e["linear_num_value_heads"] * e["linear_value_head_dim"]
        conv = channels * (e["linear_conv_kernel_dim"] - 1) * dtype.itemsize
        ssm = e["linear_num_value_heads"] * e["linear_key_head_dim"] * e["linear_value_head_dim"] * 4
        return layers * (conv + ssm)


def _float(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_floating_point():
        raise CheckpointError(f"{name}: a quantized GGUF tensor where a float one is needed")
    return t.float()


FAMILY = Qwen3Next()
