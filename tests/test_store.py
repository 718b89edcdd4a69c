"""The invariant: the host pool is the source of truth. Any strategy, cache size or split gives
logits bitwise identical to `fused` on CPU in float32; the stats add up."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from ftkit.kernels.cpu import Kernel
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.resolve import Machine, resolve
from ftkit.runtime.experts.cache import SlotCache
from ftkit.runtime.experts.cpu import CPUExecutor
from ftkit.runtime.experts.dispatch import ExpertKernels
from ftkit.runtime.experts.planner import Planner, hybrid_fill_count
from ftkit.runtime.experts.streaming import LayerPrefetcher
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.profile import Bandwidths
from ftkit.tools.convert.pipeline import convert, prepare

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 140, 21, 77, 190, 2, 56, 203, 9, 33, 118]  # 4+ items per expert
DECODE = [33, 120, 7, 7, 201, 15, 80, 2]


@pytest.fixture(scope="module")
def ftw_models(hf_checkpoint, tmp_path_factory):
    out = {}
    for family in ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral"):
        path = tmp_path_factory.mktemp(family) / "m.ftw"
        convert(prepare(hf_checkpoint(family)), path)
        out[family] = path
    return out


def run_tokens(path, stream_prefill=False, **opts):
    """Logits for a prefill then single-token decode steps, plus per-step routing counts."""
    rt = Runtime(path, RuntimeOptions(trace_stats=True, threads=2, **opts))
    if stream_prefill:  # what CUDA does by default: whole layers copied one layer ahead
        rt.store.streaming.prefetcher = LayerPrefetcher(rt.pool, rt.device)
    distinct: list[dict[int, int]] = []
    real_run = rt.store.run

    def spy(layer, hidden, ids, weights, final=True):
        distinct[-1][layer] = int(torch.unique(ids).numel())
        return real_run(layer, hidden, ids, weights, final=final)

    rt.store.run = spy
    kv = rt.new_kv(len(PROMPT) + len(DECODE))
    logits = []
    with torch.inference_mode():
        for chunk in [PROMPT] + [[t] for t in DECODE]:
            distinct.append({})
            rt.store.stats.new_step()
            logits.append(rt.step.forward(torch.tensor(chunk), kv))
    rt.close()
    return torch.cat(logits), rt.store.stats, distinct


CONFIGS = [
    dict(strategy="cpu"),
    dict(strategy="offload", cache_experts=1),
    dict(strategy="offload", cache_experts=3),
    dict(strategy="offload", cache_experts=10),
    dict(strategy="offload"),  # cache = whole pool
    dict(strategy="hybrid", cache_experts=1, bandwidth_ratio=0.5),
    dict(strategy="hybrid", cache_experts=5, bandwidth_ratio=0.1),
    dict(strategy="hybrid", cache_experts=7, bandwidth_ratio=0.7),
    dict(strategy="hybrid", bandwidth_ratio=0.35),
    dict(strategy="auto", cache_experts=4, bandwidth_ratio=0.5),
]


def assert_strategies_match_fused(path) -> None:
    """Every config in CONFIGS gives logits bitwise equal to `fused`, with stats that add up;
    other families' test files call this too."""
    ref, _, _ = run_tokens(path, strategy="fused")
    for cfg in CONFIGS:
        got, stats, distinct = run_tokens(path, **cfg)
        assert torch.equal(got, ref), (cfg, (got - ref).abs().max())
        # Stats add up per layer and step, against an independent count of the routing.
        assert len(stats.steps) == len(distinct)
        for step, seen in zip(stats.steps, distinct, strict=False):
            assert step.keys() == seen.keys()
            for layer, c in step.items():
                assert c.hits + c.fills + c.cpu == c.active == seen[layer], (cfg, layer)
                if cfg["strategy"] == "cpu":
                    assert c.hits == c.fills == 0
                if cfg["strategy"] == "hybrid" and c.misses and cfg.get("cache_experts", 99) > 1:
                    assert c.fills >= 1


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"])
def test_every_strategy_matches_fused_bitwise(ftw_models, family):
    assert_strategies_match_fused(ftw_models[family])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_prefill_layer_streaming_is_exact(ftw_models, family):
    """Whole layers copied ahead (the prompt routes 5 items per expert), then decode steps that
    move only their misses: the same bits as fused."""
    ref, _, _ = run_tokens(ftw_models[family], strategy="fused")
    for cfg in (dict(strategy="offload", cache_experts=16), dict(strategy="hybrid", cache_experts=20,
                                                              bandwidth_ratio=0.3)):
        got, stats, distinct = run_tokens(ftw_models[family], stream_prefill=True, **cfg)
        assert torch.equal(got, ref), cfg
        prefill = stats.steps[0]
        first = min(prefill)  # decides from its own routing; later layers arrive copied in
        assert all(c.cpu == 0 and c.hits + c.fills == c.active for layer, c in prefill.items() if layer != first)
        for step, seen in zip(stats.steps, distinct, strict=True):
            assert all(c.hits + c.fills + c.cpu == c.active == seen[layer] for layer, c in step.items())


