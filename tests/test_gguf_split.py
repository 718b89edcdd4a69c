"""GGUF models split over several files by llama.cpp's tools (`llama-gguf-split`, the
converter's `--split-max-tensors`/`--split-max-size`), as large models come on the hub: opened
from the first file, they read, diagnose and convert as the one-file model does; any other
file, a missing one or a mismatched set is one clear line."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

import gguf_fixtures as gfx
from ftkit.runtime.checkpoint import open_source
from ftkit.runtime.checkpoint.base import CheckpointError
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.random_model import demo_spec, write_random_gguf
from ftkit.tools.convert.pipeline import convert, prepare
from ftkit.tools.diagnose.report import diagnose

SPEC = dataclasses.replace(demo_spec(256), hidden_size=256, moe_intermediate_size=256, head_dim=32)
MIX = {"blk.0.ffn_gate_exps.weight": "q4_k", "blk.0.ffn_up_exps.weight": "q4_k", "blk.0.ffn_down_exps.weight": "q6_k",
       "blk.1.ffn_down_exps.weight": "q8_0", "blk.2.attn_q.weight": "q8_0"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("split")
    one = gfx.requantize_gguf(write_random_gguf(d / "f32.gguf", SPEC), d / "one.gguf", MIX)
    (d / "parts").mkdir()
    parts = gfx.split_gguf(one, d / "parts" / "model.gguf", max_tensors=12)
    return one, parts


def test_split_model_reads_as_the_one_file(files):
    one, parts = files
    assert len(parts) >= 3 and parts[0].name == f"model-00001-of-{len(parts):05d}.gguf"
    a, b = open_source(one), open_source(parts[0])
    assert {n: (r.dtype, r.shape) for n, r in a.tensors.items()} == {n: (r.dtype, r.shape) for n, r in b.tensors.items()}
    assert {r.path.name for r in b.tensors.values()} == {p.name for p in parts}
    assert all(torch.equal(a.read(n), b.read(n)) for n in a.tensors)
    assert {k: v for k, v in b.metadata.items() if not k.startswith("split.")} == a.metadata


def test_split_model_diagnoses_and_converts_as_the_one_file(files, tmp_path):
    one, parts = files
    r1, r2 = diagnose(one), diagnose(parts[0])
    assert (r2["verdict"], r2["problems"]) == ("PASS", []) and r1["memory"] == r2["memory"], r2
    convert(prepare(one), tmp_path / "a.ftw")
    convert(prepare(parts[0]), tmp_path / "b.ftw")
    a, b = FTWModel(tmp_path / "a.ftw"), FTWModel(tmp_path / "b.ftw")
    assert a.layout == b.layout and a.manifest.dense == b.manifest.dense  # the dense tensors' checksum too
    x, y = a.read_banks(pin=False), b.read_banks(pin=False)
    for row in range(a.spec.num_expert_rows):
        assert all(torch.equal(t, y.parts(row)[n]) for n, t in x.parts(row).items())


def test_a_later_file_a_missing_one_or_a_renamed_set_is_one_line(files, tmp_path):
    _, parts = files
    n = len(parts)
    with pytest.raises(CheckpointError, match=f"file 2 of a model split in {n}: open the first, model-00001-of-"):
        open_source(parts[1])
    gone = tmp_path / "gone"
    shutil.copytree(parts[0].parent, gone)
    (gone / parts[-1].name).unlink()
    with pytest.raises(CheckpointError, match=f"file {n} of this split model is missing: {parts[-1].name}"):
        open_source(gone / parts[0].name)
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(parts[0], renamed)
    with pytest.raises(CheckpointError, match="not named as llama-gguf-split names them"):
        open_source(renamed)
    mixed = tmp_path / "mixed"
    shutil.copytree(parts[0].parent, mixed)
    shutil.copy(parts[1], mixed / parts[2].name)  # file 3 replaced by a copy of file 2
    with pytest.raises(CheckpointError, match="split.no 1 of .*, expected 2 of"):
        open_source(mixed / parts[0].name)
