"""GLM-4.5 MoE: sigmoid routing with a selection-only bias and grouped top-k, ungated shared
experts, leading dense layers, partial rotary, optional per-head Q/K norms, q/k/v biases.

Routing (transformers' Glm4MoeTopkRouter, all in float32): scores = sigmoid(x @ W); the choice
ranks scores + `e_score_correction_bias` (canonical `layers.N.router.bias`), first keeping the
`topk_group` best of `n_group` expert groups (a group's score: the sum of its two best), then the
top k experts among them; the weights are the chosen experts' unbiased scores, renormalised if
`norm_topk_prob`, times `routed_scaling_factor`. They stay float32 into the experts.

GGUF (llama.cpp arch `glm4moe`): the bias is `blk.N.exp_probs_b.bias`, the post-attention norm
`post_attention_norm`; the converter appends the multi-token-prediction layer(s) as extra blocks
counted in block_count (we serve the main layers; the rest map as unexpected) and writes no
expert-group keys (GLM-4.5 uses one group). The forward pass is glm4_moe_forward.py.
"""

from __future__ import annotations

from typing import Any

from ftkit.errors import shown

from ..spec import (
    MAX_EXPERTS,
    MAX_FFN,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    QK_NORM_HEAD,
    QK_NORM_NONE,
    ModelSpec,
    SpecError,
    real,
    whole,
)
from .base import (
    GGUF_RULES,
    HF_RULES,
    Family,
    gguf_common,
    layer_count,
    llama_dense_shapes,
    moe_spec,
    rules,
    text_config,
)
from .config import MAX_COUNT, count, first_count, flag, number, section

SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID

HF_GLM_RULES = rules(
    (r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias", "layers.{1}.router.bias"),
) + HF_RULES

GGUF_GLM_RULES = rules(
    (r"blk\.(\d+)\.exp_probs_b\.bias", "layers.{1}.router.bias"),
    (r"blk\.(\d+)\.post_attention_norm\.weight", "layers.{1}.mlp_norm.weight"),
) + GGUF_RULES


class Glm4Moe(Family):
    name = "glm4_moe"
    architectures = ("Glm4MoeForCausalLM",)
    gguf_archs = ("glm4moe",)
    hf_rules = HF_GLM_RULES
    gguf_rules = GGUF_GLM_RULES
    forward = ("glm4_moe_forward", "Glm4MoeDecoder")
    float32_suffixes = ("router.weight", "router.bias")  # transformers routes in float32

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        cfg = dict(text_config(cfg))
        cfg["num_experts"] = cfg.get("n_routed_experts") or cfg.get("num_experts")  # HF names it n_routed_experts
        params = section(cfg, "rope_parameters")
        if "partial_rotary_factor" not in params and cfg.get("partial_rotary_factor") is None:
            cfg["partial_rotary_factor"] = 0.5  # transformers' default for this family
        layers, first = layer_count(cfg), count(cfg, "first_k_dense_replace", 0, hi=MAX_LAYERS)
        width = first_count(cfg, "moe_intermediate_size", what="expert FFN width", hi=MAX_FFN)
        return moe_spec(
            self, cfg, "moe_intermediate_size", dense_ffn=True,
            moe_layers=tuple(range(first, layers)),
            norm_topk_prob=flag(cfg, "norm_topk_prob", True),
            shared_expert_intermediate_size=count(cfg, "n_shared_experts", 0, hi=MAX_EXPERTS) * width,
            qk_norm=QK_NORM_HEAD if flag(cfg, "use_qk_norm", False) else QK_NORM_NONE,
            attention_bias=flag(cfg, "attention_bias", False),
            extra=self.extra_fields(cfg),
        )

    def extra_fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """The spec's `extra`: the grouped routing's settings (a family built on this one adds its own)."""
        return dict(n_group=count(cfg, "n_group", 0, hi=MAX_EXPERTS) or 1,
                    topk_group=count(cfg, "topk_group", 0, hi=MAX_EXPERTS) or 1,
                    routed_scaling_factor=number(cfg, "routed_scaling_factor", 1.0, 0.0, 1e30) or 1.0)

    def check_spec(self, spec: ModelSpec) -> None:
        """Grouped routing needs its group counts (the router takes each group's two best)."""
        super().check_spec(spec)
        e = spec.extra
        groups = whole(e.get("n_group"), "n_group", 1, MAX_EXPERTS)
        keep = whole(e.get("topk_group"), "topk_group", 1, MAX_EXPERTS)
        real(e.get("routed_scaling_factor"), "routed_scaling_factor", 0.0, 1e30, open_lo=True)
        if spec.num_experts % groups or spec.num_experts // groups < 2 or keep > groups:
            raise SpecError(f"{spec.architecture}: {spec.num_experts} experts cannot form {groups} groups of 2 or "
                            f"more with {keep} kept")
        if spec.top_k > keep * (spec.num_experts // groups):
            raise SpecError(f"{spec.architecture}: top-k {spec.top_k} is more than the {keep} kept groups' "
                            f"{keep * (spec.num_experts // groups)} experts")

    def spec_from_gguf(self, meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> ModelSpec:
        g = gguf_common(meta, tensor_shapes)
        arch = meta.get("general.architecture")

        def m(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}")
            return default if value is None else value

        if m("expert_gating_func", SIGMOID_GATING) != SIGMOID_GATING:
            raise SpecError(f"glm4moe GGUF with expert_gating_func {shown(m('expert_gating_func'))}; GLM-4.5 is sigmoid")
        nextn = count(meta, f"{arch}.nextn_predict_layers", 0, hi=MAX_LAYERS)
        layers = count(g, "num_hidden_layers", 0, hi=MAX_COUNT) - nextn
        heads = first_count(g, "num_attention_heads", what="attention head count", hi=MAX_HEADS)
        head_dim = count(g, "head_dim", 0, hi=MAX_HEAD_DIM) or first_count(g, "hidden_size", what="hidden size") // heads
        rotary = count(meta, f"{arch}.rope.dimension_count", head_dim, hi=MAX_HEAD_DIM)
        g.update(
            architectures=list(self.architectures), num_hidden_layers=layers, num_experts=g["experts"],
            num_experts_per_tok=g["experts_used"], intermediate_size=g["ffn"], moe_intermediate_size=g["expert_ffn"],
            n_shared_experts=m("expert_shared_count", 0), first_k_dense_replace=m("leading_dense_block_count", 0),
            routed_scaling_factor=m("expert_weights_scale", 1.0), norm_topk_prob=m("expert_weights_norm", False),
            n_group=m("expert_group_count", 1), topk_group=m("expert_group_used_count", 1),
            partial_rotary_factor=rotary / whole(head_dim, "head_dim", 1, MAX_HEAD_DIM),
            attention_bias="blk.0.attn_q.bias" in tensor_shapes, use_qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        )
        return self.spec_from_config(g)

    def dense_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        out = llama_dense_shapes(spec)
        out.update({f"layers.{i}.router.bias": (spec.num_experts,) for i in spec.moe_layers})
        return out


FAMILY = Glm4Moe()