@pytest.mark.parametrize("cfg", [dict(strategy="cpu"), dict(strategy="cpu", dtype="bfloat16"),
                                 dict(strategy="hybrid", cache_experts=5, bandwidth_ratio=0.5)])
def test_a_cpu_device_runs_every_expert_call_on_the_calling_thread(ftw_models, monkeypatch, cfg):
    """On a CPU device nothing overlaps the CPU branch, so its experts run on the thread of the
    forward, in that thread's OpenMP team: on another thread (the pool's, or the runner's
    beside hybrid's shared split) a second team took the same cores, and the cpu strategy ran
    1.2x, the demo's hybrid 15x slower."""
    calls = []
    real = ExpertKernels.host

    def host(self, *args, **kwargs):
        calls.append(threading.get_ident())
        return real(self, *args, **kwargs)

    def elsewhere(*args, **kwargs):
        raise AssertionError("a CPU device's experts went to another thread")

    monkeypatch.setattr(ExpertKernels, "host", host)
    monkeypatch.setattr(CPUExecutor, "start", elsewhere)
    monkeypatch.setattr(Kernel, "start_experts", elsewhere)
    run_tokens(ftw_models["qwen3_moe"], **cfg)
    assert calls and set(calls) == {threading.get_ident()}


def test_the_cpu_strategy_runs_long_prompts_in_its_staging_slots(ftw_models):
    """The cpu strategy as a GPU resolves it, with device slots: two layers' (streamed a layer
    ahead; here every row) or one layer's (on-demand fills). A prompt of over CPU_MAX_TOKENS
    items per expert fills every miss and runs none on the CPU; decode steps fill nothing, run
    their misses on the CPU and use the rows the prompt left resident. The same bits as fused,
    prompt and steps."""
    path = ftw_models["qwen3_moe"]
    prompt, e = PROMPT * 5, FTWModel(path).spec.num_experts  # 100 tokens: 25 items per expert

    def run(strategy: str, slots: int = 0):
        r = resolve(FTWModel(path), RuntimeOptions(trace_stats=True, threads=2, strategy=strategy),
                    Machine(torch.device("cpu")))
        rt = Runtime(path, dataclasses.replace(r, memory=r.memory.with_sizes(expert_slots=slots)) if slots else r)
        rt.store.streaming.prefetcher = LayerPrefetcher(rt.pool, rt.device)
        kv, logits = rt.new_kv(len(prompt) + len(DECODE)), []
        with torch.inference_mode():
            for chunk in [prompt] + [[t] for t in DECODE]:
                rt.store.stats.new_step()
                logits.append(rt.step.forward(torch.tensor(chunk), kv))
        rt.close()
        return torch.cat(logits), rt.store.stats

    ref, _ = run("fused")
    for slots in (2 * e, e):
        got, stats = run("cpu", slots)
        assert torch.equal(got, ref), slots
        assert all(c.cpu == 0 and c.hits + c.fills == c.active for c in stats.steps[0].values())
        decode = [c for step in stats.steps[1:] for c in step.values()]
        assert all(c.fills == 0 and c.hits + c.cpu == c.active for c in decode) and sum(c.hits for c in decode) > 0
        assert (sum(c.cpu for c in decode) > 0) == (slots < len(stats.steps[0]) * e)


def test_fused_has_no_misses_and_cpu_no_cache(ftw_models):
    _, stats, _ = run_tokens(ftw_models["olmoe"], strategy="fused")
    assert stats.totals().misses == 0 and stats.totals().active > 0
    _, stats, _ = run_tokens(ftw_models["olmoe"], strategy="cpu")
    t = stats.totals()
    assert t.cpu == t.active and t.hits == 0


