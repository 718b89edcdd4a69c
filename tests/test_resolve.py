"""Options resolved once: the device, the profile ft-calibrate wrote for the GPU at hand, the
strategy `auto` picks and why, the cache size, each said in one line. The machine comes in as
values (a GPU's identity, its free memory, the profile folder), so CUDA's cases run on CPU."""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import struct

import pytest
import torch

from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.resolve import Machine, default_dtype, resolve
from ftkit.runtime.ftw.manifest import DENSE_FILE, MANIFEST, Bank, Manifest, write_json_atomic
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.models import FAMILIES
from ftkit.runtime.profile import GPU, Profile, Row, default_path
from ftkit.runtime.random_model import demo_spec, write_random_ftw
from ftkit.tools.bench.presets import preset_spec
from ftkit.vocab import expert_layout

H200 = GPU("NVIDIA H200", "GPU-d5fe117f-c655-3062-2203-5852ae54eee3")
GiB = 1 << 30


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> FTWModel:
    path = tmp_path_factory.mktemp("resolve") / "m.ftw"
    write_random_ftw(path, demo_spec(300))  # 64 expert rows of 192 KiB (float32)
    return FTWModel(path)


@pytest.fixture(scope="module")
def q12(tmp_path_factory) -> FTWModel:
    """A 16 GB model as a header-only stub: qwen3-30b-a3b's shapes cut to 12 layers, bf16 (the
    benchmarks' q12); resolving reads the manifest alone."""
    path = tmp_path_factory.mktemp("q12") / "q12.ftw"
    path.mkdir()
    spec, dtype = preset_spec("qwen3-30b-a3b", 12), "bfloat16"
    shapes = FAMILIES[spec.family].dense_shapes(spec)
    manifest = Manifest(spec, expert_layout(spec, dtype), [Bank("experts-000.ftwb", 0, spec.num_expert_rows, "0" * 64)],
                        {"file": DENSE_FILE, "sha256": "0" * 64,
                         "tensors": {n: {"dtype": dtype, "shape": list(s)} for n, s in shapes.items()}},
                        {}, "test", {"kind": "stub"})
    write_json_atomic(path / MANIFEST, manifest.to_dict())
    (path / "experts-000.ftwb").touch()
    header, at = {}, 0  # the dense file's header alone, as a header-only stub has it
    for name, shape in shapes.items():
        n = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    (path / DENSE_FILE).write_bytes(struct.pack("<Q", len(raw)) + raw)
    return FTWModel(path, allow_stub=True)


def calibrated(gpu: GPU, host: str, folder, ratio_pcie: float = 40.0) -> Profile:
    """A profile as ft-calibrate saves it for `gpu` on `host`, in `folder`."""
    profile = Profile(pcie_gbps=52.0, rows=(Row(4, 36.0, ratio_pcie, 20.0, 45.0),), gpu=gpu, host=host,
                      created="2026-12-03T10:00:00Z", tool="ft-calibrate test")
    profile.save(default_path(gpu, folder))
    return profile


def lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("strategy,slots", [("fused", 64), ("offload", 16), ("cpu", 0), ("hybrid", 16)])
def test_each_strategy_resolves_as_asked(model, capsys, strategy, slots):
    opts = RuntimeOptions(strategy=strategy, cache_experts=16, bandwidth_ratio=0.5, threads=2)
    got = resolve(model, opts, Machine(torch.device("cpu"), free_bytes=64 * GiB))
    assert (got.strategy, got.cache_slots, got.device, got.dtype) == (strategy, slots, torch.device("cpu"), torch.float32)
    assert got.ratio == 0.5 and got.profile is None and got.threads == 2 and got.kv_tokens == opts.kv_tokens
    assert lines(capsys) == []  # asked, not chosen: nothing to say


def test_auto_on_the_cpu_is_cpu_even_when_every_expert_fits(model, capsys):
    """The device tier is host memory there: a second copy of every expert buys nothing."""
    pool = 64 * model.layout.slot_bytes  # on the CPU the host pool shares the RAM: it comes off first
    got = resolve(model, RuntimeOptions(), Machine(torch.device("cpu"), free_bytes=pool + 64 * GiB))
    assert (got.strategy, got.cache_slots, got.memory.budget_bytes) == ("cpu", 0, 64 * GiB)
    assert lines(capsys) == ["ftkit: strategy cpu (auto: the device tier is host memory; all 64 experts fit the "
                             "64.00 GiB of host memory free beside the host pool)"]


