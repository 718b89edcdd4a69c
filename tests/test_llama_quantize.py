"""Files quantized by llama.cpp's own llama-quantize, through the whole pipeline: ft-diagnose
passes them and names their stored expert formats, ftw-convert keeps their blocks, and the cpu
strategy at float32 decodes the greedy tokens of the gguf package's dequantized twin of the same
file. Runs where a llama-quantize binary is named by LLAMA_QUANTIZE (device_run.sh's llamacpp
part builds one; on the dev box: `cmake -B build && cmake --build build --target llama-quantize`
in the source tools/bench/llama_source.sh bundles); skipped elsewhere, CI included."""

from __future__ import annotations

import os
import subprocess

import pytest

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


@pytest.mark.parametrize("family,preset", CASES)
def test_llama_quantize_files_decode_as_their_dequantized_twin(hf_checkpoint, tmp_path_factory, family, preset):
    root = tmp_path_factory.mktemp(f"{family}-{preset}")
    f32 = root / "f32.gguf"
    write_gguf_from_hf(hf_checkpoint(family), f32, "F32")
    path = root / f"{preset}.gguf"
    r = subprocess.run([QUANTIZE, str(f32), str(path), preset, "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    stored = sorted({t.dtype for n, t in GGUFSource(path).tensors.items() if "_exps" in n})
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
