"""OLMoE: Q/K RMSNorm over the whole projection, softmax top-k without renormalisation."""

from __future__ import annotations

from typing import Any

from ..spec import QK_NORM_FULL, ModelSpec
from .base import Family, base_spec_fields, check_moe, gguf_common, need, text_config


class Olmoe(Family):
    name = "olmoe"
    architectures = ("OlmoeForCausalLM",)
    gguf_archs = ("olmoe",)

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        cfg = text_config(cfg)
        f = base_spec_fields(cfg, self.name)
        experts = int(need(cfg, "num_experts", "num_local_experts", what="expert count"))
        return check_moe(ModelSpec(
            **f,
            intermediate_size=0,
            moe_intermediate_size=int(need(cfg, "intermediate_size", what="expert FFN width")),
            num_experts=experts,
            top_k=int(need(cfg, "num_experts_per_tok", what="experts per token")),
            moe_layers=tuple(range(f["num_layers"])) if experts > 0 else (),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            qk_norm=QK_NORM_FULL,
            attention_bias=bool(cfg.get("attention_bias", False)),
            attention_out_bias=bool(cfg.get("attention_bias", False)),
            extra={"clip_qkv": cfg["clip_qkv"]} if cfg.get("clip_qkv") else {},
        ))

    def spec_from_gguf(self, meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> ModelSpec:
        g = gguf_common(meta, tensor_shapes)
        g.update(
            architectures=list(self.architectures),
            intermediate_size=g["expert_ffn"] or g["ffn"],
            num_experts=g["experts"],
            num_experts_per_tok=g["experts_used"],
            norm_topk_prob=False,
        )
        return self.spec_from_config(g)


FAMILY = Olmoe()