def test_a_warm_cache_hits(ftw_models):
    """With the whole pool cacheable, offload misses only on first touch."""
    _, stats, _ = run_tokens(ftw_models["qwen3_moe"], strategy="offload")
    t = stats.totals()
    spec_rows = 2 * 8  # every expert of every layer at most once
    assert t.fills <= spec_rows and t.hits == t.active - t.fills


def test_hybrid_fill_count():
    assert hybrid_fill_count(0, 0.3) == 0
    assert hybrid_fill_count(1, 0.01) == 1  # always fill at least one
    assert hybrid_fill_count(8, 0.68) == 5
    assert hybrid_fill_count(8, 0.25) == 2
    assert hybrid_fill_count(3, 2.0) == 3  # never more than the misses


def test_planner_protects_this_steps_experts():
    cache = SlotCache(2, 4096, 100, torch.device("cpu"))
    p = Planner("offload")
    first = p.plan(cache, [10, 11])
    assert [r for r, _ in first.fills] == [10, 11] and not first.cpu
    # 10 hits and must not be evicted for 12; 11 is the only victim, so 13 overflows to CPU.
    second = p.plan(cache, [10, 12, 13])
    assert [r for r, _ in second.hits] == [10]
    assert [r for r, _ in second.fills] == [12] and second.cpu == [13]
    assert cache.table[11] == -1 and cache.table[12] >= 0


@pytest.mark.parametrize("seed", range(40))
def test_claiming_many_slots_at_once_claims_as_one_at_a_time(seed):
    """`claim_many` (one pass over the LRU) leaves the cache as `claim` row by row does, each
    claimed row protected from the next, whatever the free slots, holds and protected rows."""
    import copy
    import random

    rnd = random.Random(seed)
    a = SlotCache(rnd.randint(1, 40), 1, 120, torch.device("cpu"))
    for _ in range(rnd.randint(0, 60)):
        if a.lookup(row := rnd.randrange(120)) is None:
            a.claim(row, set())
    if rnd.random() < 0.5:
        a.hold(rnd.randint(0, a.capacity))
    b = copy.deepcopy(a)
    rows = [r for r in rnd.sample(range(120), rnd.randint(0, 30)) if r not in a.lru]
    protected = set(rnd.sample(list(a.lru), min(len(a.lru), rnd.randint(0, 15))))
    got = a.claim_many(rows, set(protected))
    one_by_one = []
    for row in rows:
        if (slot := b.claim(row, protected)) is None:
            break
        one_by_one.append(slot)
        protected.add(row)
    assert got == one_by_one
    assert list(a.lru.items()) == list(b.lru.items()) and a.free == b.free
    assert (a._table == b._table).all()  # (a deep copy's `_table` no longer shares `table`'s memory)


def test_hybrid_fills_every_miss_of_a_prefill_sized_batch():
    cache = SlotCache(8, 4096, 100, torch.device("cpu"))
    p = Planner("hybrid", fill_fraction=0.25)
    split = p.plan(cache, [1, 2, 3, 4])
    assert len(split.fills) == 1 and len(split.cpu) == 3
    whole = p.plan(cache, [5, 6, 7, 8], fill_all=True)
    assert len(whole.fills) == 4 and not whole.cpu


def test_profile_ratio():
    assert Bandwidths(52.7, 77.3, overlapped=False).ratio == pytest.approx(0.68, abs=0.01)
    assert Bandwidths(40.0, 40.0, overlapped=True).ratio == pytest.approx(0.5)


