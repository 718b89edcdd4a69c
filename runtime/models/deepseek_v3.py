"""DeepSeek-V3 / R1 and Kimi-K2 (transformers' `deepseek_v3`): multi-head latent attention (MLA),
GLM-4.5's grouped sigmoid routing with a selection-only bias (this family extends glm4_moe.py),
shared experts, leading dense layers, YaRN rope whose mscale_all_dim also scales the softmax.

MLA (transformers' DeepseekV3Attention): queries from x through a low-rank pair with a norm
between (`q_a`, `q_a_norm`, `q_b`; a plain `q` where q_lora_rank is null), each head
qk_nope_head_dim channels without rope then qk_rope_head_dim with; `kv_a` projects x to a
kv_lora_rank latent (normed by `kv_a_norm`) and one rope key shared by every head; `kv_b`
expands the latent to each head's nope key and its value (v_head_dim). The KV cache keeps the
normed latent and the rotated rope key per position (kv_size.kv_rows), not the expanded heads,
and the decoder (deepseek_v3_forward.py) absorbs kv_b into the queries and the output where that
is cheaper. The spec's head_dim is the rope width (transformers' `head_dim` for this model),
num_kv_heads 1 (the latent is one head every query head reads); the latent's sizes are in
`extra`. The two low-rank norms use transformers' fixed eps of 1e-6, not rms_norm_eps.

Checkpoints: DeepSeek's block-scaled FP8 ones are dequantized by the source
(checkpoint/safetensors.py). The multi-token-prediction layer (`model.layers.{N}` for N =
num_hidden_layers: eh_proj, enorm, hnorm, shared_head) is not served; its tensors map as unused.
GGUF (llama.cpp arch `deepseek2`): MLA written as MQA over the latent (head_count_kv 1,
key_length kv_lora_rank + rope, the per-head sizes under key_length_mla / value_length_mla; older
files had the per-head sizes in key_length / value_length); kv_b whole (`attn_kv_b`) or, from
newer converters, split per head into `attn_k_b` [H, kv_lora_rank, nope] (transposed) and
`attn_v_b` [H, v_head_dim, kv_lora_rank]; the FTW keeps whichever the checkpoint has
(`extra["kv_b_split"]`). YaRN's mscale_all_dim is `rope.scaling.yarn_log_multiplier` / 0.1.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from ftkit.errors import shown

from ..spec import MAX_HEAD_DIM, MAX_HIDDEN, MAX_LAYERS, ModelSpec, SpecError, whole
from .base import GGUF_RULES, gguf_common, rules, text_config
from .config import MAX_COUNT, count, first_count, flag, text
from .glm4_moe import HF_GLM_RULES, SIGMOID_GATING, Glm4Moe

HF_DSV3_RULES = rules(
    (r"model\.layers\.(\d+)\.self_attn\.(q_a|q_b|kv_b)_proj\.(weight|bias)", "layers.{1}.attn.{2}.{3}"),
    (r"model\.layers\.(\d+)\.self_attn\.kv_a_proj_with_mqa\.(weight|bias)", "layers.{1}.attn.kv_a.{2}"),
    (r"model\.layers\.(\d+)\.self_attn\.(q_a|kv_a)_layernorm\.weight", "layers.{1}.attn.{2}_norm.weight"),
) + HF_GLM_RULES

GGUF_DSV3_RULES = rules(
    (r"blk\.(\d+)\.attn_(q_a|q_b|kv_b|k_b|v_b)\.weight", "layers.{1}.attn.{2}.weight"),
    (r"blk\.(\d+)\.attn_kv_a_mqa\.(weight|bias)", "layers.{1}.attn.kv_a.{2}"),
    (r"blk\.(\d+)\.attn_(q_a|kv_a)_norm\.weight", "layers.{1}.attn.{2}_norm.weight"),
    (r"blk\.(\d+)\.exp_probs_b\.bias", "layers.{1}.router.bias"),
) + GGUF_RULES

F32_TENTH = struct.unpack("<f", struct.pack("<f", 0.1))[0]
LORA_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which q_a/kv_a_layernorm keep
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim")


def softmax_scale(spec: ModelSpec) -> float:
    """transformers' MLA scale: (nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 where
    the rope is scaled and mscale_all_dim given (modeling_rope_utils.yarn_apply_mscale)."""
    scale = (spec.extra["qk_nope_head_dim"] + spec.head_dim) ** -0.5
    s = spec.rope_scaling or {}
    m_all, factor = s.get("mscale_all_dim"), s.get("factor")
    if m_all and factor and factor > 1:
        m = 0.1 * m_all * math.log(factor) + 1.0
        scale *= m * m
    return scale


def absorbs(spec: ModelSpec, t: int) -> bool:
    """Whether t queries take MLA's absorbed form (deepseek_v3_forward.py): per head and cached
    position, expanding costs kv_lora_rank x (nope + v) multiplies once plus t x (nope + rope +
    v) for the attention, absorbing t x (2 kv_lora_rank + rope) (latent-width keys and values)."""
    e, rope = spec.extra, spec.head_dim
    latent, nope, v = e["kv_lora_rank"], e["qk_nope_head_dim"], e["v_head_dim"]
    return t * (2 * latent + rope) < latent * (nope + v) + t * (nope + rope + v)


class DeepseekV3(Glm4Moe):
    name = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    gguf_archs = ("deepseek2",)
    hf_rules = HF_DSV3_RULES
    gguf_rules = GGUF_DSV3_RULES
    forward = ("deepseek_v3_forward", "DeepseekV3Decoder")

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        cfg = dict(text_config(cfg))
        if text(cfg, "scoring_func", "sigmoid") != "sigmoid":  # DeepSeek-V2's softmax routers are another model
            raise SpecError(f"DeepSeek-V3 routes by sigmoid; scoring_func is {shown(cfg['scoring_func'])}")
        # the spec's heads as MLA's cache sees them: the rope width, one latent head (module doc)
        rope = first_count(cfg, "qk_rope_head_dim", what="rope head width", hi=MAX_HEAD_DIM)
        if rope % 2:
            raise SpecError(f"qk_rope_head_dim is {rope}, not even (rope rotates pairs of channels)")
        cfg.update(head_dim=rope, num_key_value_heads=1, partial_rotary_factor=1.0, use_qk_norm=False)
        return super().spec_from_config(cfg)

    def extra_fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return {
            **super().extra_fields(cfg),
            "q_lora_rank": count(cfg, "q_lora_rank", 0, hi=MAX_HIDDEN),  # 0: a plain q projection
            "kv_lora_rank": first_count(cfg, "kv_lora_rank", what="kv_lora_rank", hi=MAX_HIDDEN),
            "qk_nope_head_dim": first_count(cfg, "qk_nope_head_dim", what="qk_nope_head_dim", hi=MAX_HEAD_DIM),
            "v_head_dim": first_count(cfg, "v_head_dim", what="v_head_dim", hi=MAX_HEAD_DIM),
            "rope_interleave": flag(cfg, "rope_interleave", True),
            "kv_b_split": flag(cfg, "kv_b_split", False),  # set from a GGUF's tensors only
        }

    def check_spec(self, spec: ModelSpec) -> None:
        super().check_spec(spec)
        e = spec.extra
        whole(e.get("q_lora_rank"), "q_lora_rank", 0, MAX_HIDDEN)
        for key in MLA_FIELDS[1:]:
            whole(e.get(key), key, 1, MAX_HIDDEN)
        for key in ("rope_interleave", "kv_b_split"):
            if type(e.get(key)) is not bool:
                raise SpecError(f"{key} is {shown(e.get(key))}, not true or false")
        if spec.num_kv_heads != 1 or spec.partial_rotary_factor != 1.0:
            raise SpecError("DeepSeek-V3: the spec's attention is not MLA's (one latent head, head_dim the rope width)")

    def spec_from_gguf(self, meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> ModelSpec:
        g = gguf_common(meta, tensor_shapes)
        arch = meta.get("general.architecture")

        def m(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}")
            return default if value is None else value

        # llama.cpp reads a missing key as softmax: DeepSeek-V2's GGUFs, written before the key, share the arch
        if m("expert_gating_func") != SIGMOID_GATING:
            raise SpecError(f"deepseek2 GGUF with expert_gating_func {shown(m('expert_gating_func'))} (DeepSeek-V2's "
                            f"softmax routing); ftkit serves DeepSeek-V3's sigmoid one")
        # a converter that keeps the multi-token-prediction layer counts it in block_count
        g["num_hidden_layers"] = count(g, "num_hidden_layers", 0, hi=MAX_COUNT) - count(
            meta, f"{arch}.nextn_predict_layers", 0, hi=MAX_LAYERS)
        rope = m("rope.dimension_count")
        # newer converters: key_length is the latent's (kv_lora_rank + rope), the heads' under _mla
        qk, v = m("attention.key_length_mla", g["head_dim"]), m("attention.value_length_mla", m("attention.value_length"))
        scaling = g.pop("rope_scaling", None)
        if scaling and m("rope.scaling.yarn_log_multiplier") is not None:
            # llama.cpp folds both mscales into one: YaRN's own factor cancels (mscale = mscale_all_dim).
            # The converter stores 0.1 x mscale_all_dim as float32: over float32's 0.1, 1.0 stays 1.0.
            mscale = m("rope.scaling.yarn_log_multiplier") / F32_TENTH
            scaling.update(mscale=mscale, mscale_all_dim=mscale)
        g.update(
            architectures=list(self.architectures), n_routed_experts=g["experts"], num_experts_per_tok=g["experts_used"],
            intermediate_size=g["ffn"], moe_intermediate_size=g["expert_ffn"], rope_scaling=scaling,
            n_shared_experts=m("expert_shared_count", 0), first_k_dense_replace=m("leading_dense_block_count", 0),
            routed_scaling_factor=m("expert_weights_scale", 1.0), norm_topk_prob=m("expert_weights_norm", False),
            n_group=m("expert_group_count", 1), topk_group=m("expert_group_used_count", 1),
            q_lora_rank=m("attention.q_lora_rank"), kv_lora_rank=m("attention.kv_lora_rank"), qk_rope_head_dim=rope,
            qk_nope_head_dim=qk - rope if type(qk) is int and type(rope) is int else None, v_head_dim=v,
            attention_bias="blk.0.attn_kv_a_mqa.bias" in tensor_shapes,
            kv_b_split="blk.0.attn_k_b.weight" in tensor_shapes,
            # llama.cpp's deepseek2 rotates interleaved pairs (its NORM rope), as the HF weights are laid out
            rope_interleave=True,
        )
        return self.spec_from_config(g)

    def dense_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        """Glm4Moe's, the attention MLA's (module doc)."""
        h, heads, e, rope = spec.hidden_size, spec.num_heads, spec.extra, spec.head_dim
        nope, v, latent, q_rank = e["qk_nope_head_dim"], e["v_head_dim"], e["kv_lora_rank"], e["q_lora_rank"]
        out = {k: s for k, s in super().dense_shapes(spec).items() if ".attn." not in k}
        for i in range(spec.num_layers):
            p = f"layers.{i}.attn."
            if q_rank:
                out.update({p + "q_a.weight": (q_rank, h), p + "q_a_norm.weight": (q_rank,),
                            p + "q_b.weight": (heads * (nope + rope), q_rank)})
            else:
                out[p + "q.weight"] = (heads * (nope + rope), h)
            out.update({p + "kv_a.weight": (latent + rope, h), p + "kv_a_norm.weight": (latent,),
                        p + "o.weight": (h, heads * v)})
            if e["kv_b_split"]:
                out.update({p + "k_b.weight": (heads, latent, nope), p + "v_b.weight": (heads, v, latent)})
            else:
                out[p + "kv_b.weight"] = (heads * (nope + v), latent)
            if spec.attention_bias:  # transformers' attention_bias: on q_a, kv_a and o
                out.update({p + "kv_a.bias": (latent + rope,), p + "o.bias": (h,)})
                if q_rank:
                    out[p + "q_a.bias"] = (q_rank,)
        return out

    def graphs_unsupported(self, spec: ModelSpec) -> str | None:
        return "latent attention (MLA) is not in the graph kernels"

    def attention_workspace(self, spec: ModelSpec, t: int, context: int, itemsize: int, flash: bool) -> int:
        """The MLA forward's for t queries behind `context` keys in the form it takes
        (deepseek_v3_forward.py), with the boolean mask: expanded, the queries, every head's keys
        and values over the context and the output (SDPA's memory-efficient kernel, whose values
        may be narrower than the keys, materialises no scores); absorbed, the latent-width
        queries and outputs and the float32 scores of SDPA's math kernel (one key head: no fused
        kernel takes it with a mask)."""
        e, heads, rope = spec.extra, spec.num_heads, spec.head_dim
        qk, v, latent = e["qk_nope_head_dim"] + rope, e["v_head_dim"], e["kv_lora_rank"]
        mask = t * context
        if absorbs(spec, t):
            return t * heads * (2 * latent + rope + v) * itemsize + t * heads * context * 4 + mask
        return (t * heads * (qk + v) + context * heads * (qk + v)) * itemsize + mask

    def skips(self, name: str, spec: ModelSpec) -> bool:
        """The multi-token-prediction layer: the one past the main layers."""
        return name.startswith((f"model.layers.{spec.num_layers}.", f"blk.{spec.num_layers}."))

    def skipped_note(self, skipped: list[str]) -> str | None:
        parts = skipped[0].split(".")  # blk.N.* (GGUF) or model.layers.N.*
        prefix = ".".join(parts[:2] if parts[0] == "blk" else parts[:3])
        return f"the multi-token-prediction layer ({prefix}.*) is skipped: ftkit serves the main layers"


FAMILY = DeepseekV3()
