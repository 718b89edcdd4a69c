"""Random-weight FTW written straight from a ModelSpec: the built-in demo model and benchmarks.

One tensor (or one expert slot) is generated at a time, so the shapes can be realistic. The same
kind of model can be written as an HF directory or a GGUF file too (small shapes: the weights
are held at once), the input of the pipeline's first step without a download.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from ftkit import __version__
from ftkit.kernels.quantize import quantize
from ftkit.vocab import BLOCK_FORMATS, expert_layout, storage_dtype

from .checkpoint.quant_presets import preset_formats
from .ftw.manifest import DENSE_FILE, MANIFEST, Manifest, write_json_atomic
from .ftw.writer import BankWriter, DenseWriter, atomic_dir, rows_per_bank, sha256_file
from .models import FAMILIES
from .spec import FULL_ATTENTION, QK_NORM_HEAD, ModelSpec


def demo_spec(vocab_size: int) -> ModelSpec:
    """The built-in model: a small Qwen3-MoE (4 layers, 16 experts, top-4)."""
    return ModelSpec(
        family="qwen3_moe", architecture="Qwen3MoeForCausalLM", vocab_size=vocab_size,
        hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16,
        intermediate_size=256, moe_intermediate_size=128, num_experts=16, top_k=4,
        moe_layers=(0, 1, 2, 3), layer_kinds=(FULL_ATTENTION,) * 4, norm_topk_prob=True,
        qk_norm=QK_NORM_HEAD, max_position_embeddings=2048,
    )


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return 1 + 0.1 * torch.randn(shape, generator=gen)
    std = 0.5 if name.endswith("router.weight") else shape[-1] ** -0.5
    return std * torch.randn(shape, generator=gen)


def _stored(w: torch.Tensor, fmt: str) -> torch.Tensor:
    return quantize(w, fmt) if fmt in BLOCK_FORMATS else w.to(storage_dtype(fmt))


def write_random_ftw(
    out: Path,
    spec: ModelSpec,
    dtype: str = "float32",
    seed: int = 0,
    side_files: Callable[[Path], None] | None = None,
    force: bool = False,
    distinct_experts: int | None = None,
    on_bytes: Callable[[int], None] = lambda n: None,
    expert_formats: list[tuple[str, str, str]] | None = None,
    dense_formats: dict[str, str] | None = None,
) -> Manifest:
    """Write a random-weight FTW for `spec`; `side_files(dir)` may add a tokenizer and such.
    `expert_formats`: each MoE layer's gate, up and down format (default: all `dtype`); random
    float weights quantized into GGUF blocks where a part is in one (kernels/quantize.py).
    `dense_formats`: dense tensors stored in another format than `dtype` (GGUF blocks: FTW v3).

    `distinct_experts=N` draws only N random experts and cycles them over the rows: speed does
    not depend on expert values (routing depends on the router alone), and drawing tens of GB
    of random numbers would dominate writing a benchmark model.
    """
    gen = torch.Generator().manual_seed(seed)
    tdt = storage_dtype(dtype)
    shapes = FAMILIES[spec.family].dense_shapes(spec)
    layout = expert_layout(spec, expert_formats or dtype)
    with atomic_dir(out, force) as tmp:
        formats = {n: (dense_formats or {}).get(n, dtype) for n in shapes}
        dense = DenseWriter(tmp / DENSE_FILE, [(n, formats[n], s) for n, s in shapes.items()])
        for name, shape in shapes.items():
            w = _random(name, shape, gen)
            dense.write(name, w.to(tdt) if formats[name] == dtype else _stored(w, formats[name]))
        dense_sha = dense.close()
        banks = BankWriter(tmp, layout, spec.num_expert_rows, rows_per_bank(layout.slot_bytes, spec.num_experts, 4 << 30))
        cycle: dict[int, list[dict[str, torch.Tensor]]] = {}  # per MoE layer: its layout's
        for row in range(spec.num_expert_rows):
            drawn = cycle.setdefault(row // spec.num_experts if expert_formats else 0, [])
            if distinct_experts is None or len(drawn) < distinct_experts:
                parts = {p.name: _stored(_random(p.name, p.shape, gen), p.dtype) for p in layout.for_row(row).parts}
                if distinct_experts is not None:
                    drawn.append(parts)
            else:
                parts = drawn[row % distinct_experts]
            banks.write_slot(row, parts)
            on_bytes(layout.slot_bytes)
        files = {}
        if side_files:
            side_files(tmp)
            files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())
                     if p.is_file() and p.name != DENSE_FILE and p.suffix != ".ftwb"}
        manifest = Manifest(
            spec=spec, layout=layout, banks=banks.close(),
            dense={"file": DENSE_FILE, "sha256": dense_sha,
                   "tensors": {n: {"dtype": formats[n], "shape": list(s)} for n, s in shapes.items()}},
            files=files, writer=f"ftkit {__version__}", source={"kind": "random", "seed": seed},
        )
        write_json_atomic(tmp / MANIFEST, manifest.to_dict())
    return manifest


# ---- the same model as a checkpoint to convert: an HF directory, a GGUF file ------------------
# Canonical names -> the names each source format stores them under, for the Llama-style families
# (the reverse of models/base.py's HF_RULES and GGUF_RULES).
_HF_NAMES = [(r"embed\.weight", "model.embed_tokens.weight"), (r"final_norm\.weight", "model.norm.weight"),
             (r"lm_head\.weight", "lm_head.weight"),
             (r"layers\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
             (r"layers\.(\d+)\.mlp_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
             (r"layers\.(\d+)\.attn\.([qkvo])\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
             (r"layers\.(\d+)\.attn\.([qk])_norm\.weight", r"model.layers.\1.self_attn.\2_norm.weight"),
             (r"layers\.(\d+)\.router\.weight", r"model.layers.\1.mlp.gate.weight")]
_GGUF_NAMES = [(r"embed\.weight", "token_embd.weight"), (r"final_norm\.weight", "output_norm.weight"),
               (r"lm_head\.weight", "output.weight"), (r"layers\.(\d+)\.attn_norm\.weight", r"blk.\1.attn_norm.weight"),
               (r"layers\.(\d+)\.mlp_norm\.weight", r"blk.\1.ffn_norm.weight"),
               (r"layers\.(\d+)\.attn\.o\.weight", r"blk.\1.attn_output.weight"),
               (r"layers\.(\d+)\.attn\.([qkv])\.weight", r"blk.\1.attn_\2.weight"),
               (r"layers\.(\d+)\.attn\.([qk])_norm\.weight", r"blk.\1.attn_\2_norm.weight"),
               (r"layers\.(\d+)\.router\.weight", r"blk.\1.ffn_gate_inp.weight")]
SOURCE_FAMILIES = ("qwen3_moe",)  # the families these writers lay out (the demo's)


def _source_name(name: str, table: list[tuple[str, str]]) -> str:
    for pattern, template in table:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, template, name)
    raise ValueError(f"no stored name for {name}")


def preset_dense_formats(spec: ModelSpec, preset: str) -> dict[str, str]:
    """The dense tensors `llama-quantize <preset>` stores in GGUF blocks, by canonical name, for
    the families these writers lay out (their GGUF names decide, as in llama-quant.cpp); {} for
    the others, whose dense tensors stay floats."""
    if spec.family not in SOURCE_FAMILIES:
        return {}
    shapes = FAMILIES[spec.family].dense_shapes(spec)
    names = {n: _source_name(n, _GGUF_NAMES) for n in shapes}  # norms and routers: None (kept)
    formats = preset_formats(preset, {g: shapes[n] for n, g in names.items()}, spec.num_layers, spec.num_experts)
    return {n: formats[g] for n, g in names.items() if formats[g] in BLOCK_FORMATS}


def _weights(spec: ModelSpec, seed: int, distinct: int | None = None
             ) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """Random float32 weights of `spec`: dense by canonical name, experts per MoE layer stacked
    by part ([E, I, H] gate and up, [E, H, I] down); `distinct`: that many random experts a part
    and layer, cycled (a quick write at a large shape)."""
    if spec.family not in SOURCE_FAMILIES:
        raise ValueError(f"HF and GGUF demo checkpoints are written for {', '.join(SOURCE_FAMILIES)}, "
                         f"not {spec.family}")
    gen = torch.Generator().manual_seed(seed)
    dense = {n: _random(n, s, gen) for n, s in FAMILIES[spec.family].dense_shapes(spec).items()}
    h, i = spec.hidden_size, spec.moe_intermediate_size
    shapes = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    drawn = min(distinct or spec.num_experts, spec.num_experts)
    experts = {layer: {part: torch.stack([_random(part, shape, gen) for _ in range(drawn)])
                       for part, shape in shapes.items()} for layer in spec.moe_layers}
    if drawn < spec.num_experts:
        index = torch.arange(spec.num_experts) % drawn
        experts = {layer: {part: t[index] for part, t in parts.items()} for layer, parts in experts.items()}
    return dense, experts


def hf_config(spec: ModelSpec) -> dict:
    """config.json of `spec` as transformers writes a Qwen3-MoE's."""
    return {"architectures": [spec.architecture], "model_type": spec.family, "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
            "moe_intermediate_size": spec.moe_intermediate_size, "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "num_experts": spec.num_experts, "num_experts_per_tok": spec.top_k,
            "norm_topk_prob": spec.norm_topk_prob, "max_position_embeddings": spec.max_position_embeddings,
            "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta,
            "tie_word_embeddings": spec.tie_word_embeddings, "decoder_sparse_step": 1,
            "mlp_only_layers": [n for n in range(spec.num_layers) if n not in spec.moe_layers],
            "torch_dtype": "float32"}


