"""gpt-oss (OpenAI's open-weight MoE): attention with q/k/v/o biases and a learned sink logit per
head in the softmax denominator, sliding-window layers alternating with full ones (`layer_types`),
YaRN rope; a router with a bias whose top-k logits are softmaxed; experts with biases and a
clamped SwiGLU (transformers' GptOssExperts; ftkit.vocab.ClampedSwiGLU).

HF checkpoints store each layer's experts stacked and transposed for x @ W: `gate_up_proj`
[E, H, 2I] with gate and up interleaved along the last dimension (gate the even columns),
`gate_up_proj_bias` [E, 2I] interleaved alike, `down_proj` [E, I, H], `down_proj_bias` [E, H].
The released checkpoints hold the expert matrices as MXFP4 instead (`*_blocks`, `*_scales`,
[out, in]); the safetensors source pairs those into one mxfp4 tensor (checkpoint/safetensors.py),
which conversion dequantizes. GGUF (llama.cpp's arch `gpt-oss`) stores them split into gate, up
and down [out, in], biases alike. Sliding-window layers keep a ring of their window's K/V rows
(models/kv.py; the memory plan prices them so), and a prefix reused from the cache resumes at an
anchor that saved each window, restoring exactly what a fresh prefill would have. The forward
pass (sink attention, the biased router, the norms) is gpt_oss_forward.py; graph decode runs
the same layer body, the Triton attention kernels adding the sinks (engine/graphs.py).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ..spec import FULL_ATTENTION, MAX_POSITIONS, SLIDING_ATTENTION, ModelSpec, SpecError
from .base import (
    GGUF_RULES,
    HF_RULES,
    Family,
    Mapped,
    apply_rules,
    gguf_common,
    layer_count,
    llama_dense_shapes,
    moe_spec,
    rules,
    text_config,
)
from .config import count, number, section

if TYPE_CHECKING:
    import torch

# As llama.cpp's converter writes arch `gpt-oss`: the experts split into gate/up/down and their
# biases, [out, in] (MXFP4 blocks or floats), the post-attention norm under its own name.
GGUF_GPT_OSS_RULES = rules(
    (r"blk\.(\d+)\.attn_sinks\.weight", "layers.{1}.attn.sinks"),
    (r"blk\.(\d+)\.post_attention_norm\.weight", "layers.{1}.mlp_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate_inp\.bias", "layers.{1}.router.bias"),
    (r"blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.bias", "stacked:{1}:{2}_bias"),
) + GGUF_RULES
HF_GPT_OSS_RULES = rules(
    (r"model\.layers\.(\d+)\.self_attn\.sinks", "layers.{1}.attn.sinks"),
    (r"model\.layers\.(\d+)\.mlp\.router\.(weight|bias)", "layers.{1}.router.{2}"),
) + HF_RULES
# the stacked experts: gate_up or down; their biases, the bf16 matrices ([in, out]) or MXFP4 blocks
EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj(_bias|_blocks)?")
# transformers' GptOssConfig defaults, for the keys a config may leave out
DEFAULT_THETA = 150000.0
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
SCORES_PER_BLOCK = 1 << 24  # attention scores materialised at once (queries are taken in blocks)


class GptOss(Family):
    name = "gpt_oss"
    architectures = ("GptOssForCausalLM",)
    gguf_archs = ("gpt-oss",)
    hf_rules = HF_GPT_OSS_RULES
    gguf_rules = GGUF_GPT_OSS_RULES
    forward = ("gpt_oss_forward", "GptOssDecoder")
    float32_suffixes = ("_norm.weight",)  # transformers' _keep_in_fp32_modules: every RMSNorm

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        cfg = dict(text_config(cfg))
        layers = layer_count(cfg)
        if not section(cfg, "rope_parameters") and not section(cfg, "rope_scaling"):
            cfg["rope_parameters"] = DEFAULT_ROPE
        if cfg.get("rope_theta") is None and section(cfg, "rope_parameters").get("rope_theta") is None:
            cfg["rope_theta"] = DEFAULT_THETA
        if cfg.get("layer_types") is None:  # transformers' default: even layers slide
            cfg["layer_types"] = [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(layers)]
        for key, value in (("head_dim", 64), ("rms_norm_eps", 1e-5)):
            if cfg.get(key) is None:
                cfg[key] = value
        return moe_spec(
            self, cfg, "intermediate_size", dense_ffn=False,
            attention_bias=True, attention_out_bias=True, expert_bias=True,
            swiglu_alpha=number(cfg, "swiglu_alpha", 1.702, 0.0, 1e30, open_lo=True),
            swiglu_limit=number(cfg, "swiglu_limit", 7.0, 0.0, 1e30, open_lo=True),
            sliding_window=count(cfg, "sliding_window", 128, lo=1, hi=MAX_POSITIONS),
        )

    def spec_from_gguf(self, meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> ModelSpec:
        """llama.cpp's keys: the window, YaRN's betas, the expert width; the layer pattern (even
        layers slide) and the activation's constants are llama.cpp's fixed ones, transformers'
        defaults too, and YaRN is not truncated, as the released config says."""
        arch = meta.get("general.architecture")
        g = gguf_common(meta, tensor_shapes)
        rope = {**DEFAULT_ROPE, **(g.pop("rope_scaling", None) or {})}
        for key in ("beta_fast", "beta_slow"):
            rope[key] = meta.get(f"{arch}.rope.scaling.yarn_{key}", rope[key])
        g.update(architectures=list(self.architectures), num_local_experts=g["experts"],
                 num_experts_per_tok=g["experts_used"], intermediate_size=g["expert_ffn"],
                 sliding_window=meta.get(f"{arch}.attention.sliding_window"), rope_scaling=rope)
        return self.spec_from_config(g)

    def attention_workspace(self, spec: ModelSpec, t: int, context: int, itemsize: int, flash: bool) -> int:
        """sink_attention's (gpt_oss_forward.py): the projections and the output, and per query
        block its scores, the logits with the sink column, those less their maximum, the softmax
        and its cast, and the masks."""
        qkv = t * (2 * spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim * itemsize
        block = max(1, min(t, SCORES_PER_BLOCK // (spec.num_heads * context)))
        scores = spec.num_heads * block * (context + 1)
        return qkv + 5 * scores * itemsize + block * context * (itemsize + 1)

    def check_spec(self, spec: ModelSpec) -> None:
        """The forward pass needs the biases, sinks and clamped experts a gpt-oss spec says it has."""
        super().check_spec(spec)
        if not (spec.attention_bias and spec.attention_out_bias and spec.expert_bias) or spec.swiglu_limit is None:
            raise SpecError("gpt-oss: the spec lacks the attention or expert biases or the clamped SwiGLU")

    def map_name(self, name: str, gguf: bool) -> Mapped | None:
        m = None if gguf else EXPERTS.fullmatch(name)
        if m is None:
            return apply_rules(name, self.gguf_rules if gguf else self.hf_rules)
        layer, part, suffix = int(m[1]), m[2], m[3]
        if suffix == "_bias":
            return Mapped(layer=layer, part=part + "_bias")
        return Mapped(layer=layer, part=part, transposed=suffix is None)  # MXFP4 blocks are [out, in]

    def sanitize(self, mapped: Mapped, tensor: torch.Tensor, spec: ModelSpec, gguf: bool) -> torch.Tensor:
        """HF's gate/up interleaved (gate first of each pair) -> every gate row, then every up
        row; on raw MXFP4 rows too (rows are whole blocks). A GGUF's fused gate_up is already in
        that order (the converter splits the pairs before it fuses)."""
        if gguf or mapped.part not in ("gate_up", "gate_up_bias"):
            return tensor
        dim = -1 if mapped.transposed or mapped.part == "gate_up_bias" else -2
        n = tensor.shape[dim]
        # pairs (gate, up) along `dim` -> the pair index inner: every gate, then every up
        if dim == -1:
            return tensor.unflatten(-1, (n // 2, 2)).transpose(-1, -2).flatten(-2, -1)
        return tensor.unflatten(-2, (n // 2, 2)).transpose(-2, -3).flatten(-3, -2)

    def dense_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        out = llama_dense_shapes(spec)
        for i in range(spec.num_layers):
            out[f"layers.{i}.attn.sinks"] = (spec.num_heads,)
            if spec.is_moe(i):
                out[f"layers.{i}.router.bias"] = (spec.num_experts,)
        return out


FAMILY = GptOss()
