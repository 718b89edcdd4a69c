"""FTW reader: refuses what it cannot read exactly; O_DIRECT and mmap paths read the same bytes."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_fidelity import ftw_decoder, greedy

import ftkit.runtime.ftw.reader as reader_mod
from ftkit.runtime.engine.generate import generate
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.sampling import SamplingParams
from ftkit.runtime.ftw.manifest import VERSION, FTWError, fingerprint
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.random_model import demo_spec, write_random_ftw
from ftkit.vocab import expert_layout, storage_dtype


@pytest.fixture(scope="module")
def ftw(tmp_path_factory):
    path = tmp_path_factory.mktemp("ftw") / "m.ftw"
    write_random_ftw(path, demo_spec(300), dtype="bfloat16", seed=1)
    return path


def edited(ftw, tmp_path, edit, refingerprint=False):
    out = tmp_path / "edited.ftw"
    shutil.copytree(ftw, out)
    m = json.loads((out / "manifest.json").read_text())
    edit(m)
    if refingerprint:
        ex = m["experts"]
        m["fingerprint"] = fingerprint(m["spec"], ex["layout"], ex["banks"], m["version"])
    (out / "manifest.json").write_text(json.dumps(m))
    return out


def test_reads_every_slot_and_verifies(ftw):
    model = FTWModel(ftw)
    banks = model.read_banks(pin=False, threads=3)
    assert banks.nbytes == model.spec.num_expert_rows * model.layout.slot_bytes
    raw = (ftw / model.manifest.banks[0].file).read_bytes()
    s = model.layout.slot_bytes
    for row in (0, 17, model.spec.num_expert_rows - 1):
        assert bytes(banks.slot(row).numpy()) == raw[row * s : (row + 1) * s]
    assert model.verify() == []


def test_dense_tensors_are_read_one_at_a_time(ftw, monkeypatch):
    """The loader casts each dense tensor as it comes (the host holds one dequantized tensor at a
    time): `dense_tensors` reads a tensor only when asked for the next one."""
    reads = []
    monkeypatch.setattr(reader_mod, "_dense", lambda ref, dtype: reads.append(ref) or reader_mod.read_ref(ref))
    model = FTWModel(ftw)
    it = model.dense_tensors()
    assert reads == []
    name, first = next(it)
    assert len(reads) == 1 and name == next(iter(model.dense_refs))
    rest = dict(it)
    assert len(reads) == len(model.dense_refs) == len(rest) + 1
    assert torch.equal(first, model.dense_state()[name])


def test_odirect_and_mmap_agree(ftw, monkeypatch):
    a = FTWModel(ftw).read_banks(pin=False)
    monkeypatch.setattr(reader_mod, "probe_odirect", lambda path: False)
    b = FTWModel(ftw).read_banks(pin=False)
    assert b.method == "mmap"
    assert all(torch.equal(x, y) for x, y in zip(a.buffers, b.buffers, strict=False))


@pytest.mark.parametrize(
    "edit, refp, message",
    [
        (lambda m: m.update(version=VERSION + 1), False, "newer ftkit"),
        (lambda m: m.update(version=0), False, "reconvert"),
        (lambda m: m.update(format="other"), False, "not an FTW manifest"),
        (lambda m: m["spec"].update(num_experts=8), False, "fingerprint"),
        # A layout a different writer might have produced: refused even with a valid fingerprint.
        (lambda m: m["experts"]["layout"]["layers"][1]["parts"][1].update(offset=0), True, "slot layout"),
        (lambda m: m["experts"]["layout"]["layers"][0]["parts"][2].update(dtype="q8_0"), True, "slot layout"),
        (lambda m: m["experts"]["layout"]["layers"][0]["parts"][2].update(dtype="q9"), True, "expert dtype q9"),
        (lambda m: m["experts"]["layout"]["layers"].pop(), True, "not a list of 4 layers"),
        (lambda m: m["experts"]["layout"].update(packing="interleaved"), True, "slot layout"),
        (lambda m: m["experts"]["banks"][0].update(rows=3), True, "banks hold"),
        (lambda m: m.pop("spec"), False, "malformed"),
    ],
)
def test_refuses_with_advice(ftw, tmp_path, edit, refp, message):
    with pytest.raises(FTWError, match=message):
        FTWModel(edited(ftw, tmp_path, edit, refp))


def _dense_entry(m: dict, **what) -> None:
    """The manifest's first 2-D dense tensor (an embedding or projection) changed as `what`."""
    name = next(n for n, t in m["dense"]["tensors"].items() if len(t["shape"]) == 2)
    m["dense"]["tensors"][name].update(what)