def write_random_hf(out: Path, spec: ModelSpec, seed: int = 0, side_files: Callable[[Path], None] | None = None,
                    force: bool = False) -> Path:
    """`spec`'s random weights as an HF model directory (config.json, model.safetensors with
    per-expert tensors, `side_files` such as a tokenizer): an input for ftw-convert and
    ft-diagnose without a download. Written to a temporary sibling, renamed at the end."""
    from safetensors.torch import save_file

    dense, experts = _weights(spec, seed)
    tensors = {_source_name(n, _HF_NAMES): t for n, t in dense.items()}
    for layer, parts in experts.items():
        for part, stacked in parts.items():
            for e in range(spec.num_experts):
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight"] = stacked[e].contiguous()
    with atomic_dir(out, force) as tmp:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        write_json_atomic(tmp / "config.json", hf_config(spec))
        if side_files:
            side_files(tmp)
    return out


def spm_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary of `size` tokens as GGUF stores one (tokens, scores, types):
    <unk>, <s>, </s>, the 256 byte tokens `<0xNN>` a SentencePiece tokenizer falls back to, then
    distinct word pieces. What llama.cpp needs to load a generated model's file (its tools
    tokenize and sample through it); the pieces mean nothing."""
    if size < 260:
        raise ValueError(f"a SentencePiece vocabulary of {size} tokens has no room for its byte tokens")
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3] + [6] * 256  # llama.cpp's UNKNOWN, CONTROL, BYTE
    pieces = size - len(tokens)
    tokens += [f"\u2581t{i}" for i in range(pieces)]
    return tokens, [0.0] * 259 + [-float(i) for i in range(pieces)], types + [1] * pieces


def write_random_gguf(out: Path, spec: ModelSpec, seed: int = 0, force: bool = False, dtype: str = "float32",
                      vocab: bool = False, distinct_experts: int | None = None) -> Path:
    """`spec`'s random weights (the same as write_random_hf's for a seed) as a GGUF file laid out
    as llama.cpp's converter writes the family (stacked `ffn_*_exps` experts), its tensors
    float32 or bfloat16 (`dtype`; norms and routers stay float32, as the converter keeps them); with `vocab`,
    a generated SentencePiece vocabulary of the spec's size (`spm_vocab`), which llama.cpp's
    tools need to load a file; written to a temporary sibling, renamed at the end."""
    import gguf

    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"a random GGUF is written in float32 or bfloat16, not {dtype}")
    dense, experts = _weights(spec, seed, distinct_experts)
    arch = FAMILIES[spec.family].gguf_archs[0]
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch)
    for key, value in (("block_count", spec.num_layers), ("context_length", spec.max_position_embeddings),
                       ("embedding_length", spec.hidden_size), ("feed_forward_length", spec.intermediate_size),
                       ("attention.head_count", spec.num_heads), ("attention.head_count_kv", spec.num_kv_heads),
                       ("attention.key_length", spec.head_dim), ("attention.value_length", spec.head_dim),
                       ("expert_count", spec.num_experts), ("expert_used_count", spec.top_k),
                       ("expert_feed_forward_length", spec.moe_intermediate_size)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", spec.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", spec.rope_theta)
    if vocab:
        tokens, scores, types = spm_vocab(spec.vocab_size)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)

    def add(name: str, t: torch.Tensor) -> None:
        if dtype == "bfloat16" and t.dim() > 1 and "ffn_gate_inp" not in name:  # (the converter keeps
            # norms and routers float32); numpy has no bfloat16: its bytes, typed BF16
            w.add_tensor(name, t.to(torch.bfloat16).view(torch.uint8).numpy(),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(name, t.numpy())

    for name, t in dense.items():
        add(_source_name(name, _GGUF_NAMES), t)
    for layer, parts in experts.items():
        for part, stacked in parts.items():
            add(f"blk.{layer}.ffn_{part}_exps.weight", stacked)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
