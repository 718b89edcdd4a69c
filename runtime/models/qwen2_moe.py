"""Qwen2-MoE: q/k/v biases, a shared expert scaled by a sigmoid gate, no top-k renormalisation."""

from __future__ import annotations

from typing import Any

import torch

from ..spec import ModelSpec
from .base import (
    Family,
    Mapped,
    base_spec_fields,
    check_moe,
    gguf_common,
    moe_layers_from,
    need,
    text_config,
)


class Qwen2Moe(Family):
    name = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)
    gguf_archs = ("qwen2moe",)

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
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            shared_expert_gate=bool(cfg.get("shared_expert_intermediate_size")),
            attention_bias=bool(cfg.get("qkv_bias", True)),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window") else None,
        ))

    def spec_from_gguf(self, meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> ModelSpec:
        g = gguf_common(meta, tensor_shapes)
        g.update(
            architectures=list(self.architectures),
            intermediate_size=g["ffn"],
            moe_intermediate_size=g["expert_ffn"],
            shared_expert_intermediate_size=g["shared_ffn"],
            num_experts=g["experts"],
            num_experts_per_tok=g["experts_used"],
            norm_topk_prob=False,
            qkv_bias="blk.0.attn_q.bias" in tensor_shapes,
        )
        return self.spec_from_config(g)

    def sanitize(self, mapped: Mapped, tensor: torch.Tensor, spec: ModelSpec, gguf: bool) -> torch.Tensor:
        # The shared-expert gate is [1, H] in HF; some writers store it as a vector.
        if mapped.canonical and mapped.canonical.endswith("shared_gate.weight") and tensor.dim() == 1:
            return tensor.reshape(1, -1)
        return tensor


FAMILY = Qwen2Moe()
