"""OLMoE: Q/K RMSNorm over the whole projection, softmax top-k without renormalisation."""

from __future__ import annotations

from typing import Any

from ..spec import QK_NORM_FULL, ModelSpec, real
from .base import Family, moe_spec
from .config import flag, number


class Olmoe(Family):
    name = "olmoe"
    architectures = ("OlmoeForCausalLM",)
    gguf_archs = ("olmoe",)

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        bias = flag(cfg, "attention_bias", False)
        clip = number(cfg, "clip_qkv", 0.0, 0.0, 1e30)  # 0: no clipping
        return moe_spec(
            self, cfg, "intermediate_size", dense_ffn=False,
            qk_norm=QK_NORM_FULL, attention_bias=bias, attention_out_bias=bias,
            extra={"clip_qkv": clip} if clip else {},
        )

    def check_spec(self, spec: ModelSpec) -> None:
        super().check_spec(spec)
        if "clip_qkv" in spec.extra:
            real(spec.extra["clip_qkv"], "clip_qkv", 0.0, 1e30, open_lo=True)

    def gguf_config(self, g: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        return dict(intermediate_size=g["expert_ffn"] or g["ffn"], norm_topk_prob=False)


FAMILY = Olmoe()
