"""Corrupt headers of many kinds: converter and diagnose answer with one clean line or a verdict,
never a crash. Byte flips land in the header region, truncations anywhere (seeded)."""

from __future__ import annotations

import random
import shutil
import struct

import pytest

from ftkit.runtime.checkpoint import CheckpointError
from ftkit.runtime.ftw.manifest import FTWError
from ftkit.tools.convert.pipeline import convert, make_plan
from ftkit.tools.diagnose.report import diagnose
from gguf_fixtures import header_end, write_gguf_from_hf

CASES = 40


def mutate(data: bytes, header: int, rng: random.Random) -> bytes:
    out = bytearray(data)
    kind = rng.choice(["flip", "flips", "truncate"])
    if kind == "truncate":
        return bytes(out[: rng.randrange(0, len(out))])
    for _ in range(1 if kind == "flip" else 8):
        out[rng.randrange(0, min(len(out), header))] = rng.randrange(256)
    return bytes(out)


def check(path, out):
    try:
        convert(make_plan(path), out)
    except (CheckpointError, FTWError, ValueError) as e:
        msg = str(e)
        assert msg and "\n" not in msg and msg.isprintable(), repr(msg)
    report = diagnose(path)
    assert report["verdict"] in ("PASS", "FAIL")
    assert all("\n" not in p for p in report["problems"])


@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
def test_corrupt_headers_never_crash(hf_checkpoint, tmp_path, fmt):
    hf = hf_checkpoint("qwen3_moe")
    rng = random.Random(1234)
    if fmt == "gguf":
        src = tmp_path / "m.gguf"
        write_gguf_from_hf(hf, src, "Q8_0")
        header = header_end(src) + 64
    else:
        src = hf / "model.safetensors"
        header = 8 + struct.unpack("<Q", src.read_bytes()[:8])[0]
    data = src.read_bytes()
    for i in range(CASES):
        out = tmp_path / f"o{i}.ftw"
        if fmt == "gguf":
            bad = tmp_path / f"b{i}.gguf"
            bad.write_bytes(mutate(data, header, rng))
        else:
            bad = tmp_path / f"b{i}"
            shutil.copytree(hf, bad)
            (bad / "model.safetensors").write_bytes(mutate(data, header, rng))
        check(bad, out)
        shutil.rmtree(out, ignore_errors=True)
