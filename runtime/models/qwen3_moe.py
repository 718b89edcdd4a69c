"""Qwen3-MoE: per-head Q/K RMSNorm, softmax top-k routing (optionally renormalised)."""

from __future__ import annotations

from typing import Any

from ..spec import QK_NORM_HEAD, ModelSpec
from .base import Family, moe_spec, sliding_window
from .config import flag


class Qwen3Moe(Family):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    gguf_archs = ("qwen3moe",)

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        bias = flag(cfg, "attention_bias", False)
        return moe_spec(
            self, cfg, "moe_intermediate_size", dense_ffn=True,
            qk_norm=QK_NORM_HEAD, attention_bias=bias, attention_out_bias=bias,
            sliding_window=sliding_window(cfg),
        )

    def gguf_config(self, g: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        # llama.cpp's qwen3moe graph always renormalises the top-k weights (no GGUF key for it).
        return dict(intermediate_size=g["ffn"], moe_intermediate_size=g["expert_ffn"], norm_topk_prob=True)


FAMILY = Qwen3Moe()
