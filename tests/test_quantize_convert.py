"""`ftw-convert --quantize`: float experts written as GGUF blocks while converting.

The blocks are checked three ways: the native quantizer (kernels/cpu/quantize.cpp) writes the
torch quantizers' bytes; what a converted slot holds reads back through the gguf package's own
dequantizer to ours, bit for bit; and the quantized model decodes the greedy tokens of its twin
whose experts are those dequantized values in float32.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_quant_formats import weights

from ftkit.kernels.dequant import dequantize
from ftkit.kernels.quantize import NATIVE_CODES, QUANTIZERS, _native, quantize, quantize_native
from ftkit.runtime.checkpoint import CheckpointError
from ftkit.runtime.checkpoint.quant_presets import expert_formats
from ftkit.runtime.engine.generate import generate
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.sampling import SamplingParams
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.tools.convert.pipeline import convert, prepare
from ftkit.vocab import FORMATS

QT = gguf.GGMLQuantizationType
native = pytest.mark.skipif(_native() is None, reason="no C++ compiler for the native quantizer")


@native
@pytest.mark.parametrize("fmt", list(NATIVE_CODES))
def test_the_native_quantizer_writes_the_torch_quantizers_bytes(fmt):
    """Gaussian rows from 1e-4 to 10, zero, constant, one-signed and outlier rows, half-precision
    subnormal and near-overflow scales, and every power of two as a block's largest value."""
    x = weights(np.random.default_rng(5), rows=40, cols=2048)
    x[7] *= np.float32(1e-30)
    x[8] = np.float32(6e4) * np.tanh(x[8])
    powers = np.zeros((200, 256), np.float32)
    powers[:, 0] = 2.0 ** np.arange(-100, 100, dtype=np.float32)
    for rows in (x, powers):
        t = torch.from_numpy(rows)
        blocks = t.reshape(-1, FORMATS[fmt].block)
        want = QUANTIZERS[fmt](blocks).reshape(rows.shape[0], -1)
        assert torch.equal(quantize_native(t, fmt, threads=2), want)
        assert torch.equal(quantize(t, fmt), want)  # what `quantize` picks for a CPU tensor


@pytest.fixture(scope="module")
def wide(hf_checkpoint) -> Path:
    """Rows of 256: gate and up split into K-quant super-blocks, down (I = 256) too."""
    return hf_checkpoint("qwen3_moe_wide")


def _expert_weights(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if ".mlp.experts." in k}


def _part_format(name: str, spec, formats) -> str:
    """The format `formats` (per MoE layer) gives the HF expert tensor `name`."""
    layer = int(name.split(".")[2])
    part = name.split(".")[-2].removesuffix("_proj")
    return formats[spec.moe_layers.index(layer)][("gate", "up", "down").index(part)]


