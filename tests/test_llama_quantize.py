"""Files quantized by llama.cpp's own llama-quantize, for every family, through the whole
pipeline: ft-diagnose passes them and names their stored expert formats, ftw-convert keeps
their blocks, and the cpu strategy at float32 decodes the greedy tokens of the gguf package's
dequantized twin of the same file. Runs where a llama-quantize binary is named by
LLAMA_QUANTIZE (device_run.sh's llamacpp part builds one; on the dev box: `cmake -B build &&
cmake --build build --target llama-quantize` in the source tools/bench/llama_source.sh
bundles); skipped elsewhere, CI included."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
from test_deepseek_v3 import CONFIG as DEEPSEEK_V3
from test_deepseek_v3 import make_checkpoint as make_deepseek_v3
from test_deepseek_v3 import write_deepseek2_gguf
from test_glm4_moe import CONFIG as GLM4_MOE
from test_glm4_moe import write_glm4moe_gguf
from test_gpt_oss import write_gpt_oss_gguf
from test_qwen3_5_moe import write_qwen35moe_gguf
from test_qwen3_next import write_qwen3next_gguf

import fixtures as fx
from ftkit.runtime.checkpoint.gguf import GGUFSource
from ftkit.runtime.engine.generate import generate
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.sampling import SamplingParams
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.tools.convert.pipeline import convert, prepare
from ftkit.tools.diagnose.report import diagnose
from ftkit.vocab import BLOCK_FORMATS
from gguf_fixtures import dequantized_gguf, write_gguf_from_hf

QUANTIZE = os.environ.get("LLAMA_QUANTIZE", "")
pytestmark = pytest.mark.skipif(not os.access(QUANTIZE, os.X_OK), reason="set LLAMA_QUANTIZE to a llama-quantize binary")

# 256-wide families take the K-quants as such; 64-wide ones llama-quantize's fallbacks (q5_0, q8_0, ...)
CASES = [(family, preset) for family in ("qwen3_moe_wide", "mixtral_wide") for preset in (
    "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q8_0", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL", "Q4_0", "Q5_1", "MXFP4_MOE")]
CASES += [(family, preset) for family in ("olmoe", "qwen2_moe") for preset in ("Q4_K_M", "Q3_K_S", "IQ4_XS", "MXFP4_MOE")]

# The other families at rows of 256 (hidden, expert and dense widths; DeepSeek's q_lora_rank),
# written by their own tests' GGUF writers, laid out as llama.cpp's converter lays each out:
# MLA, shared experts, biases and sinks, linear attention
_WIDE = {"hidden_size": 256, "head_dim": 64, "intermediate_size": 256, "moe_intermediate_size": 256}
_Q35 = fx.TINY_CONFIGS["qwen3_5_moe"]
MORE = {
    "gpt_oss": lambda out: write_gpt_oss_gguf(fx.make_hf_checkpoint(
        "gpt_oss", out.parent / "hf", config={**fx.TINY_CONFIGS["gpt_oss"], **_WIDE}), out),
    "deepseek_v3": lambda out: write_deepseek2_gguf(make_deepseek_v3(
        out.parent / "hf", {**DEEPSEEK_V3, **_WIDE, "q_lora_rank": 256}), out),
    "glm4_moe": lambda out: write_glm4moe_gguf(fx.make_hf_checkpoint(
        "glm4_moe", out.parent / "hf", config={"model_type": "glm4_moe", **GLM4_MOE, **_WIDE}), out),
    "qwen3_next": lambda out: write_qwen3next_gguf(fx.make_hf_checkpoint(
        "qwen3_next", out.parent / "hf",
        config={**fx.TINY_CONFIGS["qwen3_next"], **_WIDE, "shared_expert_intermediate_size": 256}), out, "F32"),
    "qwen3_5_moe": lambda out: write_qwen35moe_gguf(fx.make_hf_checkpoint(
        "qwen3_5_moe", out.parent / "hf", config={**_Q35, "text_config": {
            **_Q35["text_config"], **_WIDE, "shared_expert_intermediate_size": 256}}), out, "F32"),
}
MORE_CASES = [(family, preset) for family in MORE for preset in ("Q4_K_M", "Q5_K_S", "Q3_K_M", "Q2_K", "IQ4_XS", "Q6_K")]

# Unsloth-style mixes through llama-quantize's own overrides on top of Q4_K_M: a type per layer
# and part (its --tensor-type takes a regex of tensor names), dense tensors of other types
MIXES = {
    "down-q8_0": ["--tensor-type", "ffn_down_exps=q8_0"],
    "per-layer": ["--tensor-type", r"blk\.0\.ffn_down_exps=q5_k", "--tensor-type", r"blk\.1\.ffn_gate_exps=iq4_xs",
                  "--tensor-type", r"blk\.1\.ffn_up_exps=q6_k"],
    "dense": ["--tensor-type", "attn_q=q8_0", "--tensor-type", "attn_k=q4_0", "--output-tensor-type", "q8_0",
              "--token-embedding-type", "q6_k"],
}


@pytest.mark.parametrize("family,preset", CASES)
def test_llama_quantize_files_decode_as_their_dequantized_twin(hf_checkpoint, tmp_path_factory, family, preset):
    root = tmp_path_factory.mktemp(f"{family}-{preset}")
    write_gguf_from_hf(hf_checkpoint(family), root / "f32.gguf", "F32")
    _check(root, preset)


@pytest.mark.parametrize("family,preset", MORE_CASES)
def test_llama_quantize_files_of_the_other_families(tmp_path_factory, family, preset):
    root = tmp_path_factory.mktemp(f"{family}-{preset}")
    MORE[family](root / "f32.gguf")
    _check(root, preset)


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("family", ["qwen3_moe_wide", "mixtral_wide"])
def test_llama_quantize_mixes_of_types_per_layer_and_part(hf_checkpoint, tmp_path_factory, family, mix):
    root = tmp_path_factory.mktemp(f"{family}-{mix}")
    write_gguf_from_hf(hf_checkpoint(family), root / "f32.gguf", "F32")
    _check(root, "Q4_K_M", MIXES[mix])


def _check(root: Path, preset: str, options: Sequence[str] = ()) -> None:
    """root/f32.gguf through `llama-quantize [options] <preset>`, ft-diagnose, ftw-convert and cpu
    decode at float32, against the gguf package's dequantized twin of the quantized file."""
    path = root / f"{preset}.gguf"
    r = subprocess.run([QUANTIZE, *options, str(root / "f32.gguf"), str(path), preset, "2"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    stored = sorted({t.dtype for n, t in GGUFSource(path).tensors.items() if "_exps.weight" in n})
    assert set(stored) <= set(BLOCK_FORMATS)
    report = diagnose(path)
    assert report["verdict"] == "PASS", report["problems"]
    assert report["memory"]["expert_formats"] == stored
    runs = []
    for source, out in ((path, root / "q.ftw"), (dequantized_gguf(path, root / "twin.gguf"), root / "twin.ftw")):
        convert(prepare(source), out)
        rt = Runtime(out, RuntimeOptions(device="cpu", strategy="cpu", dtype="float32"))
        runs.append(generate(rt, [3, 17, 5, 42, 8, 11, 29, 2, 40, 7] * 2,
                             SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)).token_ids)
        rt.close()
    assert sorted(set(FTWModel(root / "q.ftw").layout.formats)) == stored  # the blocks kept as stored
    assert runs[0] == runs[1]
