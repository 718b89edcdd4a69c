"""The first pipeline step offline: `ft-run demo --hf --gguf` writes the built-in model as an HF
safetensors directory and a GGUF file; ft-diagnose passes both, ftw-convert converts both, and the
two FTWs hold bitwise the same weights (the same random model, laid out two ways)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ftkit.runtime.cli import app as ft_run
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.random_model import demo_spec, write_random_gguf, write_random_hf
from ftkit.tools.convert.cli import app as ftw_convert
from ftkit.tools.diagnose.report import diagnose


def test_demo_writes_sources_that_diagnose_and_convert(tmp_path: Path) -> None:
    result = CliRunner().invoke(ft_run, ["demo", "--out", str(tmp_path), "--max-tokens", "2", "--threads", "1",
                                         "--hf", "--gguf"])
    assert result.exit_code == 0, result.output
    hf, gguf = tmp_path / "demo-hf", tmp_path / "demo.gguf"
    assert f"wrote {hf}: try `ft-diagnose {hf}`" in result.stdout and f"wrote {gguf}" in result.stdout
    models = {}
    for src in (hf, gguf):
        r = diagnose(src)
        assert (r["verdict"], r["family"], r["layers"], r["experts"]) == ("PASS", "qwen3_moe", 4, 16), r["problems"]
        out = tmp_path / f"{src.name}-converted.ftw"
        converted = CliRunner().invoke(ftw_convert, [str(src), "-o", str(out)])
        assert converted.exit_code == 0, converted.output
        models[src.suffix or "hf"] = FTWModel(out)
    a, b = models["hf"], models[".gguf"]
    # GGUF keeps the norm epsilon as a float32 (as llama.cpp writes it): the one difference
    assert dataclasses.replace(b.spec, rms_norm_eps=a.spec.rms_norm_eps) == a.spec
    assert b.spec.rms_norm_eps == pytest.approx(a.spec.rms_norm_eps, rel=1e-6)
    dense_a, dense_b = a.dense_state(), b.dense_state()
    assert dense_a.keys() == dense_b.keys() and all(torch.equal(dense_a[k], dense_b[k]) for k in dense_a)
    banks = [sorted(m.path.glob("*.ftwb")) for m in (a, b)]
    assert [p.name for p in banks[0]] == [p.name for p in banks[1]]
    assert all(x.read_bytes() == y.read_bytes() for x, y in zip(*banks, strict=True))  # every expert slot
    assert (hf / "tokenizer.json").is_file()


def test_sources_are_written_atomically_and_never_over_a_file(tmp_path: Path) -> None:
    spec = demo_spec(64)
    write_random_gguf(tmp_path / "m.gguf", spec)
    with pytest.raises(FileExistsError):
        write_random_gguf(tmp_path / "m.gguf", spec)
    write_random_hf(tmp_path / "hf", spec)
    with pytest.raises(FileExistsError):
        write_random_hf(tmp_path / "hf", spec)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.gguf"]  # no temporary left behind


def test_a_bf16_gguf_with_a_vocabulary_converts_to_the_rounded_weights(tmp_path: Path) -> None:
    """What llama.cpp's tools take (`ft-bench write --gguf`): bfloat16 matrices, float32 norms and
    routers (as llama.cpp's converter keeps them), a SentencePiece vocabulary of the spec's size
    (its byte tokens included); converted, the weights are the float32 file's rounded to bf16,
    and the vocabulary becomes a tokenizer."""
    import gguf as gguf_py

    from ftkit.runtime.random_model import spm_vocab

    spec = demo_spec(512)
    f32 = write_random_gguf(tmp_path / "f32.gguf", spec, distinct_experts=3)
    bf16 = write_random_gguf(tmp_path / "bf16.gguf", spec, dtype="bfloat16", vocab=True, distinct_experts=3)
    types = {t.name: t.tensor_type.name for t in gguf_py.GGUFReader(bf16).tensors}
    assert {types[n] for n in types if n.endswith("norm.weight") or "ffn_gate_inp" in n} == {"F32"}
    assert {types[n] for n in types if n.endswith(("_exps.weight", "attn_q.weight", "token_embd.weight"))} == {"BF16"}
    tokens, scores, kinds = spm_vocab(512)
    assert len(set(tokens)) == len(scores) == len(kinds) == 512 and "<0xFF>" in tokens
    with pytest.raises(ValueError, match="no room for its byte tokens"):
        spm_vocab(200)
    models = []
    for src in (f32, bf16):
        out = tmp_path / f"{src.stem}.ftw"
        assert CliRunner().invoke(ftw_convert, [str(src), "-o", str(out)]).exit_code == 0
        models.append(FTWModel(out))
    a, b = models
    assert (b.path / "tokenizer.json").is_file()
    banks_a, banks_b = a.read_banks(pin=False), b.read_banks(pin=False)
    for row in (0, 3, spec.num_expert_rows - 1):  # experts cycle through the three drawn
        pa, pb = banks_a.parts(row), banks_b.parts(row)
        assert all(torch.equal(pa[p].view(torch.float32).to(torch.bfloat16), pb[p].view(torch.bfloat16)) for p in pa)
    assert torch.equal(banks_a.parts(0)["gate"], banks_a.parts(3)["gate"])
    dense_a, dense_b = a.dense_state(), b.dense_state()
    assert all(torch.equal(dense_a[n].to(dense_b[n].dtype), dense_b[n]) for n in dense_a)
