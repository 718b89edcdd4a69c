"""ModelSpec: the architecture-independent description of a model.

It is the only thing the tools and the runtime share about a model. A family module builds it
from a checkpoint's config (HF `config.json` or GGUF metadata); FTW stores it in its manifest;
the runtime, `ft-diagnose` and the benchmarks read it back.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ftkit.errors import InputError, shown
from ftkit.vocab import ClampedSwiGLU

# Layer kinds (per layer, in order).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"

# Fields earlier versions wrote and this one ignores: `router` (the family's decoder routes).
LEGACY_FIELDS = frozenset({"router"})

LAYER_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION)

# Q/K norm placement.
QK_NORM_NONE = "none"
QK_NORM_HEAD = "head"  # RMSNorm over each head's head_dim (Qwen3)
QK_NORM_FULL = "full"  # RMSNorm over the whole projection (OLMoE)
QK_NORMS = (QK_NORM_NONE, QK_NORM_HEAD, QK_NORM_FULL)

# Bounds on a model's sizes. Released MoE models stay far below them (about 100 layers, 512
# experts, hidden 16k, vocabularies of 256k); they exist so that a corrupt count cannot make
# the per-layer, per-expert and per-head lists that readers and the runtime build exhaust memory
# or time before the tensors are looked at.
MAX_LAYERS = 1024
MAX_EXPERTS = 1 << 14
MAX_VOCAB = 1 << 24
MAX_HIDDEN = 1 << 17
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 12
MAX_FFN = 1 << 20
MAX_POSITIONS = 1 << 24
MAX_TOKEN_ID = (1 << 31) - 1
MAX_EOS_IDS = 64
MAX_NAME = 256  # family and architecture names


class SpecError(InputError):
    """A model description (config.json, GGUF metadata, an FTW manifest's spec) that no model
    can have; readers say which file it came from."""


def whole(value: Any, what: str, lo: int, hi: int) -> int:
    """`value` as an int in lo..hi: a JSON integer, or a float with no fraction (some configs
    write 4096.0)."""
    if isinstance(value, float) and value.is_integer() and lo <= value <= hi:
        value = int(value)
    if type(value) is not int:
        raise SpecError(f"{what} is {shown(value)}, not a whole number")
    if not lo <= value <= hi:
        raise SpecError(f"{what} is {shown(value)}, outside {lo}..{hi}")
    return value


def real(value: Any, what: str, lo: float, hi: float, open_lo: bool = False) -> float:
    """`value` as a finite float in lo..hi (`open_lo`: above lo)."""
    if type(value) not in (int, float) or not math.isfinite(value):
        raise SpecError(f"{what} is {shown(value)}, not a finite number")
    if value > hi or value < lo or (open_lo and value == lo):
        raise SpecError(f"{what} is {shown(value)}, outside {'(' if open_lo else '['}{lo}, {hi}]")
    return float(value)


def _scalar(value: Any) -> bool:
    return value is None or type(value) in (bool, int, str) or (type(value) is float and math.isfinite(value))


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
    expert_bias: bool = False  # routed experts add a bias to gate, up and down (gpt-oss)
    # gpt-oss's clamped SwiGLU in the routed experts (ftkit.vocab.ClampedSwiGLU); None: SwiGLU
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
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

    def __post_init__(self) -> None:
        """Refuse what no model has: every reader builds specs through here, so per-layer and
        per-expert loops only ever see bounded, consistent sizes."""
        for name in ("family", "architecture"):
            v = getattr(self, name)
            if type(v) is not str or not 0 < len(v) <= MAX_NAME:
                raise SpecError(f"{name} is {shown(v)}, not a name of 1..{MAX_NAME} characters")
        for name, lo, hi in (("vocab_size", 1, MAX_VOCAB), ("hidden_size", 1, MAX_HIDDEN),
                             ("num_layers", 1, MAX_LAYERS), ("num_heads", 1, MAX_HEADS),
                             ("num_kv_heads", 1, MAX_HEADS), ("head_dim", 1, MAX_HEAD_DIM),
                             ("intermediate_size", 0, MAX_FFN), ("moe_intermediate_size", 1, MAX_FFN),
                             ("num_experts", 1, MAX_EXPERTS), ("top_k", 1, MAX_EXPERTS),
                             ("shared_expert_intermediate_size", 0, MAX_FFN),
                             ("max_position_embeddings", 1, MAX_POSITIONS)):
            whole(getattr(self, name), name, lo, hi)
        if self.num_heads % self.num_kv_heads:
            raise SpecError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.top_k > self.num_experts:
            raise SpecError(f"{self.architecture}: top-k {self.top_k} is not within 1..{self.num_experts}")
        for name in ("norm_topk_prob", "shared_expert_gate", "attention_bias", "attention_out_bias",
                     "expert_bias", "tie_word_embeddings"):
            if type(getattr(self, name)) is not bool:
                raise SpecError(f"{name} is {shown(getattr(self, name))}, not true or false")
        self._check_layers()
        if self.qk_norm not in QK_NORMS:
            raise SpecError(f"qk_norm is {shown(self.qk_norm)}, not one of {', '.join(QK_NORMS)}")
        real(self.rms_norm_eps, "rms_norm_eps", 0.0, 1.0, open_lo=True)
        real(self.rope_theta, "rope_theta", 0.0, 1e30, open_lo=True)
        real(self.partial_rotary_factor, "partial_rotary_factor", 0.0, 1.0, open_lo=True)
        if (self.swiglu_alpha is None) != (self.swiglu_limit is None):
            raise SpecError("swiglu_alpha and swiglu_limit come together (the clamped SwiGLU needs both)")
        if self.swiglu_alpha is not None:
            real(self.swiglu_alpha, "swiglu_alpha", 0.0, 1e30, open_lo=True)
            real(self.swiglu_limit, "swiglu_limit", 0.0, 1e30, open_lo=True)
        if self.sliding_window is not None:
            whole(self.sliding_window, "sliding_window", 1, MAX_POSITIONS)
        if self.bos_token_id is not None:
            whole(self.bos_token_id, "bos_token_id", 0, MAX_TOKEN_ID)
        if type(self.eos_token_ids) is not tuple or len(self.eos_token_ids) > MAX_EOS_IDS:
            raise SpecError(f"eos_token_ids is not a list of at most {MAX_EOS_IDS} ids")
        for i in self.eos_token_ids:
            whole(i, "an eos token id", 0, MAX_TOKEN_ID)
        for name in ("rope_scaling", "extra"):
            d = getattr(self, name)
            if name == "rope_scaling" and d is None:
                continue
            if type(d) is not dict or not all(type(k) is str for k in d):
                raise SpecError(f"{name} is {shown(d)}, not an object")
        # rope parameters are numbers, names and short lists of numbers (mrope sections)
        bad = [k for k, v in (self.rope_scaling or {}).items()
               if not (_scalar(v) or (type(v) is list and len(v) <= 16 and all(map(_scalar, v))))]
        if bad:
            raise SpecError(f"rope_scaling {bad[0]} is {shown(self.rope_scaling[bad[0]])}, not a number or a name")

    def _check_layers(self) -> None:
        kinds, moe = self.layer_kinds, self.moe_layers
        if type(kinds) is not tuple or len(kinds) != self.num_layers:
            n = len(kinds) if isinstance(kinds, tuple) else kinds
            raise SpecError(f"layer_kinds has {shown(n)} entries for {self.num_layers} layers")
        unknown = [k for k in kinds if type(k) is not str or k not in LAYER_KINDS]
        if unknown:
            raise SpecError(f"unknown layer kind {shown(unknown[0])}")
        if type(moe) is not tuple or not moe:
            raise SpecError(f"{self.architecture}: no routed experts in this config; ftkit serves MoE models")
        for i, layer in enumerate(moe):
            whole(layer, "a MoE layer index", 0, self.num_layers - 1)
            if i and layer <= moe[i - 1]:
                raise SpecError(f"moe_layers is not strictly ascending at {layer}")

    # ---- derived -------------------------------------------------------------------------
    @cached_property
    def _moe_position(self) -> dict[int, int]:
        return {layer: i for i, layer in enumerate(self.moe_layers)}

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def num_expert_rows(self) -> int:
        """Rows in the expert pool: `row = moe_index * E + expert`."""
        return self.num_moe_layers * self.num_experts

    def moe_index(self, layer: int) -> int:
        """Position of model layer `layer` among the MoE layers (the `layer` of `row`)."""
        try:
            return self._moe_position[layer]
        except KeyError:
            raise ValueError(f"layer {layer} has no routed experts") from None

    def is_moe(self, layer: int) -> bool:
        return layer in self._moe_position

    def expert_part_shapes(self) -> dict[str, tuple[int, ...]]:
        h, i = self.hidden_size, self.moe_intermediate_size
        out: dict[str, tuple[int, ...]] = {"gate": (i, h), "up": (i, h), "down": (h, i)}
        if self.expert_bias:
            out.update(gate_bias=(i,), up_bias=(i,), down_bias=(h,))
        return out

    def expert_activation(self) -> ClampedSwiGLU | None:
        if self.swiglu_limit is None:
            return None
        return ClampedSwiGLU(self.swiglu_alpha, self.swiglu_limit)

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        d["layer_kinds"] = list(self.layer_kinds)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        """The spec as `to_dict` wrote it (JSON), checked field by field."""
        if not isinstance(d, dict):
            raise SpecError("the spec is not an object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k not in LEGACY_FIELDS}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise SpecError(f"ModelSpec has no field(s) {', '.join(unknown)}")
        missing = [n for n, f in fields.items() if n not in d and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise SpecError(f"the spec has no {', '.join(missing)}")
        for key in ("moe_layers", "layer_kinds", "eos_token_ids"):
            if key in d:
                if not isinstance(d[key], list):
                    raise SpecError(f"{key} is {shown(d[key])}, not a list")
                d[key] = tuple(d[key])
        return cls(**d)