@pytest.mark.parametrize(
    "edit, message",
    [
        # blocks listed where the file holds floats: the stored bytes are not that tensor's blocks
        (lambda m: _dense_entry(m, dtype="q8_0"), r"is bfloat16\[.*\] in dense.safetensors, q8_0\["),
        (lambda m: _dense_entry(m, dtype="q4_k", shape=[64, 300]), "q4_k needs a last dimension divisible by 256"),
        # a v2 manifest never held dense blocks
        (lambda m: (m.update(version=2), _dense_entry(m, dtype="q8_0")), "dtype 'q8_0' is not one of float32"),
    ],
)
def test_dense_blocks_the_manifest_cannot_stand_for_are_refused(ftw, tmp_path, edit, message):
    with pytest.raises(FTWError, match=message):
        FTWModel(edited(ftw, tmp_path, edit, refingerprint=True))


def test_a_v2_directory_still_loads(ftw, tmp_path):
    """FTW v2 is v3 with float dense tensors only: such a manifest (its fingerprint v2's) reads
    and loads as written."""
    path = edited(ftw, tmp_path, lambda m: m.update(version=2), refingerprint=True)
    assert json.loads((path / "manifest.json").read_text())["version"] == 2
    model, want = FTWModel(path), FTWModel(ftw).dense_state()
    assert all(torch.equal(t, want[n]) for n, t in model.dense_state().items()) and model.verify() == []


def test_truncated_bank_and_corrupt_byte(ftw, tmp_path):
    out = tmp_path / "t.ftw"
    shutil.copytree(ftw, out)
    bank = out / FTWModel(ftw).manifest.banks[0].file
    data = bytearray(bank.read_bytes())
    data[12345] ^= 0xFF
    bank.write_bytes(bytes(data))
    assert any("checksum" in p for p in FTWModel(out).verify())
    bank.write_bytes(bytes(data[:-4096]))
    with pytest.raises(FTWError, match="incomplete"):
        FTWModel(out)


V1 = Path(__file__).parent / "fixtures" / "ftw-v1-bf16"  # written by ftkit before FTW v2, kept as it was


