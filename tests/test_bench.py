"""ft-bench on the tiny preset (CPU): results carry bounds; routing record/replay and reuse."""

from __future__ import annotations

import dataclasses
import gzip
import json
import subprocess
import sys

import pytest
import torch

from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.random_model import write_random_ftw
from ftkit.runtime.spec import FULL_ATTENTION, SLIDING_ATTENTION
from ftkit.tools.bench import run
from ftkit.tools.bench.presets import preset_spec
from ftkit.tools.bench.routing import Recorder, Replayer, Synthetic

BENCH = [sys.executable, "-m", "ftkit.tools.bench.cli"]
FIGS = run.Figures(pcie_gbps=50.0, cpu_gbps=80.0, hbm_gbps=None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.ftw"
    write_random_ftw(path, preset_spec("tiny"), distinct_experts=8)
    return path


def runtime(path, **kw) -> Runtime:
    return Runtime(path, RuntimeOptions(device="cpu", threads=2, **kw))


def test_cli_writes_results_with_bounds(tiny, tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([*BENCH, "decode", "-m", str(tiny), "--device", "cpu", "--cache-fraction", "0.35",
                        "--pcie-gbps", "50", "--cpu-gbps", "80", "--tokens", "8", "--chunks", "64",
                        "--extend", "8", "--answer", "4", "--repeat", "3", "--strategies", "offload,hybrid",
                        "--json", "--out", str(out), "--trace-dir", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert json.loads(r.stdout) == res and "ft-bench decode" in r.stderr  # --json: stdout is the JSON alone
    for strategy in ("offload", "hybrid"):  # the profiled steps after the timed ones, on the same K/V
        assert "Self CPU" in (tmp_path / f"profile-{strategy}-graphs-on.txt").read_text()
    assert [x["strategy"] for x in res["runs"]] == ["offload", "hybrid"]
    for x in res["runs"]:
        d = x["decode"]
        assert d["tok_s"] > 0 and d["bound_tok_s"] > d["tok_s"] and 0 < d["of_bound"] < 1
        assert d["hits"] + d["fills"] + d["cpu"] > 0 and x["prefill"][0]["chunk"] == 64
        p = x["prefill"][0]
        assert p["extend"] == 8 and p["answer"] == 4 and p["extend_seconds"] > 0 and 0 < p["extend_active"]
        assert 0 <= p["resident_kept"] <= 1 and p["first_seconds"] > 0
        for key in ("seconds", "extend_seconds"):  # the median of three timed turns
            assert len(p[key + "_all"]) == 3 and p[key] == sorted(p[key + "_all"])[1]
        # the extend's layer phases (host clock marks) lie within its timed span
        phases = [p[f"extend_{name}_ms"] for name in ("routing", "plan", "split", "cpu_wait", "merge", "between")]
        assert min(phases) >= 0 and 0 < sum(phases) <= 1000 * max(p["extend_seconds_all"])
        # the CPU tier shares its split at run time: no up-front fill fraction to report
        assert p["extend_fill_fraction"] is None and p["extend_fill_fraction_all"] == [None] * 3
        pool = x["host_pool"]  # the pool's pages as /proc has them (dev boxes run Linux)
        assert pool["resident_gib"] > 0 and 0 <= pool["huge_fraction"] <= 1 and sum(pool["numa_gib"].values()) >= 0


def test_hybrid_graph_decode_reports_both_sides(tiny):
    """Device-planned hybrid decode (graph steps run eagerly here) reports the two sides its
    split balances: the worker's compute time and rate over the timed layers with CPU items
    (the GPU clock reads 0 in the interpreter)."""
    from ftkit.runtime.engine.graphs import GraphDecode

    rt = runtime(tiny, strategy="hybrid", cache_experts=8, bandwidth_ratio=0.5)
    rt.step.graphs = GraphDecode(rt.decoder, rt.store, capacity=64, capture=False)
    d = run.decode(rt, 4, 4, None, FIGS)
    assert d["cpu"] > 0 and 0 < d["cpu_layers"] <= 4 * rt.spec.num_moe_layers
    assert d["cpu_side_ms_per_token"] > 0 and d["gpu_side_ms_per_token"] >= 0
    assert d["cpu_side_gbps"] == pytest.approx(d["cpu_gb_per_token"] / d["cpu_side_ms_per_token"] * 1e3)
    start, end = d["fill_fraction"]  # no GPU clock in the interpreter: the timed steps leave it put
    assert 0 < start == end <= 0.5
    rt.close()
    off = runtime(tiny, strategy="offload", cache_experts=8)
    assert run.decode(off, 2, 4, None, FIGS)["cpu_side_ms_per_token"] is None  # no CPU worker
    off.close()


def test_decode_batch_times_sequences_decoding_together(tiny):
    """`--batch`: several sequences through Step.batch, timed per step and over the batch; with
    graph decode (its steps eager here) the captured batched step, without the decoder's batch."""
    from ftkit.runtime.engine.graphs import GraphDecode

    rt = runtime(tiny, strategy="offload", cache_experts=16)
    for graphs in (False, True):
        if graphs:
            rt.step.graphs = GraphDecode(rt.decoder, rt.store, capacity=64, capture=False)
        d = run.decode_batch(rt, 1, 4, 2)
        assert d["batch"] == 2 and d["graphs"] == graphs and d["tok_s"] > 0
        assert d["tok_s"] == pytest.approx(2 * 1000 / d["ms_per_step"])
    rt.close()


def test_decode_bound_reads_one_embedding_row(tiny):
    """A decode step reads one row of an untied embedding table, not all of it (the bound
    counted the whole table per token until the eighth session: ~0.15 ms at the qwen3 shape)."""
    rt = runtime(tiny, strategy="offload", cache_experts=8)
    w, table = rt.decoder.w, rt.decoder.w["embed.weight"]
    assert not rt.spec.tie_word_embeddings and "lm_head.weight" in w
    every = sum(t.numel() * t.element_size() for t in w.values())
    assert run.step_dense_bytes(rt) == every - (table.shape[0] - 1) * table.shape[1] * table.element_size()
    rt.close()


def test_decode_bound_counts_the_keys_read(tiny):
    """Attention's K/V reads are GPU work the bound counts: keys 0..position of each layer, no
    more than the window in a sliding one; the bound adds them at the HBM rate."""
    rt = runtime(tiny, strategy="offload", cache_experts=8)
    s = rt.spec
    per_key = 2 * s.num_kv_heads * s.head_dim * rt.dtype.itemsize
    assert run.step_kv_bytes(rt, 9) == s.num_layers * 10 * per_key
    rt.decoder.spec = dataclasses.replace(s, layer_kinds=(SLIDING_ATTENTION,) + s.layer_kinds[1:], sliding_window=4)
    assert run.step_kv_bytes(rt, 9) == (s.num_layers - 1) * 10 * per_key + 4 * per_key
    rt.decoder.spec = s
    figs = dataclasses.replace(FIGS, hbm_gbps=1000.0)
    run.decode(rt, 2, 4, None, figs)
    stats = rt.store.stats
    extra = run._decode_bound(rt, stats, 2, figs, 1e6) - run._decode_bound(rt, stats, 2, figs, 0.0)
    assert extra == pytest.approx(1e6 / 1e12)
    rt.close()


def test_worker_bound_takes_the_faster_of_profile_and_worker(tiny):
    """A worker that streamed faster than the profile says tightens the bound to its rate; a
    slower one leaves the profile's bound."""
    rt = runtime(tiny, strategy="hybrid", cache_experts=8, bandwidth_ratio=0.5)
    stats, figs = rt.store.stats, dataclasses.replace(FIGS, pcie_gbps=1e4)  # the CPU side sets the bound
    for layer in rt.spec.moe_layers:  # counts as a run's (a real run's split moves with the machine's load)
        stats.add(layer, 2, 3, 4)
    bound = run._decode_bound(rt, stats, 4, figs, 0.0)
    assert run.worker_bound(rt, stats, 4, figs, 0.0, figs.cpu_gbps / 2) == bound
    faster = run.worker_bound(rt, stats, 4, figs, 0.0, 2 * figs.cpu_gbps)
    at = dataclasses.replace(figs, cpu_gbps=2 * figs.cpu_gbps, cpu_solo_gbps=2 * figs.cpu_gbps)
    assert faster < bound and faster == run._decode_bound(rt, stats, 4, at, 0.0)
    rt.close()


def test_prefill_runs_in_the_runtimes_pieces(tiny):
    """A prompt longer than the runtime's prefill chunk runs as ft-run runs it: one forward,
    layer by layer in pieces, into one cache; the same last logits and K/V as one piece (to
    rounding)."""
    import torch

    rt = runtime(tiny, strategy="offload", cache_experts=8)
    ids = torch.randint(0, rt.spec.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        whole = run.prefill_forward(rt, ids, kv := rt.new_kv(40))
        rt.prefill_chunk = 16
        pieces = run.prefill_forward(rt, ids, kv2 := rt.new_kv(40))
    assert kv.length == kv2.length == 40
    torch.testing.assert_close(pieces, whole, rtol=1e-3, atol=1e-3)
    for i in kv.k:
        torch.testing.assert_close(kv2.k[i][:40], kv.k[i][:40], rtol=1e-3, atol=1e-3)
    assert run.prefill(rt, 40, FIGS, answer=2)["pieces"] == 3
    rt.close()


def test_layer_by_layer_prefill_streams_each_layer_once(tiny):
    """Whole-layer streaming with a cache of two layers: a 48-token prompt in three 16-token
    forwards moves every layer three times; in one forward of three 16-token pieces a layer,
    each layer's experts cross once and serve all three pieces."""
    import torch

    from ftkit.runtime.prefix_cache.prefill import prefill

    e = preset_spec("tiny").num_experts
    ids = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    fills = {}
    for name in ("forwards", "pieces"):
        rt = runtime(tiny, strategy="offload", cache_experts=2 * e, stream_prefill=True)
        kv = rt.new_kv(48)
        with torch.inference_mode():
            if name == "forwards":  # as GPU prefill ran before a7a05dd
                for a in range(0, 48, 16):
                    logits = rt.step.forward(torch.tensor(ids[a : a + 16]), kv, last_only=True)[-1]
            else:
                logits, _ = prefill(rt.step, ids, kv, (), max_chunk=16)
        fills[name] = rt.store.stats.totals().fills
        assert kv.length == 48 and rt.store.cache.capacity == 2 * e
        fills[name + "_logits"] = logits
        rt.close()
    layers = preset_spec("tiny").num_moe_layers
    assert fills["pieces"] <= layers * e < 2 * layers * e < fills["forwards"]
    torch.testing.assert_close(fills["pieces_logits"], fills["forwards_logits"], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("strategy", ["cpu", "hybrid", "offload"])
def test_cpu_prefill_batches_experts_bitwise(tiny, strategy):
    """On CPU a prompt is cut at every 16-token page (bitwise prefix reuse); one forward with
    those cuts, the routed experts run once for all pages, gives the same bits (logits and K/V)
    as one forward per page, and reads each active expert once instead of once per page."""
    import torch

    from ftkit.runtime.prefix_cache.prefill import prefill

    ids = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    out, calls = {}, {}
    for name in ("pages", "batched"):
        rt = runtime(tiny, strategy=strategy, cache_experts=None if strategy == "cpu" else 24, bandwidth_ratio=0.5)
        cuts = rt.grid.scan(ids)
        seen = []
        real = rt.store.run
        rt.store.run = lambda *a, seen=seen, real=real, **kw: seen.append(a[1].shape[0]) or real(*a, **kw)
        kv = rt.new_kv(100)
        with torch.inference_mode():
            if name == "pages":  # as CPU prefill ran before
                for a, b in zip([0, *cuts], [*cuts, 100], strict=False):
                    if a < b <= 100:
                        logits = rt.step.forward(torch.tensor(ids[a:b]), kv, last_only=True)[-1]
            else:
                logits, _ = prefill(rt.step, ids, kv, cuts)
        out[name], calls[name] = (logits, kv), seen
        rt.close()
    assert torch.equal(out["batched"][0], out["pages"][0])
    for i in out["pages"][1].k:
        assert torch.equal(out["batched"][1].k[i][:100], out["pages"][1].k[i][:100])
    layers = preset_spec("tiny").num_moe_layers
    assert calls["batched"] == [100] * layers and len(calls["pages"]) == 7 * layers  # pages of 16


def test_presets_have_the_published_shapes():
    """Expert sizes and layer kinds of the presets (no weights written): the issue's
    qwen3-30b-a3b, and qwen3-next-80b-a3b cut to 4 layers as a benchmark would."""
    from ftkit.runtime.spec import LINEAR_ATTENTION
    from ftkit.vocab import slot_layout

    q3 = preset_spec("qwen3-30b-a3b", 12)
    assert (q3.num_layers, q3.num_experts, q3.top_k) == (12, 128, 8)
    assert slot_layout(q3, "bfloat16").slot_bytes == 3 * 2048 * 768 * 2  # 9.44 MB
    nxt = preset_spec("qwen3-next-80b-a3b", 4)
    assert nxt.layer_kinds == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert (nxt.num_experts, nxt.top_k, nxt.shared_expert_intermediate_size) == (512, 10, 512)
    assert slot_layout(nxt, "bfloat16").slot_bytes == 3 * 2048 * 512 * 2  # 6.29 MB
    with pytest.raises(ValueError, match="--layers must be in 1..48"):
        preset_spec("qwen3-next-80b-a3b", 49)
    oss = preset_spec("gpt-oss-20b", 4)
    assert oss.layer_kinds == ("sliding_attention", "full_attention") * 2 and oss.sliding_window == 128
    assert (oss.num_experts, oss.top_k, oss.expert_bias, oss.swiglu_limit) == (32, 4, True, 7.0)
    layout = slot_layout(oss, "bfloat16")  # 49.8 MB of matrices, then 34.6 KB of float32 biases
    matrices, bias = 3 * 2880 * 2880 * 2, 2880 * 4
    assert layout.part("down_bias").offset == matrices + 2 * bias
    assert layout.slot_bytes == -(-(matrices + 3 * bias) // 4096) * 4096
    assert preset_spec("gpt-oss-120b").num_experts == 128
    q35 = preset_spec("qwen3.5-35b-a3b", 4)  # the multimodal checkpoint's language model
    assert (q35.family, q35.layer_kinds) == ("qwen3_5_moe", (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,))
    assert (q35.num_experts, q35.top_k, q35.shared_expert_intermediate_size, q35.vocab_size) == (256, 8, 512, 248320)
    assert slot_layout(q35, "bfloat16").slot_bytes == 3 * 2048 * 512 * 2  # 6.29 MB


def test_write_gpt_oss_at_toy_sizes(tmp_path):
    """ft-bench write's path for gpt-oss (float32 bias parts in a bf16 slot), at toy sizes: the
    model loads and decodes."""
    oss = preset_spec("gpt-oss-20b", 2)
    spec = dataclasses.replace(oss, hidden_size=64, moe_intermediate_size=32, vocab_size=512, num_heads=4,
                               num_kv_heads=2, head_dim=16, num_experts=8)
    write_random_ftw(tmp_path / "m.ftw", spec, "bfloat16", distinct_experts=4)
    rt = runtime(tmp_path / "m.ftw", strategy="hybrid", cache_experts=2, bandwidth_ratio=0.5)
    with torch.inference_mode():
        logits = rt.step.forward(torch.arange(20), rt.new_kv(20))
    assert logits.shape == (20, 512) and logits.isfinite().all()
    rt.close()


def test_record_then_replay_reproduces_routing(tiny, tmp_path):
    rt = runtime(tiny, strategy="offload", cache_experts=20)
    rec = Recorder(rt.decoder)
    first = run.decode(rt, 6, 4, rec, FIGS)
    rec.save(tmp_path / "trace.json")
    rt.close()
    rt = runtime(tiny, strategy="offload", cache_experts=20)
    again = run.decode(rt, 6, 4, Replayer(rt.decoder, tmp_path / "trace.json"), FIGS)
    rt.close()
    assert (first["hits"], first["fills"], first["cpu"]) == (again["hits"], again["fills"], again["cpu"])


def test_reuse_knob_moves_the_hit_rate(tiny):
    rates = []
    for reuse in (0.0, 0.9):
        rt = runtime(tiny, strategy="offload", cache_experts=20)
        rates.append(run.decode(rt, 24, 4, Synthetic(rt.decoder, reuse, seed=1), FIGS)["miss_rate"])
        rt.close()
    assert rates[1] < rates[0] / 2


@pytest.mark.parametrize("k", [3, 8, 10])
def test_synthetic_routing_picks_in_one_launch_as_torch_does(k):
    """The CUDA pick (here through Triton's interpreter) gives the torch path's ids, weights and
    cursor, across the sequence's wrap."""
    from ftkit.tools.bench.routing import pick

    rows = torch.randint(0, 64, (11, k))
    cursors = [torch.tensor(7), torch.tensor(7)]
    for t in (1, 3, 8, 1):
        want, got = (pick(rows, c, t, torch.bfloat16, kernel=kernel) for c, kernel in zip(cursors, (False, True), strict=True))
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]) and got[1].dtype == torch.bfloat16
        assert int(cursors[0]) == int(cursors[1])


def test_timeline_splits_a_trace_by_routing_read_back(tmp_path):
    """Two host-planned layers in a Chrome trace as torch.profiler writes it (times in us)."""
    from ftkit.tools.bench import timeline

    def ev(name, ts, dur, cat="gpu_memcpy", nbytes=0):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"bytes": nbytes}}

    back, fill, mib = "Memcpy DtoH (Device -> Pageable)", "Memcpy HtoD (Pinned -> Device)", 2**20
    events = [
        ev(back, 0, 10), ev(fill, 110, 200, nbytes=10 * mib), ev("Memcpy HtoD (Pinned -> Device)", 320, 5, nbytes=64),
        ev(fill, 400, 200, nbytes=10 * mib), ev("_wait_word", 650, 50, cat="kernel"),
        ev(back, 890, 10), ev(fill, 1200, 100, nbytes=5 * mib), ev(back, 1500, 20),
        ev(fill, 1600, 100, nbytes=mib // 2),  # below --min-bytes: not a fill, so no third layer
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [{"ph": "M", "name": "process_name"}, *reversed(events)]}, f)
    rows = timeline.layers(timeline.load(path))
    assert len(rows) == 2
    first, second = rows
    assert first["plan"] == pytest.approx(0.1) and first["lead_idle"] == pytest.approx(0.09)
    assert first["fills"] == pytest.approx(0.49) and first["copying"] == pytest.approx(0.4)
    assert first["fill_gbps"] == pytest.approx(20 * mib / 400 / 1e3)
    assert first["done_wait"] == pytest.approx(0.05) and first["tail"] == pytest.approx(0.3)
    assert second["lead_idle"] is None and second["tail"] == pytest.approx(0.22)
    assert timeline.means(rows)["lead_idle"] == pytest.approx(0.09)
    out = subprocess.run([sys.executable, "-m", "ftkit.tools.bench.timeline", str(path), "--json", str(tmp_path / "t.json")],
                         capture_output=True, text=True, check=True)
    assert "2 layers with fills" in out.stdout
    assert json.loads((tmp_path / "t.json").read_text())["means"]["plan"] == pytest.approx((0.1 + 0.3) / 2)
    # idle: the span 0..1700 us less the busy union (10+200+5+200+50+10+100+20+100 us)
    gaps = timeline.idle(timeline.load(path))
    assert gaps["span_ms"] == pytest.approx(1.7) and gaps["busy_ms"] == pytest.approx(0.695)
    assert gaps["idle_ms"] == pytest.approx(1.005)
    assert gaps["gaps"][0] == [back, fill, 3, pytest.approx(0.1 + 0.3 + 0.08)]  # read-back -> fill, 3 times
    assert "idle 1.00" in out.stdout


def test_timeline_idle_merges_overlapping_events():
    """Events on two streams that overlap count once; a gap is measured from the latest end."""
    from ftkit.tools.bench import timeline

    events = [{"name": "a", "ts": 0, "dur": 100}, {"name": "copy", "ts": 50, "dur": 200},
              {"name": "b", "ts": 120, "dur": 10}, {"name": "c", "ts": 300, "dur": 50}]
    gaps = timeline.idle(events)
    assert gaps["busy_ms"] == pytest.approx(0.3) and gaps["idle_ms"] == pytest.approx(0.05)
    assert gaps["gaps"] == [["copy", "c", 1, pytest.approx(0.05)]]


def test_pool_pages_reads_smaps_and_numa_maps(tmp_path):
    """Only the mappings that hold the buffers count: their resident and huge KiB from smaps,
    their pages per node (at the mapping's page size) from numa_maps."""
    import torch

    from ftkit.tools.bench.hostmem import pool_pages

    buf = torch.empty(1 << 20, dtype=torch.uint8)
    a, b = buf.data_ptr(), buf.data_ptr() + buf.numel()
    (tmp_path / "smaps").write_text(
        f"{a:x}-{b:x} rw-p 00000000 00:00 0\nRss:  1024 kB\nAnonHugePages:  512 kB\n"
        f"{b:x}-{b + 4096:x} rw-p 00000000 00:00 0\nRss:  4 kB\nAnonHugePages:  0 kB\n")
    (tmp_path / "numa_maps").write_text(
        f"{a:x} default anon=256 dirty=256 N0=128 N1=1 kernelpagesize_kB=2048\n"
        f"{b:x} default anon=1 N0=1 kernelpagesize_kB=4\n")
    got = pool_pages([buf], tmp_path)
    assert got == {"resident_gib": 1024 / 2**20, "huge_fraction": 0.5, "numa_gib": {"N0": 0.25, "N1": 0.0}}
    assert pool_pages([buf], tmp_path / "missing") is None


def test_serve_drives_the_real_server_beside_the_engine(tiny, tmp_path):
    """ft-bench serve: `ft-run serve` in its own process, driven through the openai SDK; every
    scenario's figures and the server's own account of each request, beside the engine's."""
    out = tmp_path / "serve.json"
    r = subprocess.run([*BENCH, "serve", "-m", str(tiny), "--lengths", "40,80", "--tokens", "6", "--turns", "2",
                        "--suffixes", "8,40", "--concurrent", "2", "--shared", "32", "--own", "16", "--first", "24",
                        "--strategy", "hybrid", "--cache-experts", "16", "--bandwidth-ratio", "0.5", "--threads", "1",
                        "--log", str(tmp_path / "serve.log"), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "through the server" in r.stdout and "Traceback" not in r.stderr
    res = json.loads(out.read_text())
    assert [x["prompt"] for x in res["single"]] == [40, 80] and len(res["first"]) == 2
    for x in [*res["first"], *res["single"]]:
        assert x["tokens"] == 6 and x["ttft_s"] > 0 and x["decode_tok_s"] > 0
        assert x["server"]["prefill_seconds"] > 0
    for suffix, turns in res["agent"].items():
        assert [t["prompt"] for t in turns] == [80 + k * int(suffix) for k in range(2)]
        assert turns[0]["cached"] == 0 and all(t["cached"] >= t["prompt"] - int(suffix) - 16 for t in turns[1:])
    c = res["concurrent"]
    assert len(c["streams"]) == 2 and c["aggregate_tok_s"] > 0 and all(s["tokens"] == 6 for s in c["streams"])
    assert c["alone"]["cached"] > 0  # after the untimed lone stream, its shared prefix is a hit
    assert "overlap_tok_s" in c and not any("times" in s for s in [c["alone"], *c["streams"], *res["single"]])
    # the server's counters over the streams alone: their prompts in one or two prefill forwards,
    # the batched steps' tokens among the decoded ones and a rate where they took time
    assert 1 <= c["prefill_forwards"] <= 2 and 0 <= c["decode_batch_tokens"] <= c["decode_batched_tokens"] <= 12
    assert (c["batched_tok_s"] is None) == (c["decode_batch_seconds"] == 0)
    eng = res["engine"]
    assert set(eng["extend_s"]) == {"8", "40"} and eng["80"]["prefill_s"] > 0 and eng["40"]["decode_tok_s"] > 0
    for suffix, turns in res["agent"].items():  # the engine's extend: what the server's turn 2 computed
        assert eng["extend_tokens"][suffix] == turns[1]["prompt"] - turns[1]["cached"] >= int(suffix)


def test_serve_refuses_prompts_past_the_context_before_starting(tiny, tmp_path):
    """A workload whose prompts overrun the model's context is one line naming the option, not a
    server started and a traceback from the SDK's 400."""
    r = subprocess.run([*BENCH, "serve", "-m", str(tiny), "--lengths", "40,1000000", "--no-engine",
                        "--log", str(tmp_path / "serve.log")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--lengths: a 1000000-token prompt" in r.stderr and "context" in r.stderr
    assert not (tmp_path / "serve.log").exists()


def test_sweep_writes_points_and_charts(tiny, tmp_path):
    """ft-bench sweep: a point per strategy and cache fraction (cpu once), one per thread count,
    each beside its bound, and SVG charts that parse, a line per figure and per bound."""
    import xml.etree.ElementTree as ET

    out = tmp_path / "sweep"
    r = subprocess.run([*BENCH, "sweep", "-m", str(tiny), "--device", "cpu", "--strategies", "offload,hybrid,cpu",
                        "--fractions", "0.25,0.5", "--thread-counts", "1,2", "--tokens", "4", "--chunk", "32",
                        "--pcie-gbps", "50", "--cpu-gbps", "80", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr + r.stdout
    data = json.loads((out / "sweep.json").read_text())
    assert [(p["strategy"], p["fraction"]) for p in data["cache"]] == [
        ("offload", 0.25), ("offload", 0.5), ("hybrid", 0.25), ("hybrid", 0.5), ("cpu", 0.25)]
    assert data["cache"][0]["cache_slots"] < data["cache"][1]["cache_slots"]
    assert all(p["tok_s"] > 0 and p["bound_tok_s"] and p["prefill_tok_s"] > 0 for p in data["cache"])
    assert [p["threads"] for p in data["threads"]] == [1, 2] and data["routing"] == "reuse:0"
    ns = "{http://www.w3.org/2000/svg}"
    cache = ET.parse(out / "cache.svg").getroot()
    assert len(cache.findall(f"{ns}polyline")) == 6  # three strategies and their bounds
    assert len(ET.parse(out / "threads.svg").getroot().findall(f"{ns}polyline")) == 2


def test_write_gguf_for_llama_cpp(tmp_path):
    """`ft-bench write --gguf`: a bf16 GGUF of the preset with a vocabulary, which ft-diagnose
    passes (llama-quantize quantizes it on the GPU machine); with --quant, one line: that file
    is quantized by llama-quantize."""
    from ftkit.tools.diagnose.report import diagnose

    out = tmp_path / "tiny.gguf"
    r = subprocess.run([*BENCH, "write", "-o", str(out), "--preset", "tiny", "--gguf"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}: 4 layers x 16 experts (tiny), bfloat16" in " ".join(r.stdout.split())
    assert diagnose(out)["verdict"] == "PASS"
    r = subprocess.run([*BENCH, "write", "-o", str(tmp_path / "q.gguf"), "--preset", "tiny", "--gguf", "--quant",
                        "q4_k_m"], capture_output=True, text=True)
    assert r.returncode == 1 and "quantize the file with llama-quantize" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "q.gguf").exists()


def test_write_quantized_lays_experts_out_as_llama_quantize(tmp_path):
    """`ft-bench write --quant q4_k_m`: the experts in GGUF blocks as llama-quantize's preset lays
    them out per layer (ffn_down q6_k on the layers use_more_bits picks), the dense tensors as it
    stores them, and the model runs on the cpu strategy."""
    from ftkit.runtime.checkpoint.quant_presets import expert_formats, use_more_bits
    from ftkit.runtime.ftw.reader import FTWModel

    spec = dataclasses.replace(preset_spec("tiny"), hidden_size=256, moe_intermediate_size=256, num_heads=8)
    assert expert_formats(spec, "q4_k_m") == [
        ("q4_k", "q4_k", "q6_k" if use_more_bits(i, spec.num_layers) else "q4_k") for i in spec.moe_layers]
    out = tmp_path / "q.ftw"
    r = subprocess.run([*BENCH, "write", "-o", str(out), "--preset", "tiny", "--quant", "q4_k_m",
                        "--distinct-experts", "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    model = FTWModel(out)
    assert [lay.formats for lay in model.layout.layers] == expert_formats(model.spec, "q4_k_m")
    assert "experts " + model.layout.describe() in " ".join(r.stdout.split())
    # the dense tensors as the preset stores them too: attention, embedding and lm_head in blocks
    # (128-wide rows: Q4_K's fallback Q5_0, Q6_K's Q8_0), norms and routers as floats
    dense = {n: t["dtype"] for n, t in model.manifest.dense["tensors"].items()}
    assert (dense["embed.weight"], dense["lm_head.weight"], dense["layers.0.attn.q.weight"]) == ("q5_0", "q8_0", "q5_0")
    assert dense["layers.0.router.weight"] == dense["final_norm.weight"] == "bfloat16"
    rt = runtime(out, strategy="cpu")
    assert rt.pool.nbytes == model.spec.num_expert_rows * model.layout.slot_bytes
    from ftkit.runtime.engine.generate import generate
    from ftkit.runtime.engine.sampling import SamplingParams

    assert len(generate(rt, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)).token_ids) == 4


def test_cpu_experts_compares_kernel_sources_in_one_process(tmp_path):
    """`cpu_experts --compare`: the kernel built from each source copy, alternated round by round;
    each source's figures and mean, all positive (two copies of the kernel's own source here)."""
    from ftkit.kernels.cpu import HEADERS, SOURCE, load

    if load() is None:
        pytest.skip("no C++ compiler")
    copies = []
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        for f in (SOURCE, *(SOURCE.with_name(h) for h in HEADERS)):
            (d / f.name).write_bytes(f.read_bytes())
        copies.append(str(d / SOURCE.name))
    r = subprocess.run([sys.executable, "-m", "ftkit.tools.bench.cpu_experts", "--compare", *copies, "--threads", "1",
                        "--rounds", "2", "--gib", "0.02", "--seconds", "0.05", "--dtype", "q4_k_m", "--int8",
                        "--no-torch"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    means = [line for line in r.stdout.splitlines() if " mean " in line]
    assert len(means) == 2 and all(float(line.split("mean ")[1].split()[0]) > 0 for line in means), r.stdout
    assert sum("round " in line for line in r.stdout.splitlines()) == 4
