"""Tiny random-weight Hugging Face MoE checkpoints, and damaged copies of them.

Every checkpoint is generated: a tiny config, a model built by transformers, weights drawn
with a visible scale, and the tokenizer from `ftkit.runtime.synthetic`. The reference model
for any checkpoint is transformers itself (`load_reference`).

Damage builders copy a good checkpoint dir `src` to `out` and break exactly one thing there;
the damaged file is the first `*.safetensors` in sorted order unless a builder says otherwise.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PreTrainedConfig,
    PreTrainedModel,
)

from ftkit.runtime.synthetic import SPECIAL_TOKENS, write_tokenizer

# Shared by every family; per-family entries override or extend it.
_COMMON: dict[str, Any] = {
    "vocab_size": 320,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": SPECIAL_TOKENS["<|endoftext|>"],
    "eos_token_id": SPECIAL_TOKENS["<|im_end|>"],
    "pad_token_id": SPECIAL_TOKENS["<|endoftext|>"],
}

# Checkpoint name -> kwargs for `AutoConfig.for_model`, with the HF `model_type` included.
# Expert-count keys differ by family (transformers' own names); FFN widths: experts 32, dense 96.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        **_COMMON,
        "model_type": "qwen3_moe",
        "head_dim": 16,
        "num_experts": 8,
        "moe_intermediate_size": 32,
        "intermediate_size": 96,
        "norm_topk_prob": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    "mixtral": {
        **_COMMON,
        "model_type": "mixtral",
        "head_dim": 16,
        "num_local_experts": 8,
        "intermediate_size": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    "olmoe": {
        **_COMMON,
        "model_type": "olmoe",
        "num_experts": 8,
        "intermediate_size": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    "qwen2_moe": {
        **_COMMON,
        "model_type": "qwen2_moe",
        "num_experts": 8,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "intermediate_size": 96,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
}
# Qwen3-Next: three gated-DeltaNet layers then one gated full-attention layer (the config's
# default pattern, full_attention_interval 4); two key heads serve four value heads.
TINY_CONFIGS["qwen3_next"] = {
    **_COMMON,
    "model_type": "qwen3_next",
    "num_hidden_layers": 4,
    "head_dim": 16,
    "num_experts": 8,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "intermediate_size": 96,
    "norm_topk_prob": True,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
}
# Layers 0 and 2 are dense by decoder_sparse_step, layer 3 by mlp_only_layers; only 1 is MoE.
TINY_CONFIGS["qwen3_moe_sparse"] = {
    **TINY_CONFIGS["qwen3_moe"],
    "num_hidden_layers": 4,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
}
# YaRN as Qwen3 ships it for long context: 4x over an original window of 128 positions.
TINY_CONFIGS["qwen3_moe_rope"] = {
    **TINY_CONFIGS["qwen3_moe"],
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 1_000_000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
}

# gpt-oss: a sliding layer (window 4, shorter than the test prompts) then a full one; YaRN as it
# ships (not truncated), 8x over 64 positions; a swiglu_limit low enough that the clamps bite.
TINY_CONFIGS["gpt_oss"] = {
    **_COMMON,
    "model_type": "gpt_oss",
    "head_dim": 16,
    "num_local_experts": 8,
    "intermediate_size": 32,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"],
    "swiglu_limit": 1.0,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 8.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
}

# Qwen3.5-MoE as it ships: the multimodal wrapper, the language model under text_config (Qwen3-Next's
# tiny shapes, mrope sections of a 4-wide rotary half) and a one-block vision tower we skip.
_Q35_TEXT = {k: v for k, v in TINY_CONFIGS["qwen3_next"].items()
             if k not in ("model_type", "intermediate_size", "norm_topk_prob")}
TINY_CONFIGS["qwen3_5_moe"] = {
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {**_Q35_TEXT, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0], "mrope_interleaved": True}},
    "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                      "out_hidden_size": 64, "patch_size": 4, "num_position_embeddings": 16},
}
# and its text-only form (Qwen3_5MoeForCausalLM), config flat
TINY_CONFIGS["qwen3_5_moe_text"] = {**TINY_CONFIGS["qwen3_5_moe"]["text_config"], "model_type": "qwen3_5_moe_text"}
# Other shapes: four value heads per key head (8 of 8 wide), attention every other layer, and the
# embeddings tied by the wrapper's flag (its text_config says untied: transformers reads the wrapper's).
TINY_CONFIGS["qwen3_5_moe_tied"] = {
    **TINY_CONFIGS["qwen3_5_moe"],
    "tie_word_embeddings": True,
    "text_config": {**TINY_CONFIGS["qwen3_5_moe"]["text_config"], "linear_num_value_heads": 8,
                    "linear_value_head_dim": 8, "layer_types": ["linear_attention", "full_attention"] * 2},
}
# Checkpoints whose model is the multimodal one (AutoModelForImageTextToText), run on text alone.
MULTIMODAL = frozenset({"qwen3_5_moe", "qwen3_5_moe_tied"})

# Families whose save_pretrained writes the experts stacked (transformers has no per-expert names
# for them).
STACKED_ON_DISK = frozenset({"gpt_oss"})

# Rows of 256 for the K-quants and IQ4_XS (their blocks are 256 weights): hidden, expert and
# dense FFN widths 256, four experts (llama-quantize special-cases models of exactly eight).
_WIDE = {"hidden_size": 256, "head_dim": 64, "intermediate_size": 256}
TINY_CONFIGS["qwen3_moe_wide"] = {**TINY_CONFIGS["qwen3_moe"], **_WIDE, "num_experts": 4, "moe_intermediate_size": 256}
TINY_CONFIGS["mixtral_wide"] = {**TINY_CONFIGS["mixtral"], **_WIDE, "num_local_experts": 4}


def tiny_config(name: str, config: dict[str, Any] | None = None) -> PreTrainedConfig:
    """The transformers config for TINY_CONFIGS[name], or for `config` (with its model_type)."""
    kw = dict(TINY_CONFIGS[name] if config is None else config)
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def _init_weights(model: PreTrainedModel, seed: int) -> None:
    """Redraw every parameter with a scale that makes routing and logits non-degenerate.

    transformers' init (std 0.02, routers near zero) gives near-uniform router scores and
    near-flat logits, which would hide routing and numerics bugs in comparisons.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            value = 1.0 + 0.1 * noise
        elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # the router: spread scores, clear top-k
            value = 0.5 * noise
        elif name.endswith("self_attn.sinks"):  # gpt-oss: sinks that take a real share of the softmax
            value = noise
        elif "embed_tokens" in name:
            value = noise
        elif "lm_head" in name:  # logit margins that survive bf16 noise in greedy comparisons
            value = 0.3 * noise
        else:
            value = 0.1 * noise
        with torch.no_grad():
            p.copy_(value.to(p.dtype))