def test_auto_picks_hybrid_with_a_ratio_when_the_experts_do_not_all_fit(model, capsys):
    room = resolve(model, RuntimeOptions(strategy="cpu"), Machine(torch.device("cpu"))).memory
    budget = room.total_bytes + 16 * room.slot_bytes  # a quarter of the experts beside the rest
    got = resolve(model, RuntimeOptions(bandwidth_ratio=0.5), Machine(torch.device("cpu")), budget=budget)
    assert (got.strategy, got.ratio, got.cache_slots) == ("hybrid", 0.5, 64)  # the cache as asked: all rows
    assert lines(capsys)[-1] == ("ftkit: strategy hybrid (auto: --bandwidth-ratio 0.5; 25% of experts fit the "
                                 f"device budget of {budget / 2**20:.2f} MiB)")


def test_auto_without_room_or_ratio_picks_as_before(model, capsys):
    """cpu where the device tier is host memory, offload on a GPU; and a smaller cache asked
    for is kept (never fused over it)."""
    assert resolve(model, RuntimeOptions(), Machine(torch.device("cpu"))).strategy == "cpu"
    assert lines(capsys) == ["ftkit: strategy cpu (auto: the device tier is host memory; "
                             "the device's free memory is unknown)"]
    got = resolve(model, RuntimeOptions(device="cuda", cache_experts=8), Machine(torch.device("cuda"), free_bytes=GiB))
    assert (got.strategy, got.cache_slots, got.device) == ("offload", 8, torch.device("cuda"))
    assert lines(capsys) == ["ftkit: strategy offload (auto: no profile for this GPU (run ft-calibrate) and no "
                             "--bandwidth-ratio; --cache-experts 8 asked; all 64 experts fit the GPU's 1.00 GiB free)"]


def test_a_16gb_model_on_an_h200_is_fused_and_on_a_small_gpu_hybrid(q12, tmp_path, capsys):
    calibrated(H200, "box", tmp_path)
    opts = RuntimeOptions(device=None, find_profile=True, threads=4)
    got = resolve(q12, opts, Machine(torch.device("cuda"), H200, 139 * GiB, "box", tmp_path))
    assert got.strategy == "fused" and got.cache_slots == q12.spec.num_expert_rows
    assert 16e9 < got.memory.dense_bytes + got.memory.expert_bytes < 17e9
    assert got.profile.gpu == H200 and got.ratio == 40.0 / 60.0
    said = lines(capsys)
    assert said[0] == f"ftkit: profile {default_path(H200, tmp_path)} (calibrated 2026-12-03)"
    assert said[1] == "ftkit: strategy fused (auto: all 1536 experts fit the GPU's 139.00 GiB free)"
    got = resolve(q12, opts, Machine(torch.device("cuda"), H200, 8 * GiB, "box", tmp_path))
    assert got.strategy == "hybrid"
    said = lines(capsys)[1]
    assert said.startswith("ftkit: strategy hybrid (auto: profile ratio 0.67; ") and said.endswith(
        "% of experts fit the GPU's 8.00 GiB free)")


