"""What a family module provides, and the pieces most families share.

A family knows three things: how to build a ModelSpec from a config (HF `config.json` or GGUF
metadata), how its checkpoint tensor names map to canonical names, and its forward pass.

Canonical dense names (FTW's dense file uses them):
    embed.weight, final_norm.weight, lm_head.weight,
    layers.N.attn_norm.weight, layers.N.mlp_norm.weight,
    layers.N.attn.{q,k,v,o}.weight, layers.N.attn.{q,k,v}.bias, layers.N.attn.{q,k}_norm.weight,
    layers.N.router.weight, layers.N.shared.{gate,up,down}.weight, layers.N.shared_gate.weight,
    layers.N.mlp.{gate,up,down}.weight (dense FFN layers).
Routed experts are not dense tensors: they map to (layer, expert, part) and go to expert banks.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..spec import (
    FULL_ATTENTION,
    MAX_EXPERTS,
    MAX_FFN,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_TOKEN_ID,
    MAX_VOCAB,
    QK_NORM_FULL,
    QK_NORM_HEAD,
    SLIDING_ATTENTION,
    ModelSpec,
    SpecError,
)
from .config import count, first_count, flag, layer_indices, names, number, section, token_ids
from .rope import check_rope

if TYPE_CHECKING:
    import torch

    from .decoder import Experts, MoEDecoder


@dataclass(frozen=True)
class Mapped:
    """Where a checkpoint tensor goes: a dense canonical name, or an expert part."""

    canonical: str | None = None  # dense tensors
    layer: int | None = None  # model layer, for expert tensors
    expert: int | None = None  # None: stacked over all experts of the layer
    # gate | up | down | gate_up (stacked gate rows then up rows), or the biases of those:
    # gate_bias | up_bias | down_bias | gate_up_bias
    part: str | None = None
    transposed: bool = False  # stored [in, out] (for x @ W, gpt-oss), not torch's [out, in]


Rule = tuple[re.Pattern[str], str]


def rules(*pairs: tuple[str, str]) -> list[Rule]:
    return [(re.compile(p), t) for p, t in pairs]


# Llama-style HF names. Templates: a dense canonical name with {1}, {2}.. for groups, or
# "expert:{layer}:{expert}:{part}" / "stacked:{layer}:{part}".
HF_RULES = rules(
    (r"model\.embed_tokens\.weight", "embed.weight"),
    (r"model\.norm\.weight", "final_norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{1}.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{1}.mlp_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.(weight|bias)", "layers.{1}.attn.{2}.{3}"),
    (r"model\.layers\.(\d+)\.self_attn\.([qk])_norm\.weight", "layers.{1}.attn.{2}_norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate\.weight", "layers.{1}.router.weight"),
    (r"model\.layers\.(\d+)\.mlp\.shared_experts?\.(gate|up|down)_proj\.weight", "layers.{1}.shared.{2}.weight"),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight", "layers.{1}.shared_gate.weight"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "layers.{1}.mlp.{2}.weight"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", "expert:{1}:{2}:{3}"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|gate|up|down)_proj", "stacked:{1}:{2}"),
)

# Names as llama.cpp's converter writes them.
GGUF_RULES = rules(
    (r"token_embd\.weight", "embed.weight"),
    (r"output_norm\.weight", "final_norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", "layers.{1}.attn_norm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", "layers.{1}.mlp_norm.weight"),
    (r"blk\.(\d+)\.attn_([qkv])\.(weight|bias)", "layers.{1}.attn.{2}.{3}"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", "layers.{1}.attn.o.{2}"),
    (r"blk\.(\d+)\.attn_([qk])_norm\.weight", "layers.{1}.attn.{2}_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate_inp\.weight", "layers.{1}.router.weight"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)_shexp\.weight", "layers.{1}.shared.{2}.weight"),
    (r"blk\.(\d+)\.ffn_gate_inp_shexp\.weight", "layers.{1}.shared_gate.weight"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.weight", "layers.{1}.mlp.{2}.weight"),
    # gate_up: `convert_hf_to_gguf.py --fuse_gate_up_exps` (llama.cpp, 2026-01): gate's rows, then up's
    (r"blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.weight", "stacked:{1}:{2}"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight", "expert:{1}:{3}:{2}"),  # older per-expert files
)


def apply_rules(name: str, table: list[Rule]) -> Mapped | None:
    for pattern, template in table:
        m = pattern.fullmatch(name)
        if not m:
            continue
        out = template.format(None, *m.groups())
        kind, _, rest = out.partition(":")
        if kind == "expert":
            layer, expert, part = rest.split(":")
            return Mapped(layer=int(layer), expert=int(expert), part=part)
        if kind == "stacked":
            layer, part = rest.split(":")
            return Mapped(layer=int(layer), part=part)
        return Mapped(canonical=out)
    return None


class Family:
    """Base of every family; subclasses set the class attributes and override what differs."""

    name: str  # registry key: the HF model_type
    architectures: tuple[str, ...]
    gguf_archs: tuple[str, ...] = ()
    hf_rules: list[Rule] = HF_RULES
    gguf_rules: list[Rule] = GGUF_RULES
    # The forward pass, by module and class: MoEDecoder, or a subclass where it has a quirk. Imported
    # when a model is built (`decoder_class`), so that reading a config or checking headers loads
    # no torch.
    forward: tuple[str, str] = ("decoder", "MoEDecoder")
    layer_kinds: frozenset[str] = frozenset({FULL_ATTENTION, SLIDING_ATTENTION})  # what the forward runs
    float32_suffixes: tuple[str, ...] = ()  # dense tensors kept in float32 at any runtime dtype

    @property
    def decoder_class(self) -> type[MoEDecoder]:
        module, name = self.forward
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)

    # ---- config -> ModelSpec ---------------------------------------------------------------
    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        raise NotImplementedError

    def check_spec(self, spec: ModelSpec) -> None:
        """Refuse (SpecError) a spec this family's forward pass cannot run: every spec from a
        config passes here, and every FTW manifest's before it loads. A subclass adds the
        checks of its own fields (`spec.extra`)."""
        kinds = set(spec.layer_kinds) - self.layer_kinds
        if kinds:
            raise SpecError(f"{spec.architecture}: layer kind(s) {', '.join(sorted(kinds))} not supported")
        check_rope(spec)

    def spec_from_gguf(self, meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> ModelSpec:
        """llama.cpp metadata -> the HF config keys this family reads -> spec_from_config."""
        g = gguf_common(meta, tensor_shapes)
        g.update(architectures=list(self.architectures), num_experts=g["experts"],
                 num_experts_per_tok=g["experts_used"], **self.gguf_config(g, tensor_shapes))
        return self.spec_from_config(g)

    def gguf_config(self, g: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        """Family-specific HF config keys from `gguf_common`'s raw fields."""
        raise NotImplementedError

    # ---- names -----------------------------------------------------------------------------
    def map_name(self, name: str, gguf: bool) -> Mapped | None:
        return apply_rules(name, self.gguf_rules if gguf else self.hf_rules)

    def skips(self, name: str, spec: ModelSpec) -> bool:
        """A checkpoint tensor this family leaves out by design (a vision tower, a
        multi-token-prediction layer): the inventory
        sets these apart from the unexpected ones, and `skipped_note` sums them up."""
        return False

    def skipped_note(self, skipped: list[str]) -> str | None:
        """One line on the tensors `skips` set apart, for ft-diagnose and ftw-convert to show;
        None when there are none."""
        return None

    def sanitize(self, mapped: Mapped, tensor: torch.Tensor, spec: ModelSpec, gguf: bool) -> torch.Tensor:
        """Undo a checkpoint quirk on one tensor (stored representation in, same out)."""
        return tensor

    def dense_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        """Every dense tensor the forward pass needs, with its shape."""
        return llama_dense_shapes(spec)

    def recurrent_state_bytes(self, spec: ModelSpec, dtype: torch.dtype) -> int:
        """One sequence's recurrent-state bytes (linear-attention layers), whatever its length."""
        return 0

    def graphs_unsupported(self, spec: ModelSpec) -> str | None:
        """Why this family's forward cannot run through the engine's CUDA graphs and fused
        kernels (one line), or None; the memory plans reserve no graph K/V then."""
        return None

    def attention_workspace(self, spec: ModelSpec, t: int, context: int, itemsize: int, flash: bool) -> int:
        """Transient bytes of the forward's attention for a piece of t queries behind `context`
        keys (a GPU prefill's, engine/memory.py): the projections and the output, with flash its
        float32 log-sum-exp; without, the float mask, the boolean mask and its negation and the
        K/V heads repeated to the query heads for SDPA's memory-efficient kernel (models/layers.py)."""
        qkv = t * (2 * spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim * itemsize
        if flash:
            return qkv + t * spec.num_heads * 4
        return t * context * (itemsize + 2) + 2 * context * spec.num_heads * spec.head_dim * itemsize + qkv

    # ---- forward ---------------------------------------------------------------------------
    def decoder(self, spec: ModelSpec, weights: dict[str, torch.Tensor], experts: Experts) -> MoEDecoder:
        """The forward pass over canonical dense weights; routed experts run in `experts`."""
        return self.decoder_class(spec, weights, experts)


# ---- shared helpers ------------------------------------------------------------------------
def llama_dense_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, v = spec.hidden_size, spec.vocab_size
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    out: dict[str, tuple[int, ...]] = {"embed.weight": (v, h), "final_norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        out[p + "attn_norm.weight"] = (h,)
        out[p + "mlp_norm.weight"] = (h,)
        out.update({p + "attn.q.weight": (q_out, h), p + "attn.k.weight": (kv_out, h)})
        out.update({p + "attn.v.weight": (kv_out, h), p + "attn.o.weight": (h, q_out)})
        if spec.attention_bias:
            out.update({p + "attn.q.bias": (q_out,), p + "attn.k.bias": (kv_out,), p + "attn.v.bias": (kv_out,)})
        if spec.attention_out_bias:
            out[p + "attn.o.bias"] = (h,)
        if spec.qk_norm == QK_NORM_HEAD:
            out.update({p + "attn.q_norm.weight": (spec.head_dim,), p + "attn.k_norm.weight": (spec.head_dim,)})
        elif spec.qk_norm == QK_NORM_FULL:
            out.update({p + "attn.q_norm.weight": (q_out,), p + "attn.k_norm.weight": (kv_out,)})
        if spec.is_moe(i):
            out[p + "router.weight"] = (spec.num_experts, h)
            s = spec.shared_expert_intermediate_size
            if s:
                out.update({p + "shared.gate.weight": (s, h), p + "shared.up.weight": (s, h)})
                out[p + "shared.down.weight"] = (h, s)
                if spec.shared_expert_gate:
                    out[p + "shared_gate.weight"] = (1, h)
        else:
            d = spec.intermediate_size
            out.update({p + "mlp.gate.weight": (d, h), p + "mlp.up.weight": (d, h), p + "mlp.down.weight": (h, d)})
    return out


def rope_from_config(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling, partial_rotary_factor) from old (`rope_theta`/`rope_scaling`) or
    transformers-5 (`rope_parameters`) configs."""
    params = section(cfg, "rope_parameters")
    theta = number(params, "rope_theta", number(cfg, "rope_theta", 10000.0, 0.0, 1e30, True), 0.0, 1e30, True)
    partial = number(params, "partial_rotary_factor",
                     number(cfg, "partial_rotary_factor", 1.0, 0.0, 1.0, True), 0.0, 1.0, True)
    scaling = section(cfg, "rope_scaling") or {
        k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")
    }
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None, partial
    return theta, {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": kind}, partial


def moe_layers_from(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Qwen-style sparse-step and dense-layer lists; every layer is MoE when they are absent."""
    step = count(cfg, "decoder_sparse_step", 0, hi=MAX_LAYERS) or 1
    dense = set(layer_indices(cfg, "mlp_only_layers"))
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multimodal wrappers nest the language model's config; the text part is what we serve."""
    inner = cfg.get("text_config")
    return {**cfg, **inner} if isinstance(inner, dict) else cfg


def layer_count(cfg: dict[str, Any]) -> int:
    return first_count(cfg, "num_hidden_layers", what="layer count", hi=MAX_LAYERS)


def base_spec_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The ModelSpec fields every Llama-style config spells the same way."""
    num_layers = layer_count(cfg)
    num_heads = first_count(cfg, "num_attention_heads", what="attention head count", hi=MAX_HEADS)
    hidden = first_count(cfg, "hidden_size", what="hidden size", hi=MAX_HIDDEN)
    theta, scaling, partial = rope_from_config(cfg)
    archs = names(cfg, "architectures") or [family]
    kinds = names(cfg, "layer_types", MAX_LAYERS) or [FULL_ATTENTION] * num_layers
    bos = count(cfg, "bos_token_id", None, hi=MAX_TOKEN_ID)
    return dict(
        family=family,
        architecture=archs[0],
        vocab_size=first_count(cfg, "vocab_size", what="vocabulary size", hi=MAX_VOCAB),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=count(cfg, "num_key_value_heads", 0, hi=MAX_HEADS) or num_heads,
        head_dim=count(cfg, "head_dim", 0, hi=MAX_HEAD_DIM) or hidden // num_heads,
        rms_norm_eps=number(cfg, "rms_norm_eps", 1e-6, 0.0, 1.0, open_lo=True),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        max_position_embeddings=count(cfg, "max_position_embeddings", 4096, lo=1, hi=MAX_POSITIONS),
        tie_word_embeddings=flag(cfg, "tie_word_embeddings", False),
        bos_token_id=bos,
        eos_token_ids=token_ids(cfg, "eos_token_id"),
        layer_kinds=tuple(kinds),
    )


def sliding_window(cfg: dict[str, Any]) -> int | None:
    """Qwen's window, which applies only when `use_sliding_window` is set."""
    if not flag(cfg, "use_sliding_window", False):
        return None
    return count(cfg, "sliding_window", None, lo=1, hi=MAX_POSITIONS)


def moe_spec(family: Family, cfg: dict[str, Any], expert_ffn: str, dense_ffn: bool, **fields: Any) -> ModelSpec:
    """A MoE ModelSpec from a Llama-style config, checked by `family`; `fields` override or add
    family specifics."""
    cfg = text_config(cfg)
    f = base_spec_fields(cfg, family.name)
    f.update(
        intermediate_size=count(cfg, "intermediate_size", 0, hi=MAX_FFN) if dense_ffn else 0,
        moe_intermediate_size=first_count(cfg, expert_ffn, what="expert FFN width", hi=MAX_FFN),
        num_experts=first_count(cfg, "num_experts", "num_local_experts", what="expert count", hi=MAX_EXPERTS),
        top_k=first_count(cfg, "num_experts_per_tok", what="experts per token", hi=MAX_EXPERTS),
        moe_layers=moe_layers_from(cfg, f["num_layers"]),
        norm_topk_prob=flag(cfg, "norm_topk_prob", False),
    )
    spec = ModelSpec(**{**f, **fields})
    family.check_spec(spec)
    return spec


def gguf_common(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """llama.cpp's metadata keys translated to HF config keys shared by Llama-style families.

    Family-specific keys (FFN widths, expert counts) are left to the family, under the raw
    names `ffn`, `expert_ffn`, `shared_ffn`, `experts`, `experts_used`.
    """
    arch = meta.get("general.architecture")

    def g(key: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{key}", default)
        return v[0] if isinstance(v, list) and v else v  # some keys may be per-layer arrays

    if not shapes.get("token_embd.weight"):
        raise SpecError("GGUF has no token_embd.weight tensor (or it has no dimensions)")
    cfg: dict[str, Any] = {
        "architectures": None,
        "num_hidden_layers": g("block_count"),
        "hidden_size": g("embedding_length"),
        "num_attention_heads": g("attention.head_count"),
        "num_key_value_heads": g("attention.head_count_kv"),
        "head_dim": g("attention.key_length"),
        "rms_norm_eps": g("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": g("rope.freq_base", 10000.0),
        "max_position_embeddings": g("context_length", 4096),
        "vocab_size": shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "ffn": g("feed_forward_length"),
        "expert_ffn": g("expert_feed_forward_length"),
        "shared_ffn": g("expert_shared_feed_forward_length"),
        "experts": g("expert_count"),
        "experts_used": g("expert_used_count"),
    }
    kind = g("rope.scaling.type")
    if kind and kind != "none":
        cfg["rope_scaling"] = {"rope_type": kind, "factor": g("rope.scaling.factor", 1.0)}
        if g("rope.scaling.original_context_length"):
            cfg["rope_scaling"]["original_max_position_embeddings"] = g("rope.scaling.original_context_length")
    return cfg