def _save_stacked(model: PreTrainedModel, out: Path, max_shard_size: int | None) -> None:
    """Write the in-memory (stacked-expert) state dict under its own names, HF's file layout."""
    state, seen = {}, set()
    for k, v in model.state_dict().items():
        if v.data_ptr() not in seen:  # a tied tensor once, under its first name, as save_pretrained keeps it
            seen.add(v.data_ptr())
            state[k] = v.contiguous()
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size or 2**40
    )
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, out / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)


def make_hf_checkpoint(
    name: str,
    out: Path,
    *,
    sharded: bool = False,
    stacked: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    config: dict[str, Any] | None = None,
) -> Path:
    """Build the tiny checkpoint `name` (or family `name` at `config` instead of its tiny one)
    into `out` and return `out`.

    Default files are what `save_pretrained` writes: experts one tensor per expert and
    projection. `stacked` writes transformers' in-memory names instead (`mlp.experts.gate_up_proj`
    [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]). `sharded` splits the
    weights into at least 4 files plus `model.safetensors.index.json`.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    auto = AutoModelForImageTextToText if name in MULTIMODAL else AutoModelForCausalLM
    model = auto.from_config(tiny_config(name, config), dtype=dtype, attn_implementation="eager")
    _init_weights(model, seed)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # A quarter of the total forces at least four shards, even with greedy packing.
    max_shard_size = total // 4 if sharded else None
    if stacked:
        _save_stacked(model, out, max_shard_size)
    elif sharded:
        model.save_pretrained(out, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(out)
    write_tokenizer(out, model.config.get_text_config().vocab_size)
    return out


def load_reference(path: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The ground-truth model for a checkpoint dir: transformers' eager implementation.

    Experts too run eagerly (a plain per-expert loop); transformers 5 would otherwise pick
    `grouped_mm`, whose results depend on tensor layout at the ulp level.
    """
    multimodal = "vision_config" in json.loads((Path(path) / "config.json").read_text())
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    return auto.from_pretrained(path, attn_implementation="eager", experts_implementation="eager", dtype=dtype).eval()


