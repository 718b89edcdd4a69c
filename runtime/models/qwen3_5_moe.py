"""Qwen3.5 / Qwen3.6 MoE (`qwen3_5_moe`): Qwen3-Next's hybrid of gated DeltaNet and gated
attention layers over a MoE with a gated shared expert (qwen3_next.py describes both mixers and
their recurrent state), with these differences, as transformers' modeling_qwen3_5_moe has them:

- The released checkpoints are multimodal (`Qwen3_5MoeForConditionalGeneration`): the config
  nests the language model's keys under `text_config`, its tensors are `model.language_model.*`
  and the vision tower `model.visual.*`, which we skip (the model runs text-only; one note says
  so). A text-only `Qwen3_5MoeForCausalLM` checkpoint (`model.*`) loads as well; `mtp.*` (the
  multi-token-prediction block) is skipped in both.
- The DeltaNet projections are separate: `in_proj_qkv` [2*Kd + Vd, H] (q | k | v, the conv's
  channel order), `in_proj_z` [Vd, H], `in_proj_b` and `in_proj_a` [Hv, H], value heads grouped
  per key head, as Qwen3-Next's (`linear_in_proj` "qkv_z" plus the split b / a).
- RoPE is multimodal (`mrope_section`), but a text token has the same position on all three
  axes, so it is plain partial rotary (0.25 by default) for us.
- The router always renormalises its top-k (there is no norm_topk_prob); every layer is MoE.

GGUF: llama.cpp's converter names the architecture `qwen35moe`: Qwen3-Next's conversion (A as
-exp(A_log), dt_bias as `ssm_dt.bias`, the conv kernel squeezed, 1 added to the (1 + w) norms),
b and a as `ssm_beta` / `ssm_alpha`, and, where key heads are fewer than value heads, every
value-head axis reordered from grouped by key head to tiled (value head j*Hk + k reads key head
k, for ggml's broadcast): the v rows of attn_qkv and of the conv, attn_gate's rows, ssm_beta,
ssm_alpha, ssm_a, ssm_dt and ssm_out's columns. Rather than undo that (ssm_out's columns cannot
be moved inside quantized blocks), we keep it: `linear_value_order` "tiled" in `spec.extra`,
and the forward pass (qwen3_5_moe_forward.py) repeats the key heads tiled.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from ftkit.errors import shown

from ..spec import LINEAR_ATTENTION, ModelSpec, SpecError
from .base import GGUF_RULES, HF_RULES, Mapped, rules, text_config
from .config import text
from .qwen3_next import GGUF_DELTANET_RULES, Qwen3Next

LINEAR = r"\.(\d+)\.linear_attn\."
HF_35_RULES = rules(
    (r"model\.layers" + LINEAR + r"(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|conv1d|norm|out_proj)\.weight",
     "layers.{1}.linear_attn.{2}.weight"),
    (r"model\.layers" + LINEAR + r"(A_log|dt_bias)", "layers.{1}.linear_attn.{2}"),
) + HF_RULES

GGUF_35_RULES = rules(
    (r"blk\.(\d+)\.ssm_beta\.weight", "layers.{1}.linear_attn.in_proj_b.weight"),
    (r"blk\.(\d+)\.ssm_alpha\.weight", "layers.{1}.linear_attn.in_proj_a.weight"),
) + GGUF_DELTANET_RULES + GGUF_RULES

LANGUAGE_MODEL = re.compile(r"model\.language_model\.")
VISION, MTP = "model.visual.", "mtp."
# The value heads' order in every linear-attention tensor (spec.extra["linear_value_order"]):
# grouped per key head (HF), or tiled (llama.cpp's GGUF) when key heads are fewer.
GROUPED, TILED = "grouped", "tiled"
VALUE_ORDERS = (GROUPED, TILED)


class Qwen3_5Moe(Qwen3Next):
    name = "qwen3_5_moe"
    architectures = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
    gguf_archs = ("qwen35moe",)
    hf_rules = HF_35_RULES
    gguf_rules = GGUF_35_RULES
    forward = ("qwen3_5_moe_forward", "Qwen3_5MoeDecoder")
    label = "Qwen3.5-MoE"

    def spec_from_config(self, cfg: dict[str, Any]) -> ModelSpec:
        # Flattened once: the defaults Qwen3-Next fills in (layer_types) must not be overridden
        # by the nested text_config again when moe_spec reads it. The projections are split
        # (qkv, z, b, a); the router renormalises, whatever the config says.
        flat = {k: v for k, v in text_config(cfg).items() if k != "text_config"}
        if isinstance(cfg.get("text_config"), dict) and "tie_word_embeddings" in cfg:
            flat["tie_word_embeddings"] = cfg["tie_word_embeddings"]  # the wrapper's, as transformers reads it
        spec = super().spec_from_config({**flat, "linear_in_proj": "qkv_z", "norm_topk_prob": True})
        order = text(flat, "linear_value_order", GROUPED)
        if order == GROUPED or LINEAR_ATTENTION not in spec.layer_kinds:
            return spec
        spec = replace(spec, extra={**spec.extra, "linear_value_order": order})
        self.check_spec(spec)
        return spec

    def map_name(self, name: str, gguf: bool) -> Mapped | None:
        if not gguf:  # the multimodal checkpoint's language model, under the text-only names
            name = LANGUAGE_MODEL.sub("model.", name, count=1)
        return super().map_name(name, gguf)

    def skips(self, name: str, spec: ModelSpec) -> bool:
        return name.startswith((VISION, MTP))

    def skipped_note(self, skipped: list[str]) -> str | None:
        vision = sum(n.startswith(VISION) for n in skipped)
        parts = [f"the vision tower ({VISION}*, {vision} tensors) is skipped: the model runs text-only"] if vision else []
        if mtp := len(skipped) - vision:
            parts.append(f"the multi-token-prediction block ({MTP}*, {mtp} tensors) is skipped: ftkit does not decode speculatively")
        return "; ".join(parts) or None

    def dense_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        out = super().dense_shapes(spec)
        hv = spec.extra.get("linear_num_value_heads")
        for i, kind in enumerate(spec.layer_kinds):
            if kind == LINEAR_ATTENTION:  # b and a projected apart, not as Qwen3-Next's in_proj_ba
                p = f"layers.{i}.linear_attn."
                del out[p + "in_proj_ba.weight"]
                out[p + "in_proj_b.weight"] = out[p + "in_proj_a.weight"] = (hv, spec.hidden_size)
        return out

    def check_spec(self, spec: ModelSpec) -> None:
        super().check_spec(spec)
        order = spec.extra.get("linear_value_order", GROUPED)
        if order not in VALUE_ORDERS:
            raise SpecError(f"{self.label}: linear_value_order {shown(order)} is not one of {', '.join(VALUE_ORDERS)}")

    def gguf_config(self, g: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        out = super().gguf_config(g, tensor_shapes)
        if out.get("linear_num_key_heads", 0) != out.get("linear_num_value_heads", 0):
            out["linear_value_order"] = TILED  # the converter reorders then, and only then
        return out


FAMILY = Qwen3_5Moe()