def test_a_v1_directory_still_loads():
    """FTW v1 (one format for every slot part) reads as a uniform layout: its slots where v1
    put them, its checksums, its experts running on the cpu strategy."""
    assert json.loads((V1 / "manifest.json").read_text())["version"] == 1
    model = FTWModel(V1)
    assert model.layout.uniform is not None and model.layout.dtype == "bfloat16" and model.layout.slot_bytes == 4096
    assert model.verify() == []
    banks, raw = model.read_banks(pin=False), (V1 / "experts-00000.ftwb").read_bytes()
    for row in range(model.spec.num_expert_rows):
        for p in model.layout.for_row(row).parts:
            start = row * 4096 + p.offset
            want = torch.frombuffer(bytearray(raw[start : start + p.nbytes]), dtype=torch.bfloat16).view(p.shape)
            assert torch.equal(banks.parts(row)[p.name], want)
    rt = Runtime(V1, RuntimeOptions(device="cpu", strategy="cpu"))
    out = generate(rt, [1, 5, 9], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    with torch.no_grad():
        ref, _ = greedy(ftw_decoder(V1), torch.tensor([1, 5, 9]), 6)  # the torch reference experts
    assert out.token_ids == ref and len(set(ref)) > 1


@pytest.mark.parametrize("dtype", [None, 7, ["bfloat16"], {"x": 1}])
def test_a_v1_layout_without_a_format_name_is_one_line(tmp_path, dtype):
    """A v1 manifest whose layout names no format (found by test_fuzz_ftw): FTWError, not a
    TypeError from the layout builder."""
    shutil.copytree(V1, tmp_path / "m.ftw")
    path = tmp_path / "m.ftw" / "manifest.json"
    m = json.loads(path.read_text())
    m["experts"]["layout"]["dtype"] = dtype
    path.write_text(json.dumps(m))
    with pytest.raises(FTWError, match=r"malformed FTW manifest \(experts.layout.dtype is [a-z ]+, not a format name\)"):
        FTWModel(tmp_path / "m.ftw")


def test_layers_and_parts_keep_their_own_formats(tmp_path):
    """A v2 layout: each MoE layer's parts in their own formats, one slot size (the largest
    layer's), written and read back byte for byte."""
    spec = dataclasses.replace(demo_spec(300), hidden_size=256, moe_intermediate_size=256)
    formats = [("q4_k", "q4_k", "q6_k"), ("q4_k", "q4_k", "q4_k"), ("q8_0", "mxfp4", "bfloat16"), ("float32",) * 3]
    layout = expert_layout(spec, formats)
    assert [lay.formats for lay in layout.layers] == formats and layout.uniform is None
    # Q4_K_M's layer: 256 rows of one q4_k super-block (144 bytes) twice, and of one q6_k (210)
    assert layout.layers[0].data_bytes == 2 * 256 * 144 + 256 * 210
    assert all(lay.slot_bytes == 3 * 256 * 256 * 4 for lay in layout.layers)  # the float32 layer's
    assert layout.describe() == "gate float32|q4_k|q8_0, up float32|mxfp4|q4_k, down bfloat16|float32|q4_k|q6_k"
    path = tmp_path / "mixed.ftw"
    write_random_ftw(path, spec, dtype="float32", expert_formats=formats, seed=2)
    model = FTWModel(path)
    assert model.layout == layout and model.verify() == []
    banks = model.read_banks(pin=False)
    for row in (0, 17, 40, 63):
        parts = banks.parts(row)
        for p in layout.for_row(row).parts:
            assert parts[p.name].dtype == storage_dtype(p.dtype) and parts[p.name].numel() * parts[p.name].element_size() == p.nbytes


def test_not_ftw(tmp_path):
    with pytest.raises(FTWError, match="not an FTW directory"):
        FTWModel(tmp_path)


def test_a_killed_writers_leftovers_are_removed_by_the_next_and_a_live_ones_kept(tmp_path, capsys):
    """A SIGKILLed convert leaves its temporary sibling behind (no `finally` runs); the next write
    of that output removes it and says so, but never one another writer still holds."""
    import fcntl
    import os

    out = tmp_path / "m.ftw"
    stale, live = tmp_path / ".m.ftw.tmp-deadbeef", tmp_path / ".m.ftw.tmp-cafe0000"
    for d in (stale, live):
        d.mkdir()
        (d / "bank-000.bin").write_bytes(b"\0" * 4096)
    other = tmp_path / ".other.ftw.tmp-00000000"  # another output's: not ours to touch
    other.mkdir()
    fd = os.open(live.with_name(live.name + ".lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a running writer holds it
    try:
        write_random_ftw(out, demo_spec(64))
    finally:
        os.close(fd)
    assert not stale.exists() and live.exists() and other.exists() and FTWModel(out).spec.num_layers
    assert "removed .m.ftw.tmp-deadbeef" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".m.ftw.tmp-cafe0000", ".m.ftw.tmp-cafe0000.lock",
                                                                 ".other.ftw.tmp-00000000", "m.ftw"])
    nested = tmp_path / "new" / "dir" / "m.ftw"  # folders that do not exist yet are made
    write_random_ftw(nested, demo_spec(64))
    assert sorted(p.name for p in nested.parent.iterdir()) == ["m.ftw"]
