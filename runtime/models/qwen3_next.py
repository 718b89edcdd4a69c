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

The forward pass is qwen3_next_forward.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ftkit.errors import shown

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

if TYPE_CHECKING:
    import torch

HF_NEXT_RULES = rules(
    (r"model\.layers\.(\d+)\.linear_attn\.(in_proj_qkvz|in_proj_ba|conv1d|norm|out_proj)\.weight",
     "layers.{1}.linear_attn.{2}.weight"),
    (r"model\.layers\.(\d+)\.linear_attn\.(A_log|dt_bias)", "layers.{1}.linear_attn.{2}"),
) + HF_RULES

# llama.cpp's names of a gated-DeltaNet layer that Qwen3-Next and Qwen3.5 share (their beta/alpha
# projections differ: one fused `ssm_ba` here, two in qwen3_5_moe.py)
GGUF_DELTANET_RULES = rules(
    (r"blk\.(\d+)\.post_attention_norm\.weight", "layers.{1}.mlp_norm.weight"),
    (r"blk\.(\d+)\.attn_qkv\.weight", "layers.{1}.linear_attn.in_proj_qkv.weight"),
    (r"blk\.(\d+)\.attn_gate\.weight", "layers.{1}.linear_attn.in_proj_z.weight"),
    (r"blk\.(\d+)\.ssm_conv1d\.weight", "layers.{1}.linear_attn.conv1d.weight"),
    (r"blk\.(\d+)\.ssm_a", "layers.{1}.linear_attn.A_log"),
    (r"blk\.(\d+)\.ssm_dt\.bias", "layers.{1}.linear_attn.dt_bias"),
    (r"blk\.(\d+)\.ssm_norm\.weight", "layers.{1}.linear_attn.norm.weight"),
    (r"blk\.(\d+)\.ssm_out\.weight", "layers.{1}.linear_attn.out_proj.weight"),
)
GGUF_NEXT_RULES = rules(
    (r"blk\.(\d+)\.ssm_ba\.weight", "layers.{1}.linear_attn.in_proj_ba.weight"),
) + GGUF_DELTANET_RULES + GGUF_RULES

LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
               "linear_value_head_dim", "linear_conv_kernel_dim")
LINEAR_BOUNDS = dict(zip(LINEAR_KEYS, (MAX_HEADS, MAX_HEADS, MAX_HEAD_DIM, MAX_HEAD_DIM, MAX_HEAD_DIM), strict=True))
IN_PROJ_LAYOUTS = ("qkvz", "qkv_z")
# RMSNorms with the (1 + weight) form: llama.cpp stores them with the 1 added.
OFFSET_NORMS = ("attn_norm.weight", "mlp_norm.weight", "attn.q_norm.weight", "attn.k_norm.weight")


# ---- the family ---------------------------------------------------------------------------
class Qwen3Next(Family):
    name = "qwen3_next"
    architectures = ("Qwen3NextForCausalLM",)
    gguf_archs = ("qwen3next",)
    hf_rules = HF_NEXT_RULES
    gguf_rules = GGUF_NEXT_RULES
    forward = ("qwen3_next_forward", "Qwen3NextDecoder")
    layer_kinds = frozenset({FULL_ATTENTION, LINEAR_ATTENTION})
    label = "Qwen3-Next"  # how problems name the family (a subclass shares these checks)

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        cfg = dict(cfg)
        if not names(cfg, "layer_types", MAX_LAYERS):  # older configs: every full_attention_interval-th layer is full
            layers = count(cfg, "num_hidden_layers", 0, hi=MAX_LAYERS)
            interval = count(cfg, "full_attention_interval", 0, hi=MAX_LAYERS) or 4
            cfg["layer_types"] = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
        kinds = set(cfg["layer_types"]) - {FULL_ATTENTION, LINEAR_ATTENTION}
        if kinds:
            raise SpecError(f"{self.label}: unknown layer type(s) {', '.join(sorted(kinds))}")
        params = section(cfg, "rope_parameters")
        if "partial_rotary_factor" not in params and cfg.get("partial_rotary_factor") is None:
            cfg["partial_rotary_factor"] = 0.25  # transformers' default for this family
        extra: dict[str, Any] = {}
        if LINEAR_ATTENTION in cfg["layer_types"]:
            missing = [k for k in LINEAR_KEYS if cfg.get(k) is None]
            if missing:
                raise SpecError(f"{self.label} config has no {', '.join(missing)}")
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
            raise SpecError(f"{self.label}: linear_num_value_heads is not a multiple of linear_num_key_heads")
        if e.get("linear_in_proj", "qkvz") not in IN_PROJ_LAYOUTS:
            raise SpecError(f"{self.label}: linear_in_proj {shown(e['linear_in_proj'])} is not one of {', '.join(IN_PROJ_LAYOUTS)}")

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
                raise SpecError(f"{arch} GGUF lacks ssm.* metadata (conv_kernel, state_size, group_count, "
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
            return (-_float(tensor, name)).log().to(tensor.dtype)  # llama.cpp stores A = -exp(A_log)
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
