"""FTW reader: refuses what it cannot read exactly; O_DIRECT and mmap paths read the same bytes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import ftkit.runtime.ftw.reader as reader_mod
from ftkit.runtime.ftw.manifest import VERSION, FTWError, fingerprint
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.random_model import demo_spec, write_random_ftw


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
        m["fingerprint"] = fingerprint(m["spec"], ex["layout"], ex["banks"])
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
        (lambda m: m["experts"]["layout"]["parts"][1].update(offset=0), True, "slot layout"),
        (lambda m: m["experts"]["banks"][0].update(rows=3), True, "banks hold"),
        (lambda m: m.pop("spec"), False, "malformed"),
    ],
)
def test_refuses_with_advice(ftw, tmp_path, edit, refp, message):
    with pytest.raises(FTWError, match=message):
        FTWModel(edited(ftw, tmp_path, edit, refp))


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
