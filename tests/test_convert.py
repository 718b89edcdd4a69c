"""ftw-convert: every family, layout and GGUF type round-trips; bad input fails cleanly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import fixtures as fx
from ftkit.kernels.dequant import dequantize_q8_0
from ftkit.runtime.checkpoint import open_source
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.models.mixtral import unpermute_rows
from ftkit.tools.convert.pipeline import convert, prepare
from gguf_fixtures import write_gguf_from_hf

FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"]
CONVERT = [sys.executable, "-m", "ftkit.tools.convert"]


def run_convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CONVERT, *map(str, args)], capture_output=True, text=True, timeout=300)


def hf_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def expert_from_hf(t: dict[str, torch.Tensor], family: str, layer: int, e: int, part: str) -> torch.Tensor:
    p = f"model.layers.{layer}."
    if p + "mlp.experts.gate_up_proj" in t:  # stacked
        if part == "down":
            return t[p + "mlp.experts.down_proj"][e]
        gu = t[p + "mlp.experts.gate_up_proj"][e]
        return gu[: gu.shape[0] // 2] if part == "gate" else gu[gu.shape[0] // 2 :]
    if family == "mixtral":
        w = {"gate": "w1", "up": "w3", "down": "w2"}[part]
        return t[f"{p}block_sparse_moe.experts.{e}.{w}.weight"]
    return t[f"{p}mlp.experts.{e}.{part}_proj.weight"]


def check_roundtrip(ckpt: Path, ftw: Path, family: str) -> None:
    """Every tensor read back from FTW equals the source, bitwise."""
    src = hf_tensors(ckpt)
    model = FTWModel(ftw)
    spec = model.spec
    source = open_source(ckpt)
    fam_rules = __import__("ftkit.runtime.models", fromlist=["FAMILIES"]).FAMILIES[family]
    dense = model.dense_state()
    for name, t in src.items():
        m = fam_rules.map_name(name, gguf=False)
        if m is not None and m.canonical is not None:
            assert torch.equal(dense[m.canonical], t), name
    banks = model.read_banks(pin=False)
    for mi, layer in enumerate(spec.moe_layers):
        for e in range(spec.num_experts):
            parts = banks.parts(mi * spec.num_experts + e)
            for part in ("gate", "up", "down"):
                assert torch.equal(parts[part], expert_from_hf(src, family, layer, e, part)), (layer, e, part)
    assert source.kind == "safetensors"
    assert "tokenizer.json" in model.manifest.files


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", ["single", "sharded", "stacked"])
def test_hf_roundtrip(hf_checkpoint, tmp_path, family, variant):
    ckpt = hf_checkpoint(family, sharded=variant == "sharded", stacked=variant == "stacked")
    out = tmp_path / "m.ftw"
    convert(prepare(ckpt), out)
    check_roundtrip(ckpt, out, family)
    assert FTWModel(out).verify() == []


def test_sparse_layers_and_bf16(hf_checkpoint, tmp_path):
    ckpt = hf_checkpoint("qwen3_moe_sparse", dtype=torch.bfloat16)
    out = tmp_path / "m.ftw"
    convert(prepare(ckpt), out)
    spec = FTWModel(out).spec
    assert spec.moe_layers == (1,) and FTWModel(out).layout.dtype == "bfloat16"
    check_roundtrip(ckpt, out, "qwen3_moe")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("gtype", ["F32", "F16", "BF16", "Q8_0"])
def test_gguf_roundtrip(hf_checkpoint, tmp_path, family, gtype):
    """GGUF as llama.cpp writes it: dense tensors match the GGUF data (dequantised exactly for
    Q8_0, Q/K rows un-permuted for the llama arch), experts keep their stored bytes."""
    ckpt = hf_checkpoint(family)
    path = tmp_path / "m.gguf"
    write_gguf_from_hf(ckpt, path, gtype)
    out = tmp_path / "m.ftw"
    convert(prepare(path), out)
    model = FTWModel(out)
    spec = model.spec
    reader = gguf.GGUFReader(path)
    dense = model.dense_state()
    fam = __import__("ftkit.runtime.models", fromlist=["FAMILIES"]).FAMILIES[family]
    banks = model.read_banks(pin=False)
    for t in reader.tensors:
        m = fam.map_name(t.name, gguf=True)
        shape = tuple(int(d) for d in reversed(t.shape))
        data = torch.from_numpy(np.array(t.data))
        if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            raw = data.view(torch.uint8).reshape(*shape[:-1], -1)
            value = dequantize_q8_0(raw).reshape(shape)
            ref = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type)).reshape(shape)
            assert torch.equal(value, ref), t.name
        else:
            if t.tensor_type == gguf.GGMLQuantizationType.BF16:  # the reader hands BF16 over as bytes
                data = data.view(torch.uint8).view(torch.bfloat16)
            raw, value = None, data.reshape(shape)
        if m.canonical is not None:
            got = dense[m.canonical]
            want = value
            if family == "mixtral" and m.canonical.endswith(("attn.q.weight", "attn.k.weight")):
                heads = spec.num_heads if m.canonical.endswith("q.weight") else spec.num_kv_heads
                want = unpermute_rows(want, heads)
            assert torch.equal(got, want.reshape(got.shape).to(got.dtype)), t.name
        else:
            mi = spec.moe_index(m.layer)
            for e in range(spec.num_experts):
                part = banks.parts(mi * spec.num_experts + e)[m.part]
                assert torch.equal(part, (raw if raw is not None else value)[e]), (t.name, e)
    if gtype == "F32":  # and the weights are the HF model's own
        check_dense_matches_hf(ckpt, dense, fam)


def check_dense_matches_hf(ckpt: Path, dense: dict[str, torch.Tensor], fam) -> None:
    for name, t in hf_tensors(ckpt).items():
        m = fam.map_name(name, gguf=False)
        if m is not None and m.canonical is not None:
            assert torch.equal(dense[m.canonical].reshape(t.shape), t), name


def test_dtype_cast_and_dry_run(hf_checkpoint, tmp_path):
    ckpt = hf_checkpoint("olmoe")
    out = tmp_path / "m.ftw"
    r = run_convert(ckpt, "-o", out, "--dry-run")
    assert r.returncode == 0 and "dry run" in r.stdout and not out.exists()
    r = run_convert(ckpt, "-o", out, "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    model = FTWModel(out)
    assert model.layout.dtype == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in model.dense_state().values())
    src = hf_tensors(ckpt)["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert torch.equal(model.read_banks(pin=False).parts(3)["up"], src.to(torch.bfloat16))


def test_existing_output_needs_force(hf_checkpoint, tmp_path):
    ckpt = hf_checkpoint("mixtral")
    out = tmp_path / "m.ftw"
    out.mkdir()
    (out / "keep").write_text("user data")
    r = run_convert(ckpt, "-o", out)
    assert r.returncode != 0 and "--force" in r.stderr and (out / "keep").exists()
    r = run_convert(ckpt, "-o", out, "--force")
    assert r.returncode == 0, r.stderr
    assert not (out / "keep").exists() and FTWModel(out).spec.family == "mixtral"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.ftw"]  # no temporary siblings left


def _gguf_bad_magic(src: Path, out: Path) -> Path:
    out.mkdir()
    path = out / "m.gguf"
    write_gguf_from_hf(src, path, "F32")
    data = bytearray(path.read_bytes())
    data[:4] = b"GGUX"
    path.write_bytes(bytes(data))
    return path


def _gguf_unsupported(src: Path, out: Path) -> Path:
    out.mkdir()
    path = out / "m.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(1)
    tq1 = gguf.quants.quantize(np.zeros((4, 256), np.float32), gguf.GGMLQuantizationType.TQ1_0)
    w.add_tensor("blk.0.ffn_down_exps.weight", tq1, raw_dtype=gguf.GGMLQuantizationType.TQ1_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_rows_not_in_blocks(src: Path, out: Path) -> Path:
    """A Q4_K tensor whose header says rows of 128: not a whole number of 256-weight blocks."""
    out.mkdir()
    path = out / "m.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(1)
    q4k = np.zeros((4, 144), np.uint8)  # one Q4_K block a row
    w.add_tensor("blk.0.ffn_down_exps.weight", q4k, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_down_exps.weight"
    dims_at = data.index(name) + len(name) + 4  # after the name, n_dims; then ne[0]
    data[dims_at : dims_at + 8] = (128).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    return path


BAD = {
    "truncated safetensors": (lambda s, o: fx.truncate_safetensors(s, o), "truncated"),
    "offsets past the end": (lambda s, o: fx.offsets_past_end(s, o), "past the end"),
    "missing shard": (lambda s, o: fx.missing_shard(s, o), "missing shard"),
    "GGUF bad magic": (_gguf_bad_magic, "magic"),
    "GGUF unsupported type": (_gguf_unsupported, "unsupported GGUF type TQ1_0 for tensor blk.0.ffn_down_exps.weight"),
    "GGUF rows not in blocks": (_gguf_rows_not_in_blocks,
                                "tensor blk.0.ffn_down_exps.weight is Q4_K but its row length 128 is not a multiple of 256"),
    "no expert count": (lambda s, o: fx.config_without_expert_count(s, o), "expert count"),
    "unknown architecture": (lambda s, o: fx.unknown_architecture(s, o), "unknown architecture"),
    "missing tensor": (lambda s, o: fx.missing_tensor(s, o, "self_attn.k_proj.weight"), "missing tensor"),
    "wrong shape": (lambda s, o: fx.wrong_shape(s, o, "self_attn.o_proj.weight"), "wrong shape"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_input_fails_cleanly(hf_checkpoint, tmp_path, case):
    make, expect = BAD[case]
    src = hf_checkpoint("qwen3_moe", sharded=case == "missing shard")
    bad = make(src, tmp_path / "bad")
    out = tmp_path / "out.ftw"
    r = run_convert(bad, "-o", out)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert expect.lower() in r.stderr.lower(), r.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.ftw")]


def test_legacy_config_keys(hf_checkpoint, tmp_path):
    """Hub configs use `num_experts`, `rope_theta`, `rope_scaling`: the same spec comes out."""
    ckpt = hf_checkpoint("qwen3_moe_rope")
    legacy = tmp_path / "legacy"
    shutil.copytree(ckpt, legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in params.items()}
    cfg["num_experts"] = cfg.pop("num_local_experts")
    (legacy / "config.json").write_text(json.dumps(cfg))
    a, b = prepare(ckpt).spec, prepare(legacy).spec
    assert a == b and a.rope_scaling["rope_type"] == "yarn"