def interpreter_starts_with_torch() -> bool:
    """Whether a bare `python -c` here has torch loaded already (a site hook on some images, as the
    GPU machine's): there a "no torch on the header path" check cannot tell anything."""
    code = "import sys; print('torch' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.strip() == "True"


def skip_unless_header_path_can_be_torch_free() -> None:
    """Skip a "no torch on the header path" check where it cannot hold: an interpreter that starts
    with torch, or a machine with an NVIDIA driver, where the memory plan asks torch whether a
    prefill runs flash attention (tools/diagnose/report.py's cuda_flash)."""
    if sys.platform.startswith("linux") and Path("/proc/driver/nvidia").exists():
        pytest.skip("an NVIDIA driver is present: the memory plan asks torch about flash attention")
    if interpreter_starts_with_torch():
        pytest.skip("this interpreter's site imports torch before any code of ours")


def greedy_steps(rt: Any, prompt: torch.Tensor, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill, then one token at a time through a runtime's step: (tokens, each step's logits)."""
    kv = rt.new_kv(len(prompt) + n)
    tokens, logits = [], []
    with torch.inference_mode():
        step = rt.step.forward(prompt, kv)[-1]
        for _ in range(n):
            logits.append(step)
            tokens.append(int(step.argmax()))
            step = rt.step.forward(torch.tensor(tokens[-1:]), kv)[-1]
    return tokens, logits


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def assert_prefix_resumes_bitwise(ftw: Path, appended: bool = False) -> None:
    """A second prompt sharing 40 tokens with a first resumes from the prefix cache and generates
    what a cold prefill of it does, logits bitwise (cpu strategy). `appended`: the second is the
    whole first and 9 tokens more, as an agent's next turn (a family that resumes only from
    anchors, such as sliding windows, has one at the first's tail)."""
    from ftkit.runtime.engine.generate import generate
    from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
    from ftkit.runtime.engine.sampling import SamplingParams

    def run(rt: Runtime, ids: list[int]):
        seen, real = [], rt.step.forward

        def record(x, kv, **kwargs):
            out = real(x, kv, **kwargs)
            seen.append(out[-1].clone())
            return out

        rt.step.forward = record
        out = generate(rt, ids, SamplingParams(max_tokens=4, ignore_eos=True))
        del rt.step.forward
        return out, torch.stack(seen[-4:])

    gen = torch.Generator().manual_seed(6)
    first = torch.randint(0, 256, (48,), generator=gen).tolist()
    second = first[: 48 if appended else 40] + torch.randint(0, 256, (9,), generator=gen).tolist()
    cached = Runtime(ftw, RuntimeOptions(strategy="cpu", threads=1, prefix_cache_tokens=4096))
    plain = Runtime(ftw, RuntimeOptions(strategy="cpu", threads=1, prefix_cache=False))
    run(cached, first)
    (got, got_logits), (want, want_logits) = run(cached, second), run(plain, second)
    assert got.cached_tokens >= 32 and want.cached_tokens == 0
    assert got.token_ids == want.token_ids and torch.equal(got_logits, want_logits)
    cached.close()
    plain.close()


# --- safetensors byte-level helpers ---------------------------------------------------------


def read_safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """The declared header length and the parsed JSON header of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def _write_with_header(path: Path, header: dict[str, Any], data: bytes) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads headers to 8-byte alignment with spaces
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _copy(src: Path, out: Path) -> Path:
    shutil.copytree(src, out)
    return out


def first_shard(ckpt: Path) -> Path:
    """The file a damage builder breaks unless it says otherwise."""
    return sorted(ckpt.glob("*.safetensors"))[0]


def _find_tensor(ckpt: Path, name_substring: str) -> tuple[Path, str]:
    """The first tensor (sorted by file, then name) whose name contains `name_substring`."""
    for path in sorted(ckpt.glob("*.safetensors")):
        names = sorted(k for k in read_safetensors_header(path)[1] if k != "__metadata__")
        match = next((k for k in names if name_substring in k), None)
        if match:
            return path, match
    raise KeyError(f"no tensor name contains {name_substring!r} in {ckpt}")


def _rewrite(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, path, metadata=metadata)


# --- damage builders ------------------------------------------------------------------------


def truncate_safetensors(src: Path, out: Path) -> Path:
    """The first shard loses the second half of its data section."""
    path = first_shard(_copy(src, out))
    n, _ = read_safetensors_header(path)
    data_len = path.stat().st_size - 8 - n
    with open(path, "r+b") as f:
        f.truncate(8 + n + data_len // 2)
    return out


def offsets_past_end(src: Path, out: Path) -> Path:
    """The last tensor of the first shard is moved 64 bytes past the end of the file.

    Its byte count still matches its shape, so only the bounds are wrong.
    """
    path = first_shard(_copy(src, out))
    n, header = read_safetensors_header(path)
    data = path.read_bytes()[8 + n :]
    last = max(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1]
    )
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + 64, end + 64]
    _write_with_header(path, header, data)
    return out


def header_not_json(src: Path, out: Path) -> Path:
    """The first shard's header bytes are replaced by text that is not JSON (same length)."""
    path = first_shard(_copy(src, out))
    n, _ = read_safetensors_header(path)
    blob = path.read_bytes()
    garbage = b"this is not json " * (n // 17 + 1)
    path.write_bytes(blob[:8] + garbage[:n] + blob[8 + n :])
    return out


def bad_header_length(src: Path, out: Path) -> Path:
    """The first shard's 8-byte header length claims more bytes than the whole file."""
    path = first_shard(_copy(src, out))
    blob = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(blob) + 1000) + blob[8:])
    return out


