"""Qwen2-MoE: q/k/v biases, a shared expert scaled by a sigmoid gate, no top-k renormalisation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..spec import MAX_FFN, ModelSpec
from .base import Family, Mapped, moe_spec, sliding_window
from .config import count, flag

if TYPE_CHECKING:
    import torch


class Qwen2Moe(Family):
    name = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)
    gguf_archs = ("qwen2moe",)

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        shared = count(cfg, "shared_expert_intermediate_size", 0, hi=MAX_FFN)
        return moe_spec(
            self, cfg, "moe_intermediate_size", dense_ffn=True,
            shared_expert_intermediate_size=shared,
            shared_expert_gate=bool(shared),
            attention_bias=flag(cfg, "qkv_bias", True),
            sliding_window=sliding_window(cfg),
        )

    def gguf_config(self, g: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        return dict(
            intermediate_size=g["ffn"], moe_intermediate_size=g["expert_ffn"],
            shared_expert_intermediate_size=g["shared_ffn"], norm_topk_prob=False,
            qkv_bias="blk.0.attn_q.bias" in tensor_shapes,
        )

    def sanitize(self, mapped: Mapped, tensor: torch.Tensor, spec: ModelSpec, gguf: bool) -> torch.Tensor:
        # The shared-expert gate is [1, H] in HF; some writers store it as a vector.
        if mapped.canonical and mapped.canonical.endswith("shared_gate.weight") and tensor.dim() == 1:
            return tensor.reshape(1, -1)
        return tensor


FAMILY = Qwen2Moe()