@pytest.mark.parametrize("stream, items", [(False, 4), (True, 4), (True, 1)])
def test_a_long_chunk_keeps_the_hottest_experts(hf_checkpoint, tmp_path, stream, items):
    """A chunk that routes to every expert of every layer takes only staging room (two layers
    when streaming, one for on-demand fills, as an extend with one item per expert takes
    where the store could stream); the most recently used rest stays resident."""
    path = tmp_path / "m.ftw"
    convert(prepare(hf_checkpoint("qwen3_next")), path)  # 4 MoE layers of 8 experts: 32 rows
    capacity = 24 if stream else 12
    rt = Runtime(path, RuntimeOptions(strategy="offload", cache_experts=capacity, threads=2))
    if stream:
        rt.store.streaming.prefetcher = LayerPrefetcher(rt.pool, rt.device)
    store, spec = rt.store, rt.spec
    e, k = spec.num_experts, spec.top_k
    staging = (2 if stream and items >= 4 else 1) * e
    gen = torch.Generator().manual_seed(0)

    def forward(ids: torch.Tensor) -> None:
        x = torch.randn((ids.shape[0], spec.hidden_size), generator=gen)
        for layer in spec.moe_layers:
            store.run(layer, x, ids, torch.full(ids.shape, 1 / k))

    with torch.inference_mode():
        for _ in range(3):  # decode: three experts per layer
            forward(torch.tensor([[0, 3], [1, 3]]))
        hot = list(store.cache.lru)[-(capacity - staging):]
        store.stats.reset()
        forward(torch.arange(items * e).remainder(e).view(-1, k))  # every expert of every layer
    fills = store.stats.totals().fills
    assert fills > capacity - len(hot)  # plain LRU would have evicted the hot rows for these
    assert set(hot) <= set(store.cache.lru)
    assert not store.streaming.holding and not store.cache.kept
    rt.close()


def test_a_short_extend_moves_only_its_misses(hf_checkpoint, tmp_path):
    """An extend that touches every expert once (too few items per expert to stream whole
    layers) plans each layer from its own routing: no layer is copied in ahead."""
    path = tmp_path / "m.ftw"
    convert(prepare(hf_checkpoint("qwen3_next")), path)  # 4 MoE layers of 8 experts
    rt = Runtime(path, RuntimeOptions(strategy="hybrid", cache_experts=24, bandwidth_ratio=0.3, threads=2,
                                      trace_stats=True))
    rt.store.streaming.prefetcher = LayerPrefetcher(rt.pool, rt.device)
    ahead = []
    rt.store.streaming.prefetcher.prefetch = lambda cache, moe_index, in_use: ahead.append(moe_index)
    spec, store = rt.spec, rt.store
    e, k = spec.num_experts, spec.top_k
    x = torch.randn((e // k, spec.hidden_size), generator=torch.Generator().manual_seed(0))
    ids = torch.arange(e).view(e // k, k)  # every expert, one item each
    with torch.inference_mode():
        store.stats.new_step()
        for layer in spec.moe_layers:
            store.run(layer, x, ids, torch.full(ids.shape, 1 / k))
    assert all(c.active == e and c.misses == e for c in store.stats.steps[0].values())
    assert not ahead
    rt.close()


def _layer(q: int, m: int = 20, lead: float = 0.5) -> tuple[float, float]:
    """When a layer's fills and its CPU branch end, from the first fill's start, with q of m misses
    filled: fills cost 1.0 per expert beside the CPU (0.8 alone), the CPU 1.2 (0.7 alone) and
    starts `lead` later; a branch given nothing ends at 0."""
    fills, cpu = q * 1.0, lead + (m - q) * 1.2 if q < m else 0.0
    if not cpu:
        return fills * 0.8, 0.0
    if fills < cpu:  # the fills end first; the CPU's rest runs alone
        return fills, fills + (cpu - fills) * 0.7 / 1.2
    return cpu + (fills - cpu) * 0.8, cpu


@pytest.mark.parametrize("prior", [0.15, 0.5, 0.85])
def test_balance_ends_both_branches_together(prior):
    """The up-front split from outcomes (20 misses a layer, `_layer`): from any prior the split
    settles where the two end within one expert of each other."""
    p = Planner("hybrid", fill_fraction=prior)
    for _ in range(30):
        p.balance(*_layer(p.fill_count(20)))
    fills, cpu = _layer(p.fill_count(20))
    assert abs(fills - cpu) <= 1.2 and p.rate_fraction == prior  # the rates' ratio is left to graph decode


def test_balance_comes_back_after_filling_every_miss():
    """A few slow CPU layers (a cold start) can push the split to filling every miss; the
    layers after them, whose CPU got nothing and so took 0 s, bring it back."""
    p = Planner("hybrid", fill_fraction=0.5)
    for _ in range(5):
        p.balance(0.001, 1.0)
    assert p.fill_count(20) == 20 and _layer(20)[1] == 0
    for _ in range(30):
        p.balance(*_layer(p.fill_count(20)))
    fills, cpu = _layer(p.fill_count(20))
    assert p.fill_count(20) < 20 and abs(fills - cpu) <= 1.2