def test_q4_k_m_slots_hold_the_quantized_bytes_and_read_back_through_gguf(wide, tmp_path):
    out = tmp_path / "q.ftw"
    r = subprocess.run([sys.executable, "-m", "ftkit.tools.convert", str(wide), "-o", str(out),
                        "--quantize", "q4_k_m", "--threads", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert " ".join(r.stdout.split()).count("experts quantized by q4_k_m as llama-quantize lays it out") == 1
    model = FTWModel(out)
    spec, formats = model.spec, expert_formats(model.spec, "q4_k_m")
    assert [lay.formats for lay in model.layout.layers] == formats
    assert {f for layer in formats for f in layer} == {"q4_k", "q6_k"}  # down q6_k on use_more_bits' layers
    banks, src = model.read_banks(pin=False), _expert_weights(wide)
    for name, w in src.items():
        layer, e, part = int(name.split(".")[2]), int(name.split(".")[5]), name.split(".")[-2].removesuffix("_proj")
        fmt = _part_format(name, spec, formats)
        got = banks.parts(spec.moe_index(layer) * spec.num_experts + e)[part]
        assert torch.equal(got, quantize(w, fmt)), name
        back = gguf.quants.dequantize(got.numpy(), QT[fmt.upper()])
        assert np.array_equal(back, dequantize(got, fmt).numpy()), name
        rel = float(np.linalg.norm(back - w.numpy()) / np.linalg.norm(w.numpy()))
        assert rel < (0.08 if fmt == "q4_k" else 0.02), (name, rel)
    assert all(t.dtype == torch.float32 for t in model.dense_state().values())  # kept as stored


def _dequantized_twin(src: Path, out: Path, preset: str) -> Path:
    """`src` with every expert matrix replaced by its `preset` blocks dequantized to float32."""
    shutil.copytree(src, out)
    spec = prepare(src).spec
    formats = expert_formats(spec, preset)
    with safe_open(src / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for name, w in _expert_weights(src).items():
        fmt = _part_format(name, spec, formats)
        tensors[name] = dequantize(quantize(w, fmt), fmt).reshape(w.shape)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("preset, strategy", [("q4_k_m", "cpu"), ("mxfp4", "hybrid")])
def test_quantized_model_decodes_its_dequantized_twins_tokens(wide, tmp_path, preset, strategy):
    """The CPU kernel (and, in hybrid, the CPU-side torch path of the cached slots) reads the
    blocks as the float32 twin's values: the same greedy tokens."""
    q, ref = tmp_path / "q.ftw", tmp_path / "r.ftw"
    convert(prepare(wide, quantize=preset, threads=2), q)
    convert(prepare(_dequantized_twin(wide, tmp_path / "twin", preset)), ref)
    assert FTWModel(ref).layout.dtype == "float32" and FTWModel(q).layout.dtype != "float32"
    prompt = [3, 17, 5, 42, 8, 11, 29, 2, 40, 7] * 2
    runs = []
    for ftw in (q, ref):
        rt = Runtime(ftw, RuntimeOptions(device="cpu", strategy=strategy, dtype="float32", threads=2,
                                         **({"cache_experts": 2, "bandwidth_ratio": 0.5} if strategy == "hybrid" else {})))
        runs.append(generate(rt, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)).token_ids)
        rt.close()
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_quantize_refuses_blocks_and_unknown_presets(wide, tmp_path):
    with pytest.raises(CheckpointError, match="--quantize must be one of q4_k_m, .*got q3"):
        prepare(wide, quantize="q3")
    q = tmp_path / "q.ftw"
    convert(prepare(wide, quantize="q8_0"), q)
    assert FTWModel(q).layout.dtype == "q8_0"
    from gguf_fixtures import requantize_gguf, write_gguf_from_hf

    f32 = tmp_path / "f32.gguf"
    write_gguf_from_hf(wide, f32, "F32")
    names = [t.name for t in gguf.GGUFReader(f32).tensors if "_exps" in t.name]
    blocks = requantize_gguf(f32, tmp_path / "q8.gguf", {n: "q8_0" for n in names})
    with pytest.raises(CheckpointError, match=r"already quantized \(q8_0\); --quantize takes float experts"):
        prepare(blocks, quantize="q4_k_m")


def test_diagnose_prices_the_slots_quantize_writes(wide, tmp_path):
    """`ft-diagnose --quantize` plans with the slots `ftw-convert --quantize` then writes, and
    says in a problem line what it cannot price."""
    from ftkit.tools.diagnose.report import diagnose

    q = tmp_path / "q.ftw"
    convert(prepare(wide, quantize="q4_k_m"), q)
    layout = FTWModel(q).layout
    r = diagnose(wide, quantize="q4_k_m")
    assert (r["verdict"], r["problems"]) == ("PASS", [])
    m = r["memory"]
    assert (m["expert_dtype"], m["expert_slot_bytes"]) == (layout.describe(), layout.slot_bytes)
    assert m["host_expert_pool_bytes"] == FTWModel(q).spec.num_expert_rows * layout.slot_bytes
    assert diagnose(wide)["memory"]["expert_slot_bytes"] > 3 * layout.slot_bytes  # float32 as stored
    assert "unknown preset 'q3'" in diagnose(wide, quantize="q3")["problems"][0]
    assert diagnose(q, quantize="q4_k_m")["problems"] == [
        "--quantize q4_k_m: an FTW directory's slots are as written; it prices a conversion"]