def missing_shard(src: Path, out: Path) -> Path:
    """A sharded checkpoint loses the second shard named in its index."""
    _copy(src, out)
    index = out / "model.safetensors.index.json"
    if not index.exists():
        raise ValueError(f"{src} is not sharded")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    (out / shards[1]).unlink()
    return out


def config_without_expert_count(src: Path, out: Path) -> Path:
    """config.json loses its expert count and top-k, under whichever names it uses."""
    _copy(src, out)
    cfg = json.loads((out / "config.json").read_text())
    for key in ("num_experts", "num_local_experts", "num_experts_per_tok"):
        cfg.pop(key, None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def unknown_architecture(src: Path, out: Path) -> Path:
    _copy(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(architectures=["FooBarForCausalLM"], model_type="foobar")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def missing_tensor(src: Path, out: Path, name_substring: str) -> Path:
    """The first tensor whose name contains `name_substring` is gone from its file and index."""
    _copy(src, out)
    path, name = _find_tensor(out, name_substring)
    _rewrite(path, lambda tensors: tensors.pop(name))
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        del data["weight_map"][name]
        index.write_text(json.dumps(data, indent=2) + "\n")
    return out


def wrong_shape(src: Path, out: Path, name_substring: str) -> Path:
    """The first tensor whose name contains `name_substring` loses its last column."""
    _copy(src, out)
    path, name = _find_tensor(out, name_substring)

    def drop_last_column(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][..., :-1].contiguous()

    _rewrite(path, drop_last_column)
    return out


# --- header-only stubs ----------------------------------------------------------------------


def _safetensors_header_end(path: Path) -> int:
    return 8 + read_safetensors_header(path)[0]


# File suffix -> bytes to keep (the header). GGUF stubs come from tests/gguf_fixtures.py and
# belong here as ".gguf" once that module offers a header-end function.
_HEADER_END: dict[str, Callable[[Path], int]] = {".safetensors": _safetensors_header_end}


def header_only_stub(src_dir: Path, out: Path) -> Path:
    """Copy `src_dir` with every weight file cut right after its header; the rest as-is."""
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(Path(src_dir).rglob("*")):
        dest = out / path.relative_to(src_dir)
        if path.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        header_end = _HEADER_END.get(path.suffix)
        if header_end is None:
            shutil.copy2(path, dest)
        else:
            with open(path, "rb") as f:
                dest.write_bytes(f.read(header_end(path)))
    return out


def assert_converted_bitwise(src: dict[str, torch.Tensor], ftw: Path, family: str) -> None:
    """Every tensor of an HF checkpoint (`src`, by HF name) is in the FTW `ftw`, bitwise."""
    from ftkit.runtime.ftw.reader import FTWModel
    from ftkit.runtime.models import FAMILIES

    m, fam = FTWModel(ftw), FAMILIES[family]
    dense, spec = m.dense_state(), m.spec
    assert set(dense) == set(fam.dense_shapes(spec))
    banks = m.read_banks(pin=False)
    for name, t in src.items():
        mapped = fam.map_name(name, gguf=False)
        if mapped.canonical:
            assert torch.equal(dense[mapped.canonical].reshape(t.shape), t), name
        else:
            row = spec.moe_index(mapped.layer) * spec.num_experts + mapped.expert
            assert torch.equal(banks.parts(row)[mapped.part], t), name
