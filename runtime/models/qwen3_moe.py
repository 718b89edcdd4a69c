"""Qwen3-MoE: per-head Q/K RMSNorm, softmax top-k routing (optionally renormalised)."""

from __future__ import annotations

from typing import Any

from ..spec import QK_NORM_HEAD, ModelSpec
from .base import (
    Family,
    base_spec_fields,
    check_moe,
    gguf_common,
    moe_layers_from,
    need,
    text_config,
)


class Qwen3Moe(Family):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    gguf_archs = ("qwen3moe",)

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        cfg = text_config(cfg)
        f = base_spec_fields(cfg, self.name)
        experts = int(need(cfg, "num_experts", "num_local_experts", what="expert count"))
        return check_moe(ModelSpec(
            **f,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            moe_intermediate_size=int(need(cfg, "moe_intermediate_size", what="expert FFN width")),
            num_experts=experts,
            top_k=int(need(cfg, "num_experts_per_tok", what="experts per token")),
            moe_layers=moe_layers_from(cfg, f["num_layers"], experts),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            qk_norm=QK_NORM_HEAD,
            attention_bias=bool(cfg.get("attention_bias", False)),
            attention_out_bias=bool(cfg.get("attention_bias", False)),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window") else None,
        ))

    def spec_from_gguf(self, meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> ModelSpec:
        g = gguf_common(meta, tensor_shapes)
        g.update(
            architectures=list(self.architectures),
            intermediate_size=g["ffn"],
            moe_intermediate_size=g["expert_ffn"],
            num_experts=g["experts"],
            num_experts_per_tok=g["experts_used"],
            norm_topk_prob=True,  # llama.cpp's qwen3moe graph always renormalises the top-k weights
        )
        return self.spec_from_config(g)


FAMILY = Qwen3Moe()
