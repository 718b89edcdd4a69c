"""ft-calibrate's CPU-only profile read back by the runtime, the profile reader, and the planner's
online correction."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ftkit.runtime.engine.loader import RuntimeOptions
from ftkit.runtime.engine.resolve import Machine, resolve
from ftkit.runtime.experts.planner import Planner
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.profile import Bandwidths, load_profile
from ftkit.runtime.random_model import demo_spec, write_random_ftw
from ftkit.tools.calibrate.cli import app


def test_cpu_only_calibrate_writes_a_profile_that_makes_auto_pick_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    res = CliRunner().invoke(app, ["--shape", "256,96", "--threads", "1,2", "--working-set", "8M",
                                   "--seconds", "0.05", "--json"])
    assert res.exit_code == 0, res.output
    printed = json.loads(res.stdout[res.stdout.index("{"):])
    written = list((tmp_path / "cache" / "ftkit" / "profiles").glob("cpu-*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text()) == printed
    assert printed["gpu"] is None and printed["pcie_gbps"] is None
    assert printed["expert"] == {"dtype": "bfloat16", "shape": [256, 96], "slot_bytes": 4096 * 36}
    assert [r["threads"] for r in printed["rows"]] == [1, 2]
    assert all(r["cpu_gbps"] > 0 and r["pcie_overlapped_gbps"] is None for r in printed["rows"])
    profile = load_profile(written[0])  # the runtime reads what ft-calibrate wrote, all of it
    assert profile.to_dict() == printed and profile.path == written[0]
    bw = profile.bandwidths(2)
    assert bw.pcie_gbps is None and bw.ratio == 0.0 and bw.threads == 2
    write_random_ftw(tmp_path / "m.ftw", demo_spec(64))
    opts = RuntimeOptions(profile=written[0], threads=2)
    capsys.readouterr()
    got = resolve(FTWModel(tmp_path / "m.ftw"), opts, Machine(torch.device("cpu")))  # memory unknown: no fused
    assert (got.strategy, got.ratio, got.profile) == ("cpu", 0.0, profile)
    assert "ftkit: strategy cpu (auto: the profile has no PCIe figures" in capsys.readouterr().err


def test_calibrate_rejects_bad_options(tmp_path):
    for args in (["--shape", "2048"], ["--dtype", "int4"], ["--threads", "0"], ["--shape", "64,64", "--slot-bytes", "9M"]):
        res = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "p.json")])
        assert res.exit_code == 1 and "error" in res.output, (args, res.output)


def full_profile(tmp_path, pcie=50.0):
    rows = [{"threads": t, "cpu_gbps": 10.0 * t, "pcie_overlapped_gbps": None if pcie is None else 40.0,
             "cpu_overlapped_gbps": None if pcie is None else 8.0 * t, "dram_read_gbps": 12.0 * t} for t in (4, 8)]
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"schema": 1, "pcie_gbps": pcie, "rows": rows}))
    return path


def test_profile_rows_prefer_overlapped_figures_and_the_nearest_thread_count(tmp_path):
    path = full_profile(tmp_path)
    assert load_profile(path).bandwidths(8) == Bandwidths(40.0, 64.0, True, 8)
    assert load_profile(path).bandwidths(8, overlapped=False) == Bandwidths(50.0, 80.0, False, 8)
    with pytest.warns(UserWarning, match="measured at 4 CPU thread"):
        assert load_profile(path).bandwidths(5).threads == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_profile(path).bandwidths().threads == 8  # no thread count asked: the largest row, no warning
    path.write_text(json.dumps({"pcie_gbps": 30.0, "cpu_gbps": 60.0}))  # the minimal form
    minimal = load_profile(path)
    assert minimal.bandwidths() == Bandwidths(30.0, 60.0, False)
    assert minimal.to_dict()["cpu_gbps"] == 60.0 and minimal.mismatch(None, "any") is None  # it names no machine
    assert load_profile(full_profile(tmp_path, pcie=None)).bandwidths(8) == Bandwidths(None, 80.0, False, 8)


def test_the_committed_profile_reads_back_to_the_same_json():
    """The schema has one owner: the H200 profile ft-calibrate wrote comes back key for key."""
    path = Path(__file__).parents[1] / "docs" / "profiles" / "h200-16c.json"
    profile = load_profile(path)
    assert profile.to_dict() == json.loads(path.read_text())
    assert profile.gpu.name == "NVIDIA H200" and profile.mismatch(profile.gpu, profile.host) is None


def test_bad_profiles_are_one_line_errors(tmp_path):
    path = tmp_path / "p.json"
    for text, said in (("{", "not valid JSON"), ("[1]", "not a JSON object"), ('{"rows": [{"cpu_gbps": 1}]}', "no rows"),
                       ('{"rows": [{"threads": 1}], "gpu": {"uuid": "GPU-1"}}', "malformed")):
        path.write_text(text)
        with pytest.raises(ValueError, match=said):
            load_profile(path)
    with pytest.raises(FileNotFoundError, match="run ft-calibrate"):
        load_profile(tmp_path / "none.json")


def simulate(planner: Planner, fill_gbps: float, cpu_gbps: float, steps: int, m: int = 8,
             slot: int = 9 << 20) -> list[float]:
    """Layer times on a fake clock: fills and CPU experts run at once, the layer takes the longer."""
    times = []
    for _ in range(steps):
        q = planner.fill_count(m)
        fill_s, cpu_s = q * slot / (fill_gbps * 1e9), (m - q) * slot / (cpu_gbps * 1e9)
        planner.observe_fill(q * slot, fill_s)
        planner.observe_cpu((m - q) * slot, cpu_s)
        times.append(max(fill_s, cpu_s))
    return times


def best_time(fill_gbps: float, cpu_gbps: float, m: int = 8, slot: int = 9 << 20) -> float:
    return min(max(q * slot / fill_gbps, (m - q) * slot / cpu_gbps) for q in range(m + 1)) / 1e9


@pytest.mark.parametrize("true_fill,true_cpu", [(25.0, 40.0), (50.0, 20.0), (60.0, 30.0)])
def test_a_wrong_profile_converges_to_the_best_split(true_fill, true_cpu):
    """B_H ten times too high: hybrid starts by sending nearly everything to the CPU, then its own
    clock moves the split; within a few dozen layers it is within 10% of the best split, and never
    slower than the better of offload (q = m) and cpu (q = 0) for long."""
    wrong = Bandwidths(true_fill, true_cpu * 10, overlapped=True).ratio
    times = simulate(Planner("hybrid", wrong), true_fill, true_cpu, steps=36)
    best = best_time(true_fill, true_cpu)
    assert times[0] > 1.1 * best  # the profile really was wrong
    assert all(t <= 1.1 * best for t in times[12:]), [round(t / best, 2) for t in times]


def test_without_adapting_the_prior_is_kept():
    p = Planner("hybrid", 0.1, adapt=False)
    simulate(p, 25.0, 40.0, steps=10)
    assert p.rate_fraction == 0.1 and p.fill_count(8) == 1


def test_a_wide_spread_or_a_busy_machine_is_a_warning():
    """Windows of one measurement that differ by more than SPREAD_WARN (other work started on
    the CPU meanwhile), or a busy machine before measuring, are one warning line each."""
    from ftkit.tools.calibrate import measure

    line = measure.spread_warning("B_H at 4 thread(s)", [40.0, 41.0, 12.0, 4.0, 39.0])
    assert line == ("B_H at 4 thread(s) varied 10.2x within its measurement (4.0 to 41.0 GB/s over 5 "
                    "windows): something else used the CPU; measure again on an idle machine")
    assert measure.spread_warning("B_H", [10.0, 11.0, 12.0]) is None  # 1.2x: within SPREAD_WARN
    assert measure.spread_warning("B_H", [10.0]) is None
    assert measure.load_warning(7.5, 2) == ("the 1-minute load average is 7.5 on 2 cores: other work shares the "
                                            "CPU, so B_H will read low; measure on an idle machine")
    assert measure.load_warning(0.5, 2) is None


def test_a_model_of_mixed_layers_is_measured_in_every_layers_format(tmp_path):
    """`--model` on a llama-quantize mix: each call of the measurement runs one layer's experts
    in that layer's format, the layers in their proportions, and the profile names the formats."""
    from ftkit.tools.calibrate import measure

    spec = dataclasses.replace(demo_spec(64), hidden_size=256, moe_intermediate_size=256)
    formats = [("q4_k", "q4_k", "q6_k"), ("q4_k",) * 3, ("q4_k", "q4_k", "q6_k"), ("q8_0",) * 3]
    write_random_ftw(tmp_path / "m.ftw", spec, expert_formats=formats, distinct_experts=1)
    layouts = FTWModel(tmp_path / "m.ftw").layout.layers
    slots = measure.working_set(layouts, 1 << 20)
    cycle = measure.ExpertCycle(layouts, slots, tokens=1, per_call=2)
    seen = []
    for _ in range(8):
        taken = cycle.take()
        seen.append(cycle.layout.formats)
        for slot in taken:  # each expert of a call is in the call's layout
            row = next(i for i in range(len(slots)) if slot.data_ptr() == slots[i].data_ptr())
            assert layouts[row % len(layouts)] == cycle.layout
    assert seen == [lay.formats for lay in layouts] * 2
    res = CliRunner().invoke(app, ["--model", str(tmp_path / "m.ftw"), "--threads", "1", "--working-set", "4M",
                                   "--seconds", "0.05", "--json", "--out", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    printed = json.loads(res.stdout[res.stdout.index("{"):])
    assert printed["expert"]["dtype"] == "q4_k/q6_k/q8_0" and printed["rows"][0]["cpu_gbps"] > 0


def test_a_working_set_of_experts_with_biases():
    """gpt-oss's slots hold float32 biases (1-D parts) beside their MXFP4 blocks: the working set
    `--model` measures fills them too (it indexed a second dimension they lack: an IndexError on
    the GPU machine)."""
    from ftkit.tools.calibrate.measure import working_set
    from ftkit.vocab import slot_layout

    spec = dataclasses.replace(demo_spec(64), hidden_size=256, moe_intermediate_size=256, expert_bias=True,
                               swiglu_alpha=1.702, swiglu_limit=7.0)
    layout = slot_layout(spec, ("mxfp4", "mxfp4", "mxfp4"))
    biases = [p for p in layout.parts if len(p.shape) == 1]
    assert len(biases) == 3
    slots = working_set((layout,), 4 * layout.slot_bytes)
    assert slots.shape == (4, layout.slot_bytes)
    for p in biases:
        values = slots[0, p.offset : p.offset + p.nbytes].view(torch.float32)
        assert values.isfinite().all() and values.abs().sum() > 0