def test_the_cpu_strategy_on_a_gpu_gets_two_layers_of_staging_slots(q12, tmp_path, capsys):
    """On a GPU the cpu strategy keeps two layers of expert slots, where long prompts stream
    whole layers through and run (resolve.prefill_staging); none where streaming is off, and
    none with a line where the budget leaves less room. The CPU device has none."""
    two = 2 * q12.spec.num_experts
    opts = RuntimeOptions(device="cuda", strategy="cpu", threads=4)
    got = resolve(q12, opts, Machine(torch.device("cuda"), H200, 24 * GiB, "box", tmp_path))
    assert (got.strategy, got.cache_slots) == ("cpu", two) and got.memory.fits
    off = resolve(q12, dataclasses.replace(opts, stream_prefill=False), Machine(torch.device("cuda"), H200, 24 * GiB, "box", tmp_path))
    assert off.cache_slots == 0
    lines(capsys)
    rest = off.memory.total_bytes
    tight = resolve(q12, opts, Machine(torch.device("cuda"), H200, rest + (two - 1) * q12.layout.slot_bytes, "box", tmp_path))
    assert tight.cache_slots == 0
    assert "ftkit: strategy cpu: no room for two layers of experts (2.25 GiB) beside the rest of the plan: " \
           "long prompts run on the CPU too" in lines(capsys)
    assert resolve(q12, dataclasses.replace(opts, device="cpu"), Machine(torch.device("cpu"), free_bytes=64 * GiB)).cache_slots == 0


def test_the_profile_is_found_by_the_gpu_and_refused_from_another_machine(model, tmp_path, capsys):
    opts = RuntimeOptions(device="cuda", strategy="offload", find_profile=True, threads=4)
    here = Machine(torch.device("cuda"), H200, None, "box", tmp_path)
    assert resolve(model, opts, here).profile is None and lines(capsys) == []  # none calibrated: nothing said
    calibrated(H200, "other-box", tmp_path)
    assert resolve(model, opts, here).profile is None
    assert lines(capsys) == [f"ftkit: not using profile {default_path(H200, tmp_path)}: it was measured on host "
                             "other-box, not this one (box) (run ft-calibrate here)"]
    moved = calibrated(GPU("NVIDIA H200", "GPU-another"), "box", tmp_path)
    default_path(moved.gpu, tmp_path).rename(default_path(H200, tmp_path))  # a copy under this GPU's name
    assert resolve(model, opts, here).profile is None
    assert "measured on NVIDIA H200 GPU-another, not this GPU" in lines(capsys)[0]
    mine = calibrated(H200, "box", tmp_path)
    assert resolve(model, opts, here).profile == mine
    for skip in (dataclasses.replace(opts, find_profile=False), dataclasses.replace(opts, bandwidth_ratio=0.3)):
        assert resolve(model, skip, here).profile is None  # --no-profile, or a ratio given
    assert resolve(model, opts, Machine(torch.device("cpu"), host="box", profiles=tmp_path)).profile is None
    other_gpu = Machine(torch.device("cuda"), GPU("NVIDIA H200", "GPU-2"), None, "box", tmp_path)
    assert resolve(model, opts, other_gpu).profile is None


def test_an_explicit_profile_from_another_machine_is_used_and_said(model, tmp_path, capsys):
    path = default_path(H200, tmp_path)
    calibrated(H200, "vm", tmp_path)
    got = resolve(model, RuntimeOptions(profile=path, threads=4), Machine(torch.device("cpu"), host="box"))
    assert got.profile.host == "vm" and got.strategy == "hybrid"
    assert lines(capsys)[0] == (f"ftkit: profile {path} was measured on host vm, not this one (box): its figures "
                                "are only a start")


def test_the_device_defaults_to_a_gpu_when_there_is_one():
    assert Machine.detect(None).device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert Machine.detect("cpu").device == torch.device("cpu") and Machine.detect("cpu").host == platform.node()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda, but no CUDA device is available"):
            Machine.detect("cuda")


def test_bad_options_are_refused_before_loading(model):
    cpu = Machine(torch.device("cpu"))
    for opts, said in ((RuntimeOptions(strategy="magic"), "unknown strategy"),
                       (RuntimeOptions(cache_experts=4, gpu_budget=GiB), "give one of"),
                       (RuntimeOptions(strategy="offload", cache_experts=0), "at least one expert slot"),
                       (RuntimeOptions(prefill_chunk=0), "--prefill-chunk")):
        with pytest.raises(ValueError, match=said):
            resolve(model, opts, cpu)


