"""Mixtral: `block_sparse_moe` naming (w1 gate, w3 up, w2 down), renormalised top-k kept in
float32 (transformers' Mixtral router does not cast the weights back to the hidden dtype).

llama.cpp writes Mixtral as arch `llama` with an expert count, and permutes the Q/K rows for its
interleaved RoPE; `sanitize` undoes that permutation so the weights match HF's layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..spec import MAX_POSITIONS, SLIDING_ATTENTION, ModelSpec
from .base import (
    HF_RULES,
    Family,
    Mapped,
    layer_count,
    moe_spec,
    rules,
    text_config,
)
from .config import count

if TYPE_CHECKING:
    import torch

MIXTRAL_RULES = rules(
    (r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight", "layers.{1}.router.weight"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w1\.weight", "expert:{1}:{2}:gate"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w3\.weight", "expert:{1}:{2}:up"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w2\.weight", "expert:{1}:{2}:down"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(gate_up|down)_proj", "stacked:{1}:{2}"),
) + HF_RULES


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: rows (heads, 2, d/2) were stored as (heads, d/2, 2)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class Mixtral(Family):
    name = "mixtral"
    architectures = ("MixtralForCausalLM",)
    gguf_archs = ("llama",)
    hf_rules = MIXTRAL_RULES
    forward = ("mixtral_forward", "MixtralDecoder")

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        window = count(cfg, "sliding_window", 0, hi=MAX_POSITIONS) or None
        fields: dict[str, Any] = {"norm_topk_prob": True, "sliding_window": window}
        if window:  # transformers applies Mixtral's window to every layer
            fields["layer_kinds"] = (SLIDING_ATTENTION,) * layer_count(text_config(cfg))
        return moe_spec(self, cfg, "intermediate_size", dense_ffn=False, **fields)

    def gguf_config(self, g: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        return dict(intermediate_size=g["expert_ffn"] or g["ffn"])

    def sanitize(self, mapped: Mapped, tensor: torch.Tensor, spec: ModelSpec, gguf: bool) -> torch.Tensor:
        name = mapped.canonical or ""
        if gguf and name.endswith(".attn.q.weight"):
            return unpermute_rows(tensor, spec.num_heads)
        if gguf and name.endswith(".attn.k.weight"):
            return unpermute_rows(tensor, spec.num_kv_heads)
        return tensor


FAMILY = Mixtral()
