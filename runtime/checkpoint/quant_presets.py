"""llama-quantize's presets: the block format it gives each tensor of a GGUF model.

`preset_formats(preset, shapes, n_layer, n_expert)` answers, for every tensor (GGUF names, torch
shapes), the format `llama-quantize <preset>` writes without an importance matrix, or None for a
tensor it leaves as it is. The rules are those of llama.cpp's src/llama-quant.cpp
(`tensor_allows_quantization`, `llama_tensor_get_type_impl`, `tensor_type_fallback`) for the
tensors of the model families ftkit serves; its architecture-specific cases (Falcon, 70B
llamas) and the tensor kinds those families do not have are left out.

Q4_K_M, for one, is Q4_K throughout except: `output.weight` (and a tied `token_embd.weight`)
Q6_K; `attn_v` Q6_K on the layers `use_more_bits` picks (the first and last eighth, and every
third in between); `ffn_down` (the experts' and the shared expert's alike) Q6_K on those same
layers, counted by the layer number in the name; in a model of exactly 8 experts (Mixtral's
case) `attn_v` and `attn_k` Q8_0 and `attn_output` Q5_K. A row length that does not split into
256-weight blocks falls back: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, then to F16 below 32.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ftkit.runtime.spec import ModelSpec
from ftkit.vocab import FORMATS, FormatError

# name -> category, first match wins (llama-quant.cpp's tensor_get_category)
_CATEGORIES = (
    ("output", re.compile(r"^output\.weight$")), ("token_embd", re.compile(r"^token_embd\.weight$")),
    ("attn_v", re.compile(r"attn_(qkv|kv_b|v)\.weight")), ("attn_k", re.compile(r"attn_k\.weight")),
    ("attn_q", re.compile(r"attn_q\.weight")), ("attn_output", re.compile(r"attn_output\.weight")),
    ("ffn_up", re.compile(r"ffn_up")), ("ffn_gate", re.compile(r"ffn_gate")),
    ("ffn_down", re.compile(r"ffn_down")),
)  # fmt: skip
_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}  # for rows that do not split into 256


def _category(name: str) -> str:
    return next((cat for cat, pattern in _CATEGORIES if pattern.search(name)), "other")


def _layer(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: dimensions up to the last (slowest, first in torch order) one above 1."""
    return next((len(shape) - i for i, d in enumerate(shape) if d > 1), 1)


def _quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """tensor_allows_quantization: 2-D and 3-D weights but norms, routers and conv kernels."""
    return (_n_dims(shape) >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name and "ssm_conv1d" not in name)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's pick of layers that get more bits: the first and last eighth, every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


@dataclass
class _Model:
    n_layer: int
    n_expert: int
    n_attention_wv: int
    tied: bool  # no output.weight: token_embd doubles as the output and is quantized as it
    i_attention_wv: int = 0
    i_ffn_down: int = 0


def _q4_k_m(name: str, shape: tuple[int, ...], m: _Model) -> str:
    cat = _category(name)
    if cat == "output" or (m.tied and cat == "token_embd"):
        return "q8_0" if shape[-1] % FORMATS["q6_k"].block else "q6_k"
    if cat == "attn_v":
        i, m.i_attention_wv = m.i_attention_wv, m.i_attention_wv + 1
        if m.n_expert == 8:
            return "q8_0"
        return "q6_k" if use_more_bits(i, m.n_attention_wv) else "q4_k"
    if cat == "attn_k" and m.n_expert == 8:
        return "q8_0"
    if cat == "ffn_down":
        # with experts, the layer is the one in the name (Mixtral's experts are not in order)
        i, m.i_ffn_down = (_layer(name) if m.n_expert > 1 else m.i_ffn_down), m.i_ffn_down + 1
        return "q6_k" if use_more_bits(i, m.n_layer) else "q4_k"
    if cat == "attn_output" and m.n_expert == 8:
        return "q5_k"
    return "q4_k"


def _q8_0(name: str, shape: tuple[int, ...], m: _Model) -> str:
    return "q8_0"


def _mxfp4_moe(name: str, shape: tuple[int, ...], m: _Model) -> str:
    """Routed experts (3-D, more than one) MXFP4, everything else Q8_0."""
    cat = _category(name)
    if cat == "output" or (m.tied and cat == "token_embd"):
        return "q8_0"
    return "mxfp4" if len(shape) >= 3 and shape[-3] > 1 else "q8_0"


def _uniform(fmt: str) -> Callable[[str, tuple[int, ...], _Model], str]:
    """Every quantizable tensor in `fmt` (llama-quantize's plain type names: Q6_K, Q4_0, ...)."""
    return lambda name, shape, m: fmt


PRESETS: dict[str, Callable[[str, tuple[int, ...], _Model], str]] = {
    "q4_k_m": _q4_k_m, "mxfp4_moe": _mxfp4_moe, "q8_0": _q8_0,
    **{f: _uniform(f) for f in ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "mxfp4")},
}


def preset_formats(
    preset: str, shapes: dict[str, tuple[int, ...]], n_layer: int, n_expert: int
) -> dict[str, str | None]:
    """Each tensor's format under `preset` (None: kept as stored), deciding in llama-quantize's
    order: by layer number, then by name, so its per-layer counters count alike."""
    if preset not in PRESETS:
        raise FormatError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    rule = PRESETS[preset]
    model = _Model(n_layer, n_expert, n_attention_wv=sum(_category(n) == "attn_v" for n in shapes),
                   tied="output.weight" not in shapes)
    out: dict[str, str | None] = {}
    for name in sorted(shapes, key=lambda n: (_layer(n), n)):
        shape = shapes[name]
        if not _quantizable(name, shape):
            out[name] = None
            continue
        fmt = rule(name, shape, model)
        if shape[-1] % FORMATS[fmt].block:
            if fmt not in _FALLBACK:
                raise FormatError(f"{name}: row length {shape[-1]} does not split into {fmt} blocks "
                                  f"of {FORMATS[fmt].block}, and {preset} has no fallback for it")
            fmt = _FALLBACK[fmt]
            if shape[-1] % FORMATS[fmt].block:
                fmt = "float16"
        out[name] = fmt
    return {name: out[name] for name in shapes}


def expert_formats(spec: ModelSpec, preset: str) -> list[tuple[str, str, str]]:
    """Each MoE layer's (gate, up, down) format under `preset`, decided from the layer's GGUF
    expert tensors as llama-quantize decides it (its 256-weight fallbacks included)."""
    e, i, h = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    shapes = {f"blk.{layer}.ffn_{part}_exps.weight": (e, *shape) for layer in spec.moe_layers
              for part, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i)))}
    formats = preset_formats(preset, shapes, spec.num_layers, e)
    return [tuple(formats[f"blk.{layer}.ffn_{part}_exps.weight"] or "bfloat16" for part in ("gate", "up", "down"))
            for layer in spec.moe_layers]
