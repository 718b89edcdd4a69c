"""ModelSpec: the architecture-independent description of a model.

It is the only thing the tools and the runtime share about a model. A family module builds it
from a checkpoint's config (HF `config.json` or GGUF metadata); FTW stores it in its manifest;
the runtime, `ft-diagnose` and the benchmarks read it back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Layer kinds (per layer, in order).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"

# Fields earlier versions wrote and this one ignores: `router` (the family's decoder routes).
LEGACY_FIELDS = frozenset({"router"})

# Q/K norm placement.
QK_NORM_NONE = "none"
QK_NORM_HEAD = "head"  # RMSNorm over each head's head_dim (Qwen3)
QK_NORM_FULL = "full"  # RMSNorm over the whole projection (OLMoE)


@dataclass(frozen=True)
class ModelSpec:
    family: str  # registry key, e.g. "qwen3_moe"
    architecture: str  # HF architectures[0], e.g. "Qwen3MoeForCausalLM"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (layers without experts); 0 if none
    moe_intermediate_size: int  # one routed expert's FFN width (I)
    num_experts: int  # routed experts per MoE layer (E)
    top_k: int
    moe_layers: tuple[int, ...]  # model layer indices that hold routed experts, ascending
    layer_kinds: tuple[str, ...]
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # sigmoid(x @ w) scales the shared expert (Qwen2-MoE)
    qk_norm: str = QK_NORM_NONE
    attention_bias: bool = False  # bias on q, k, v projections
    attention_out_bias: bool = False  # bias on the output projection
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific fields (e.g. linear attention)

    # ---- derived -------------------------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def num_expert_rows(self) -> int:
        """Rows in the expert pool: `row = moe_index * E + expert`."""
        return self.num_moe_layers * self.num_experts

    def moe_index(self, layer: int) -> int:
        """Position of model layer `layer` among the MoE layers (the `layer` of `row`)."""
        return self.moe_layers.index(layer)

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def expert_part_shapes(self) -> dict[str, tuple[int, int]]:
        h, i = self.hidden_size, self.moe_intermediate_size
        return {"gate": (i, h), "up": (i, h), "down": (h, i)}

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        d["layer_kinds"] = list(self.layer_kinds)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k not in LEGACY_FIELDS}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ModelSpec has no field(s) {', '.join(unknown)}")
        for key in ("moe_layers", "layer_kinds", "eos_token_ids"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)
