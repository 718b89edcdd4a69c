"""OLMoE: Q/K RMSNorm over the whole projection, softmax top-k without renormalisation."""

from __future__ import annotations

from typing import Any

from ..spec import QK_NORM_FULL, ModelSpec
from .base import Family, moe_spec


class Olmoe(Family):
    name = "olmoe"
    architectures = ("OlmoeForCausalLM",)
    gguf_archs = ("olmoe",)

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        return moe_spec(
            self.name, cfg, "intermediate_size", dense_ffn=False,
            qk_norm=QK_NORM_FULL,
            attention_bias=bool(cfg.get("attention_bias", False)),
            attention_out_bias=bool(cfg.get("attention_bias", False)),
            extra={"clip_qkv": cfg["clip_qkv"]} if cfg.get("clip_qkv") else {},
        )

    def gguf_config(self, g: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        return dict(intermediate_size=g["expert_ffn"] or g["ffn"], norm_topk_prob=False)


FAMILY = Olmoe()
