"""GGUF files whose experts' gate and up projections are one tensor, `ffn_gate_up_exps`, as
llama.cpp's converter writes them with `--fuse_gate_up_exps` (since 2026-01; such files are on
the hub): they diagnose, price and convert to the same FTW as the file with the two apart."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch

import gguf_fixtures as gfx
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.random_model import demo_spec, write_random_gguf
from ftkit.tools.convert.pipeline import convert, prepare
from ftkit.tools.diagnose.report import diagnose

SPEC = dataclasses.replace(demo_spec(256), hidden_size=256, moe_intermediate_size=256, head_dim=32)
# layer 0 as llama-quantize's Q4_K_M lays out a use_more_bits layer, layer 1 another mix
MIX = {"blk.0.ffn_gate_exps.weight": "q4_k", "blk.0.ffn_up_exps.weight": "q4_k", "blk.0.ffn_down_exps.weight": "q6_k",
       "blk.1.ffn_gate_exps.weight": "q8_0", "blk.1.ffn_up_exps.weight": "q8_0", "blk.1.ffn_down_exps.weight": "q4_k"}


def _slots(path):
    ftw = FTWModel(path)
    banks = ftw.read_banks(pin=False)
    return ftw, [banks.parts(row) for row in range(ftw.spec.num_expert_rows)]


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "k-quants"])
def test_fused_gate_up_converts_to_the_same_slots(tmp_path, quantized):
    f32 = write_random_gguf(tmp_path / "f32.gguf", SPEC)
    apart = gfx.requantize_gguf(f32, tmp_path / "q.gguf", MIX) if quantized else f32
    fused = gfx.fused_gate_up_gguf(apart, tmp_path / "fused.gguf")
    names = [t.name for t in gguf.GGUFReader(fused).tensors]
    assert "blk.0.ffn_gate_up_exps.weight" in names and not any("ffn_gate_exps" in n or "ffn_up_exps" in n for n in names)
    reports = [diagnose(p) for p in (apart, fused)]
    for r in reports:
        assert (r["verdict"], r["problems"], r["unexpected"]) == ("PASS", [], []), r
    assert reports[0]["memory"] == reports[1]["memory"]  # the same experts, priced alike
    convert(prepare(apart), tmp_path / "apart.ftw")
    convert(prepare(fused), tmp_path / "fused.ftw")
    (a, want), (b, got) = _slots(tmp_path / "apart.ftw"), _slots(tmp_path / "fused.ftw")
    assert a.layout == b.layout
    if quantized:
        assert [lay.formats for lay in b.layout.layers] == [("q4_k", "q4_k", "q6_k"), ("q8_0", "q8_0", "q4_k"),
                                                            *[("float32",) * 3] * (SPEC.num_layers - 2)]
    assert all(w.keys() == g.keys() and all(torch.equal(w[n], g[n]) for n in w) for w, g in zip(want, got, strict=True))
