"""Hugging Face ids as sources: `ft-diagnose org/name` and `ftw-convert org/name` find the snapshot
in a hub cache laid out as huggingface_hub lays it out (blobs, symlinked snapshots, refs), offline;
a path that exists always wins; an id the cache lacks is one line and exit code 2."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ftkit.runtime.checkpoint.hub import HubError, hub_cache, is_repo_id, local_path, snapshot
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.tools.convert.cli import app as convert_app
from ftkit.tools.diagnose.cli import app as diagnose_app

REPO = "tiny-org/Tiny-MoE"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(hub: Path, repo: str, src: Path, commit: str = COMMIT) -> Path:
    """`src`'s files as the hub cache keeps a download: blobs named by their hash, the snapshot's
    files symlinks to them, refs/main naming the commit."""
    root = hub / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, blob)
        link = snap / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf-home"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def diagnose_json(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(diagnose_app, [*args, "--json"])
    assert "Traceback" not in result.output
    return result.exit_code, json.loads(result.stdout)


def test_the_cache_location_follows_huggingface_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "direct"))
    assert hub_cache() == tmp_path / "direct"


def test_repo_ids() -> None:
    assert is_repo_id("Qwen/Qwen3-30B-A3B") and is_repo_id("a.b/c_d-1.5")
    assert not any(map(is_repo_id, ["model", "/abs/path", "./rel/dir", "a/b/c", "../x", "a/..", "a/.b"]))


def test_diagnose_resolves_an_id_from_the_cache(hf_checkpoint, hf_home: Path) -> None:
    src = hf_checkpoint("qwen3_moe", sharded=True)
    snap = cache_repo(hf_home / "hub", REPO, src)
    assert local_path(REPO) == snap
    code, r = diagnose_json(REPO)
    assert (code, r["verdict"], r["family"], r["path"]) == (0, "PASS", "qwen3_moe", str(snap))
    assert r["files"] >= 3


def test_a_revision_the_cache_holds(hf_checkpoint, hf_home: Path) -> None:
    snap = cache_repo(hf_home / "hub", REPO, hf_checkpoint("olmoe"))
    assert snapshot(REPO, COMMIT) == snap
    with pytest.raises(HubError, match="not in the Hugging Face cache"):
        snapshot(REPO, "v2")


def test_a_path_that_exists_wins(hf_checkpoint, hf_home: Path, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cache_repo(hf_home / "hub", REPO, hf_checkpoint("qwen3_moe"))
    work = tmp_path / "work"
    shutil.copytree(hf_checkpoint("mixtral"), work / REPO)
    monkeypatch.chdir(work)
    code, r = diagnose_json(REPO)
    assert (code, r["family"], r["path"]) == (0, "mixtral", REPO)


def test_an_id_not_in_the_cache_is_one_line(hf_home: Path) -> None:
    result = CliRunner().invoke(diagnose_app, ["nobody/Nothing-7B"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "nobody/Nothing-7B: no such path, and not in the Hugging Face cache" in lines[0]
    assert str(hf_home / "hub") in lines[0] and "hf download nobody/Nothing-7B" in lines[0]
    code, r = diagnose_json("nobody/Nothing-7B")  # --json: still a verdict on stdout
    assert (code, r["verdict"], r["path"]) == (2, "FAIL", "nobody/Nothing-7B")
    assert r["problems"][0].startswith("nobody/Nothing-7B: no such path")


def test_convert_resolves_an_id_from_the_cache(hf_checkpoint, hf_home: Path, tmp_path: Path) -> None:
    cache_repo(hf_home / "hub", REPO, hf_checkpoint("qwen2_moe"))
    out = tmp_path / "tiny.ftw"
    result = CliRunner().invoke(convert_app, [REPO, "-o", str(out)])
    assert result.exit_code == 0, result.output
    model = FTWModel(out)
    assert model.spec.family == "qwen2_moe" and (out / "tokenizer.json").is_file()
    missing = CliRunner().invoke(convert_app, ["nobody/Nothing-7B", "-o", str(tmp_path / "x")])
    assert missing.exit_code == 1 and "not in the Hugging Face cache" in missing.output
    assert "Traceback" not in missing.output and not (tmp_path / "x").exists()
