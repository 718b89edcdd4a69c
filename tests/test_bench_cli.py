"""ft-bench's command line as a newcomer meets it: a strategy that cannot run still leaves the
table of those that ran (and its JSON), then one line; tables keep every column in a pipe; the
agent trace reports each turn and writes its model into the cache, not the current directory."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from ftkit.runtime.random_model import demo_spec, write_random_ftw
from ftkit.runtime.synthetic import write_tokenizer
from ftkit.tools.bench.cli import app


def test_a_strategy_that_cannot_run_leaves_the_others_rows(tmp_path: Path) -> None:
    model = tmp_path / "m.ftw"
    write_random_ftw(model, demo_spec(512), side_files=lambda d: write_tokenizer(d, 512))
    out = tmp_path / "decode.json"
    result = CliRunner().invoke(app, ["decode", "-m", str(model), "--device", "cpu", "--strategies", "cpu,hybrid",
                                      "--tokens", "2", "--prompt", "4", "--threads", "1", "--no-profile",
                                      "--out", str(out)])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and "hybrid" in result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("│") and " cpu │" in line]
    assert len(rows) == 1 and len(rows[0]) > 80  # one row, whole: not folded to 80 columns
    assert [r["strategy"] for r in json.loads(out.read_text())["runs"]] == ["cpu"]


def test_agent_trace_reports_turns_and_writes_into_the_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["agent-trace", "--model", "demo", "--turns", "2", "--harness", "opencode",
                                      "--json"])
    assert result.exit_code == 0, result.output
    assert "ft-bench: anchors: opencode turn 2/2" in result.stderr
    assert (tmp_path / "cache" / "ftkit" / "agent-trace" / "demo.ftw" / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert len(json.loads(result.stdout)["rows"]) == 2 * 3  # two turns in each of three modes