def test_the_runtime_is_built_from_what_was_resolved(model):
    got = resolve(model, RuntimeOptions(strategy="hybrid", cache_experts=12, bandwidth_ratio=0.25, threads=1),
                  Machine(torch.device("cpu")))
    rt = Runtime(model, got)
    try:
        assert rt.ftw is model and rt.resolved is got and rt.opts is got.options
        assert (rt.store.strategy, rt.store.cache.capacity, rt.store.planner.start_fraction, rt.store.cpu.threads) == ("hybrid", 12, 0.25, 1)
    finally:
        rt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_at_hand_the_16gb_model_is_fused(q12, capsys):
    """The real machine: cuda by default, the GPU known by its uuid, its free memory read."""
    machine = Machine.detect(None)
    assert machine.device.type == "cuda" and machine.gpu.uuid.startswith("GPU-") and machine.free_bytes > 0
    if machine.free_bytes < 24 * GiB:
        pytest.skip("the GPU has less than 24 GiB free")
    got = resolve(q12, RuntimeOptions(device=None, threads=4), machine)
    assert got.strategy == "fused" and got.device.type == "cuda"
    assert lines(capsys)[-1].startswith("ftkit: strategy fused (auto: all 1536 experts fit the GPU's ")


@pytest.fixture(scope="module")
def q4(tmp_path_factory) -> FTWModel:
    """A model whose experts keep GGUF blocks: gate and up q4_k, down q6_k (Q4_K_M's)."""
    path = tmp_path_factory.mktemp("q4") / "q4.ftw"
    spec = dataclasses.replace(demo_spec(300), hidden_size=256, moe_intermediate_size=256)
    # one expert quantized a layer, then cycled: only the layout matters here (K-quants in torch are slow)
    write_random_ftw(path, spec, expert_formats=[("q4_k", "q4_k", "q6_k")] * spec.num_moe_layers, distinct_experts=1)
    return FTWModel(path)


@pytest.mark.parametrize("strategy", ["offload", "hybrid", "fused"])
def test_gpu_strategies_take_block_slots(q4, strategy):
    """The GPU kernels decode GGUF blocks (issue 38): a GPU's expert tier takes a Q4_K_M layout."""
    machine = Machine(torch.device("cuda"), H200, 139 * GiB)
    assert resolve(q4, RuntimeOptions(device="cuda", strategy=strategy, bandwidth_ratio=0.5), machine).strategy == strategy


def test_auto_on_a_gpu_runs_block_slots_there(q4):
    """auto decides for block slots as for float ones: every expert fits the GPU, so fused; a
    budget that holds some of them, hybrid by the ratio."""
    gpu = Machine(torch.device("cuda"), H200, 139 * GiB)
    got = resolve(q4, RuntimeOptions(device="cuda", bandwidth_ratio=0.5), gpu)
    assert (got.strategy, got.cache_slots) == ("fused", q4.spec.num_expert_rows)
    half = got.memory.total_bytes - q4.spec.num_expert_rows // 2 * q4.layout.slot_bytes
    some = resolve(q4, RuntimeOptions(device="cuda", bandwidth_ratio=0.5, gpu_budget=half), gpu)
    assert some.strategy == "hybrid" and 0 < some.cache_slots < q4.spec.num_expert_rows
    # on a CPU every strategy's device tier is host memory, where the CPU kernel reads blocks
    assert resolve(q4, RuntimeOptions(strategy="offload", cache_experts=8), Machine(torch.device("cpu"))).strategy == "offload"


def test_gguf_blocks_compute_in_bfloat16(monkeypatch):
    """Without --dtype a float model computes in its own dtype; a model whose dense tensors are
    GGUF blocks in bfloat16 (the CPU kernel's int8 activations, a GPU's halved dense reads and
    flash prefill), in float32 only on a CPU without the compiled kernel."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [default_dtype(f, cpu) for f in ("q4_k", "q8_0", "bfloat16", "float32")] == [
        "bfloat16", "bfloat16", "bfloat16", "float32"]
    monkeypatch.setattr("ftkit.runtime.engine.resolve.load", lambda: None)
    assert [default_dtype(f, cpu) for f in ("q4_k", "bfloat16")] == ["float32", "bfloat16"]
    assert [default_dtype(f, cuda) for f in ("q4_k", "mxfp4", "float16", "float32")] == [
        "bfloat16", "bfloat16", "float16", "float32"]
