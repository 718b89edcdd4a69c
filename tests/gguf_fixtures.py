"""Write GGUF files the way llama.cpp's `convert_hf_to_gguf.py` does, for tests.

Reproduces, for Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM and
MixtralForCausalLM, what the converter writes: the metadata keys (TextModel.set_gguf_parameters
plus each model class's additions), the tensor names (gguf.TensorNameMap), the merged 3-D expert
tensors, LlamaModel's Q/K row permutation, and the output type rules of
ModelBase.prepare_tensors. Input: per-expert checkpoints as transformers saves them, one file or
sharded; transformers' stacked expert layout only for the Qwen archs, as in the converter. The
vocabulary is left out; only `tokenizer.ggml.model` is written. Checked byte-for-byte against
the converter vendored in llama-cpp-python 0.3.36 (vocabulary step stubbed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig

from ftkit.kernels.dequant import dequantize
from ftkit.runtime.random_model import demo_spec
from ftkit.vocab import BLOCK_FORMATS, SlotLayout, slot_layout

QT = gguf.GGMLQuantizationType
ARCHS = {
    "Qwen2MoeForCausalLM": gguf.MODEL_ARCH.QWEN2MOE,
    "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
    "OlmoeForCausalLM": gguf.MODEL_ARCH.OLMOE,
    "MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA,
}
OUTTYPES = {  # --outtype: (general.file_type, ggml type of the quantizable tensors)
    "F32": (gguf.LlamaFileType.ALL_F32, QT.F32),
    "F16": (gguf.LlamaFileType.MOSTLY_F16, QT.F16),
    "BF16": (gguf.LlamaFileType.MOSTLY_BF16, QT.BF16),
    "Q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, QT.Q8_0),
}
# prepare_tensors keeps these in F32 whatever the outtype (the list's entries for these archs).
ALWAYS_F32 = (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP)


def write_gguf_from_hf(hf_dir: Path, out: Path, dtype: str) -> None:
    """Convert the HF MoE checkpoint at `hf_dir` to GGUF at `out`, like `--outtype dtype`."""
    hf_dir = Path(hf_dir)
    ftype, qtype = OUTTYPES[dtype]
    hparams = AutoConfig.from_pretrained(hf_dir).to_dict()  # the converter's load_hparams
    hf_arch = (hparams.get("architectures") or [None])[0]
    if hf_arch not in ARCHS:
        raise ValueError(
            f"{hf_dir}: config.json architectures {hf_arch!r} is not one of {list(ARCHS)}"
        )
    arch = ARCHS[hf_arch]
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[arch])

    for name, data, bid in _converted_tensors(hf_dir, hparams, arch):
        t = _output_type(name, data.ndim, arch, bid, qtype)
        try:
            raw = gguf.quants.quantize(data, t)
        except gguf.QuantError:  # e.g. a Q8_0 row length not divisible by 32
            t = QT.F16
            raw = gguf.quants.quantize(data, t)
        writer.add_tensor(name, raw, raw_dtype=t)

    # ModelBase.prepare_metadata: general.type, the model card fields, parameters, quant version.
    writer.add_type(gguf.GGUFType.MODEL)
    total, shared, expert, n_expert = writer.get_total_parameter_count()
    meta = gguf.Metadata.load(None, hf_dir, None, total)
    if meta.name is None:
        meta.name = hf_dir.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, n_expert)
    meta.set_gguf_meta_model(writer)
    _set_parameters(writer, hparams, arch, ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_tokenizer_model("llama" if arch == gguf.MODEL_ARCH.LLAMA else "gpt2")

    writer.write_header_to_file(path=out)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def header_end(path: Path) -> int:
    """Bytes a header-only stub of this GGUF keeps: the header and its padding to the data."""
    return gguf.GGUFReader(path).data_offset  # the reference reader, independent of GGUFSource


def _set_parameters(
    w: gguf.GGUFWriter, hp: dict[str, Any], arch: gguf.MODEL_ARCH, ftype: int
) -> None:
    """TextModel.set_gguf_parameters, then the additions of the arch's model class."""
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    if hp.get("intermediate_size") is not None:  # optional in the converter (Qwen3.5 has none)
        w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)
    if rope.get("rope_type") == "linear" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (
            ("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
            ("attention_factor", w.add_rope_scaling_yarn_attn_factor),
            ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
        ):
            if rope.get(key) is not None:
                add(rope[key])
    theta = rope.get("rope_theta", hp.get("rope_theta"))
    if theta is not None:
        w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_expert_count(hp.get("num_local_experts") or hp["num_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    w.add_file_type(ftype)

    if arch in (gguf.MODEL_ARCH.QWEN2MOE, gguf.MODEL_ARCH.QWEN3MOE):  # Qwen2MoeModel
        if hp.get("moe_intermediate_size") is not None:
            w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        if hp.get("shared_expert_intermediate_size") is not None:
            w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    elif arch == gguf.MODEL_ARCH.OLMOE:  # OlmoeModel overwrites the epsilon with a constant
        w.add_layer_norm_rms_eps(1e-5)
    elif arch == gguf.MODEL_ARCH.LLAMA:  # LlamaModel
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(
            hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
        )


def _hf_tensors(hf_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """ModelBase.index_tensors' order: every model*.safetensors, sorted, each in header order."""
    for part in sorted(hf_dir.glob("model*.safetensors")):
        with safe_open(part, "pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _converted_tensors(
    hf_dir: Path, hp: dict[str, Any], arch: gguf.MODEL_ARCH
) -> Iterator[tuple[str, np.ndarray, int | None]]:
    """(GGUF name, float array, block id) in the converter's order, experts merged per layer."""
    tmap = gguf.get_tensor_name_map(arch, hp["num_hidden_layers"])
    n_expert = hp.get("num_local_experts") or hp["num_experts"]
    llama = arch == gguf.MODEL_ARCH.LLAMA
    qwen = arch in (gguf.MODEL_ARCH.QWEN2MOE, gguf.MODEL_ARCH.QWEN3MOE)
    if llama:  # LlamaModel.modify_tensors
        expert_tag, projs = "block_sparse_moe.experts", ("w1", "w2", "w3")
        per_expert = "model.layers.{bid}.block_sparse_moe.experts.{x}.{w}.weight"
        merged = "layers.{bid}.feed_forward.experts.{w}.weight"
    else:  # Qwen2MoeModel / OlmoeModel.modify_tensors
        expert_tag, projs = "experts", ("down_proj", "gate_proj", "up_proj")
        per_expert = "model.layers.{bid}.mlp.experts.{x}.{w}.weight"
        merged = "model.layers.{bid}.mlp.experts.{w}.weight"
    pending: dict[int | None, dict[str, torch.Tensor]] = {}
    for hf_name, t in _hf_tensors(hf_dir):
        if t.dtype not in (torch.float16, torch.float32):
            t = t.to(torch.float32)
        bid = next((int(p) for p in hf_name.split(".") if p.isdecimal()), None)
        if llama and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            t = llama_permute(t, hp["num_attention_heads"], hp["num_attention_heads"])
        if llama and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            t = llama_permute(t, hp["num_attention_heads"], hp["num_key_value_heads"])
        base = hf_name.removesuffix(".weight")
        if qwen and base.endswith("mlp.experts.gate_up_proj"):
            # transformers' stacked layout [E, 2I, H], gate rows first; only Qwen2MoeModel
            # (and its subclasses) understands it, OLMoE and Mixtral conversions fail on it.
            n_ff = t.shape[-2] // 2
            base = base.removesuffix(".gate_up_proj")
            yield _map(tmap, f"{base}.gate_proj.weight"), t[..., :n_ff, :].contiguous().numpy(), bid
            yield _map(tmap, f"{base}.up_proj.weight"), t[..., n_ff:, :].contiguous().numpy(), bid
            continue
        if qwen and base.endswith("mlp.experts.down_proj"):  # stacked [E, H, I]: as stored
            yield _map(tmap, f"{base}.weight"), t.numpy(), bid
            continue
        if expert_tag not in hf_name:
            yield _map(tmap, hf_name), t.numpy(), bid
            continue
        layer = pending.setdefault(bid, {})
        layer[hf_name] = t
        if len(layer) < n_expert * 3:
            continue
        # All experts of the layer are in: stack each projection to [n_expert, rows, cols].
        for w in projs:
            experts = [layer.pop(per_expert.format(bid=bid, x=x, w=w)) for x in range(n_expert)]
            yield _map(tmap, merged.format(bid=bid, w=w)), torch.stack(experts).numpy(), bid
    if any(pending.values()):
        raise ValueError(f"unprocessed experts: {sorted(k for d in pending.values() for k in d)}")


def llama_permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """LlamaModel.permute: per head, rows [first half | second half] -> interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _map(tmap: gguf.TensorNameMap, hf_name: str) -> str:
    name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"cannot map tensor {hf_name!r}")
    return name


def _output_type(name: str, n_dims: int, arch: gguf.MODEL_ARCH, bid: int | None, qtype: QT) -> QT:
    """ModelBase.prepare_tensors' choice of stored type for one tensor."""
    if n_dims <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return QT.F32
    for key in ALWAYS_F32:
        if (
            key in gguf.MODEL_TENSORS[arch]
            and name == gguf.TENSOR_NAMES[key].format(bid=bid) + ".weight"
        ):
            return QT.F32
    return qtype


# Byte offsets of each block format's fp16 fields (scales, mins) within a block (ggml-common.h);
# mxfp4's one scale byte is an e8m0 exponent, every value of which is valid.
F16_FIELDS = {
    "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
    "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
    "iq4_nl": (0,), "iq4_xs": (0,), "mxfp4": (),
}  # fmt: skip


def random_blocks(fmt: str, shape: tuple[int, ...], rng: np.random.Generator, scale: float = 1e-3) -> np.ndarray:
    """Valid random `fmt` blocks for a tensor of logical `shape` (uint8, GGUF's byte shape):
    random bits everywhere but the scales, which are fp16 of magnitude about `scale` (random
    sign) or, for mxfp4, an exponent within a factor 4 of it. Dequantized, the weights stay
    within a few hundred times `scale`, so a model built from them computes finite logits."""
    fmt_ = gguf.GGMLQuantizationType[fmt.upper()]
    block, nbytes = gguf.GGML_QUANT_SIZES[fmt_]
    raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[fmt]:
        d = (rng.uniform(0.5, 1.5, raw.shape[:-1]) * scale * rng.choice([-1, 1], raw.shape[:-1]))
        raw[..., off : off + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    if fmt == "mxfp4":  # the block's scale is 2**(e - 128), its weights up to 6 times that
        raw[..., 0] = np.round(np.log2(scale) + 127 + rng.integers(-2, 1, raw.shape[:-1]))
    return raw.reshape(*shape[:-1], -1)



def _copy_metadata(reader: Any, writer: Any) -> None:
    """Every metadata key of the GGUF `reader` but the architecture (the writer's own) into `writer`."""
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), field.types[0])


def _rewrite_gguf(src: Path, out: Path, tensor: Callable[[Any], tuple[np.ndarray, QT | None]],
                  **writer_args: Any) -> Path:
    """A copy of the GGUF `src` (same metadata, same tensor order) whose tensors are what
    `tensor(reader_tensor)` makes of each: (data, raw ggml type or None for a float array);
    `writer_args`: more GGUFWriter arguments."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents(), **writer_args)
    _copy_metadata(reader, writer)
    for t in reader.tensors:
        data, raw_dtype = tensor(t)
        writer.add_tensor(t.name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape))


def requantize_gguf(src: Path, out: Path, formats: dict[str, str | None], seed: int = 0) -> Path:
    """The F32 GGUF `src` with each tensor stored in `formats[name]` (None keeps it), as
    llama-quantize rewrites a model (`general.file_type` left alone). Blocks come from ftkit's
    quantizer where it has the format, else they are valid random blocks at the tensor's own
    scale (IQ4_XS, IQ4_NL, Q2_K, Q3_K)."""
    from ftkit.kernels.quantize import QUANTIZERS, quantize

    def random_like(fmt: str, data: np.ndarray, seed: int) -> np.ndarray:
        # the scales of random blocks at 1e-3, then at what gives them the tensor's RMS
        probe = gguf.quants.dequantize(random_blocks(fmt, data.shape, np.random.default_rng(seed)), QT[fmt.upper()])
        scale = 1e-3 * np.sqrt(np.mean(data.astype(np.float64) ** 2) / np.mean(probe.astype(np.float64) ** 2))
        return random_blocks(fmt, data.shape, np.random.default_rng(seed), float(scale))

    def tensor(t: Any) -> tuple[np.ndarray, QT | None]:
        data = np.array(t.data).reshape(_shape(t))
        fmt = formats.get(t.name)
        if fmt is None:
            return data, None
        if fmt == "float16":
            return data.astype(np.float16), None
        if fmt in QUANTIZERS:
            return quantize(torch.from_numpy(data.astype(np.float32)), fmt).numpy(), QT[fmt.upper()]
        return random_like(fmt, data, seed + len(t.name)), QT[fmt.upper()]

    return _rewrite_gguf(src, out, tensor)


def fused_gate_up_gguf(src: Path, out: Path) -> Path:
    """The GGUF `src` as `convert_hf_to_gguf.py --fuse_gate_up_exps` writes it (llama.cpp PR
    19139): each layer's `ffn_gate_exps` and `ffn_up_exps` (weights, and biases where there are
    any) one `ffn_gate_up_exps` tensor, gate's rows first, in the gate tensor's place and type."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    _copy_metadata(reader, writer)
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if ".ffn_up_exps." in t.name:
            continue
        if ".ffn_gate_exps." not in t.name:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        up = tensors[t.name.replace(".ffn_gate_exps.", ".ffn_up_exps.")]
        assert up.tensor_type == t.tensor_type, "the converter fuses parts of one type"
        # rows along the second axis (the data's bytes, or floats, per row last)
        fused = np.concatenate([np.array(t.data), np.array(up.data)], axis=1)
        writer.add_tensor(t.name.replace(".ffn_gate_exps.", ".ffn_gate_up_exps."), fused, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def split_gguf(src: Path, out: Path, max_tensors: int) -> list[Path]:
    """The GGUF `src` split as `llama-gguf-split --split-max-tensors` and the converter's
    `--split-max-tensors` write it (the gguf package's writer): OUT-00001-of-0000n.gguf and on,
    the model's metadata in the first, `split.*` in each; the files, in order."""
    _rewrite_gguf(src, out, lambda t: (np.array(t.data), t.tensor_type), split_max_tensors=max_tensors)
    return sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))


def dequantized_gguf(src: Path, out: Path) -> Path:
    """The GGUF `src` with every tensor float32, dequantized by the gguf package: the same model
    as the quantized file, in the form ftkit has always read."""
    return _rewrite_gguf(
        src, out, lambda t: (gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(_shape(t)), None)
    )


def block_slots(formats: tuple[str, str, str], n: int, seed: int, hidden: int = 512, inter: int = 256,
                **fields: object) -> tuple[
        SlotLayout, list[torch.Tensor], SlotLayout, list[torch.Tensor]]:
    """`n` expert slots with parts in `formats` (quantized random weights, or valid random blocks
    where ftkit has no quantizer), and the same experts dequantized into float32 slots, of
    `hidden` x `inter` experts (multiples of 256 for the K-quants); `fields`:
    more ModelSpec fields (gpt-oss's float32 biases and clamped SwiGLU)."""
    from ftkit.kernels.quantize import QUANTIZERS, quantize

    spec = dataclasses.replace(demo_spec(64), hidden_size=hidden, moe_intermediate_size=inter, **fields)
    layout, f32 = slot_layout(spec, formats), slot_layout(spec, "float32")
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    slots, floats = [], []
    for _ in range(n):
        slot, fslot = torch.zeros(layout.slot_bytes, dtype=torch.uint8), torch.zeros(f32.slot_bytes, dtype=torch.uint8)
        for p, fp in zip(layout.parts, f32.parts, strict=True):
            w = torch.randn(p.shape, generator=gen) * (p.shape[1] ** -0.5 if len(p.shape) == 2 else 0.5)
            if p.dtype not in BLOCK_FORMATS:
                raw = w.to(getattr(torch, p.dtype)).view(torch.uint8)
            elif p.dtype in QUANTIZERS:
                raw = quantize(w, p.dtype)
            else:
                raw = torch.from_numpy(random_blocks(p.dtype, p.shape, rng, scale=0.5 / p.shape[1]))
            slot[p.offset : p.offset + p.nbytes] = raw.reshape(-1)
            value = dequantize(raw, p.dtype) if p.dtype in BLOCK_FORMATS else raw.view(getattr(torch, p.dtype)).float()
            fslot[fp.offset : fp.offset + fp.nbytes] = value.reshape(-1).view(torch.uint8)
        slots.append(slot)
        floats.append(fslot)
    return layout, slots, f32, floats
