"""Decode and prefill measurements, each beside the bound computed from measured bandwidths.

Bound per decode token: for each MoE layer, the fills cross PCIe (S / B_P each) while the CPU
set streams from DRAM (S / B_H each) and the two overlap, so the layer needs at least
max(fills * S / B_P, cpu * S / B_H); the GPU itself must read the dense weights, the hit
experts and attention's keys and values from HBM once. Prefill of a chunk that touches every
expert needs at least the uncached pool bytes over B_P.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ftkit.runtime.engine.loader import Runtime
from ftkit.runtime.engine.sampling import Sampler
from ftkit.runtime.experts.stats import LayerClock
from ftkit.runtime.models.kv_size import attention_layers, kv_rows
from ftkit.runtime.prefix_cache.prefill import prefill as runtime_prefill
from ftkit.vocab import HYBRID

from .routing import RoutingOverride


@dataclass(frozen=True)
class Figures:
    """Bandwidths in GB/s the bound uses (from a profile or given)."""

    pcie_gbps: float | None  # while the CPU branch runs too (the profile's overlapped figures)
    cpu_gbps: float | None
    hbm_gbps: float | None
    pcie_solo_gbps: float | None = None  # each path alone: the bound of a layer that uses only one
    cpu_solo_gbps: float | None = None


def sync(rt: Runtime) -> None:
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)


def step_dense_bytes(rt: Runtime) -> int:
    """Dense weight bytes one decode step reads: every dense tensor once, but only one row of
    the embedding table (all of it where lm_head is tied to it and reads it whole)."""
    w, tied = rt.decoder.w, rt.spec.tie_word_embeddings
    table = w["embed.weight"]
    rest = sum(t.nbytes for name, t in w.items() if name != "embed.weight")  # tensors and BlockTables alike
    return rest + (table.nbytes if tied else table.nbytes // table.shape[0])


def step_kv_bytes(rt: Runtime, position: int) -> int:
    """K/V bytes one decode step's attention reads at `position`: keys and values 0..position of
    every softmax-attention layer, the last `window` of them in a sliding one."""
    layers = attention_layers(rt.spec)
    (kh, kw), (vh, vw) = kv_rows(rt.spec)
    per_key = (kh * kw + vh * vw) * rt.dtype.itemsize  # one layer's K and V of a position
    return sum(min(position + 1, rt.decoder.window(i) or position + 1) * per_key for i in layers)


def prefill_forward(rt: Runtime, ids: torch.Tensor, kv, anchors: int = 0) -> torch.Tensor:
    """A prompt into an empty `kv` as ft-run prefills it on a GPU (`kv.prefill.prefill`): one
    forward, layer by layer in pieces of `rt.prefill_chunk` tokens (CPU: whole); the last
    position's logits [V]. `anchors`: a recurrent-state snapshot every this many tokens, as a
    hybrid model's turn boundaries ask (on CPU the prompt is then cut there)."""
    points = range(anchors, len(ids), anchors) if anchors else ()
    return runtime_prefill(rt.step, ids.tolist(), kv, points, points, max_chunk=rt.prefill_chunk)[0]


WARMUP = 2  # untimed decode steps before the timed ones (kernel compilation, graph capture)


def decode_length(prompt: int, tokens: int) -> int:
    """The KV rows `decode` uses (4 spare steps for the profiled table)."""
    return prompt + WARMUP + tokens + 8


def prefill_length(chunk: int, answer: int, extend: int) -> int:
    """The KV rows `prefill` uses."""
    return chunk + answer + extend + 1


def decode(rt: Runtime, tokens: int, prompt: int, routing: RoutingOverride | None, figures: Figures,
           trace_to: Path | None = None, sampler: Sampler | None = None) -> dict:
    """Batch-1 decode tok/s over `tokens` steps after a `prompt`-token prefill and WARMUP
    untimed steps (kernel compilation, graph capture); `trace_to` also writes a torch.profiler
    table of 4 further steps, pipelined where the timed ones were (where the per-token time goes).

    Each step feeds a seeded random token rather than the argmax: random weights tend to repeat
    their greedy token, and a repeated token repeats its routing, which would flatter the cache.
    Each step still reads its argmax back to the host, or with a `sampler` the token it draws.
    With graph decode the timed steps run as generation does (`GraphDecode.pipeline`: the next
    step is queued before a token is read), the random tokens fed on the device."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, rt.spec.vocab_size, (prompt + WARMUP + tokens + 4,), generator=gen).to(rt.device)
    kv = rt.new_kv(decode_length(prompt, tokens))

    def step(i: int) -> None:
        if routing:
            routing.next_step()
        logits = rt.step.forward(ids[i : i + 1], kv)[-1]
        int(sampler(logits) if sampler else logits.argmax())

    with torch.inference_mode():
        if routing:
            routing.next_step()
        int(prefill_forward(rt, ids[:prompt], kv).argmax())
        for i in range(prompt, prompt + WARMUP):
            step(i)
        start = prompt + WARMUP
        graphs = rt.step.graphs
        pipelined = (routing is None or routing.graph_safe) and graphs is not None and graphs.accepts(kv)
        first = int(ids[start])
        rt.store.stats.reset()
        sync(rt)
        sides = _sides(rt)
        hybrid = sides is not None and rt.store.device_planner.strategy == HYBRID
        fraction = rt.store.device_planner.fill_fraction if hybrid else None
        t0 = time.perf_counter()
        if pipelined:  # as generation runs: the next step queued while a token is read
            for _ in graphs.pipeline(first, kv, tokens, sampler, feed=ids[start : start + tokens]):
                pass
        else:
            for i in range(start, start + tokens):
                step(i)
        sync(rt)
        seconds = time.perf_counter() - t0
        sides = [b - a for a, b in zip(sides, _sides(rt), strict=True)] if sides else None
    stats = rt.store.stats
    t = stats.totals()
    keys = sum(step_kv_bytes(rt, p) for p in range(start, start + tokens)) / tokens  # not `kv`: step() reads it
    bound = _decode_bound(rt, stats, tokens, figures, keys)
    fill_bytes, cpu_bytes = (sum(getattr(c, side) * expert_bytes(rt, layer) for layer, c in stats.per_layer().items())
                             for side in ("fills", "cpu"))
    cpu_gbps = cpu_bytes / sides[2] if sides and sides[2] else None
    tight = worker_bound(rt, stats, tokens, figures, keys, cpu_gbps) if cpu_gbps else bound
    if trace_to is not None:  # the 4 spare ids past the timed steps, run as the timed ones were
        spare = start + tokens
        with torch.inference_mode():
            if pipelined:
                _profiled(rt, lambda: list(graphs.pipeline(int(ids[spare]), kv, len(ids) - spare, sampler,
                                                           feed=ids[spare:])), trace_to)
            else:
                _profiled(rt, lambda: [step(i) for i in range(spare, len(ids))], trace_to)
    return {
        "tokens": tokens,
        "graphs": rt.step.graphs is not None,
        "pipelined": pipelined,
        "sampled": sampler is not None,
        "tok_s": tokens / seconds,
        "ms_per_token": 1000 * seconds / tokens,
        "bound_ms_per_token": 1000 * bound if bound else None,
        "overhead_ms_per_token": 1000 * (seconds / tokens - bound) if bound else None,
        "miss_rate": stats.miss_rate,
        "hits": t.hits, "fills": t.fills, "cpu": t.cpu,
        "fill_gb_per_token": fill_bytes / tokens / 1e9,
        "cpu_gb_per_token": cpu_bytes / tokens / 1e9,
        "bound_tok_s": 1 / bound if bound else None,
        "of_bound": tokens / seconds * bound if bound else None,  # measured tok/s over bound tok/s
        # graph decode's layers with CPU items: the GPU's time from the doorbell to the wait for
        # the worker, and the worker's compute time (the two sides the hybrid split balances)
        "cpu_layers": sides[1] if sides else None,
        "gpu_side_ms_per_token": sides[0] / 1e6 / tokens if sides else None,
        "cpu_side_ms_per_token": sides[2] / 1e6 / tokens if sides else None,
        "cpu_side_gbps": cpu_gbps,
        # the bound with the CPU side at the worker's own rate where that beat the profile's
        "bound_at_worker_tok_s": 1 / tight if tight else None,
        "of_bound_at_worker": tokens / seconds * tight if tight else None,
        # hybrid's adaptive fill fraction when the timed steps began and when they ended
        "fill_fraction": [fraction, rt.store.device_planner.fill_fraction] if hybrid else None,
    }


def decode_batch(rt: Runtime, tokens: int, prompt: int, size: int, figures: Figures | None = None,
                 trace_to: Path | None = None) -> dict:
    """`size` sequences decoding together as the scheduler's batched mode runs them: tok/s over
    all of them across `tokens` batched steps, after each one's `prompt`-token prefill and
    WARMUP untimed steps (kernel compilation, the batch size's graph capture). Where the
    captured batched step takes them (`graphs`), the steps are pipelined as the scheduler's
    bursts are (`Step.pipeline_batch`: the next step queued while a step's tokens are read),
    else one `Step.batch` at a time with every row's argmax read back. Either way each step
    feeds seeded random tokens (as `decode`, for the same reason). With `figures`, the bound as
    `decode`'s (from the distinct experts the steps touched: a batch shares only the experts its
    tokens have in common), and `uniform_distinct`: the distinct experts a layer's `size` tokens
    would touch under uniform routing, E (1 - (1 - k/E)^size), against k for one token. With
    `trace_to`, 4 more steps run as the timed ones under the profiler (`decode`'s table)."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, rt.spec.vocab_size, (prompt + WARMUP + tokens + 4, size), generator=gen).to(rt.device)
    caches = [rt.new_kv(decode_length(prompt, tokens)) for _ in range(size)]

    def step(i: int) -> None:
        rt.store.stats.new_step()
        rt.step.batch(ids[i], caches).argmax(-1).tolist()

    def steps(first: int, end: int) -> None:
        if not graphs:
            for i in range(first, end):
                step(i)
            return
        for _ in rt.step.pipeline_batch(ids[first].tolist(), caches, end - first, [None] * size, feed=ids[first:end]):
            rt.store.stats.new_step()

    with torch.inference_mode():
        for b, kv in enumerate(caches):
            int(prefill_forward(rt, ids[:prompt, b], kv).argmax())
        for i in range(prompt, prompt + WARMUP):
            step(i)
        graphs = rt.step.pipelines_batch(caches)
        rt.store.stats.reset()
        sync(rt)
        t0 = time.perf_counter()
        steps(prompt + WARMUP, prompt + WARMUP + tokens)
        sync(rt)
        seconds = time.perf_counter() - t0
    start = prompt + WARMUP
    keys = size * sum(step_kv_bytes(rt, p) for p in range(start, start + tokens)) / tokens
    bound = _decode_bound(rt, rt.store.stats, tokens, figures, keys) if figures else None
    t, moe = rt.store.stats.totals(), sum(rt.spec.is_moe(i) for i in range(rt.spec.num_layers))
    e, k, miss = rt.spec.num_experts, rt.spec.top_k, rt.store.stats.miss_rate
    if trace_to is not None:  # the 4 spare rows of ids past the timed steps (after the stats are read)
        with torch.inference_mode():
            _profiled(rt, lambda: steps(start + tokens, len(ids)), trace_to)
    return {"batch": size, "tokens": tokens, "graphs": graphs, "tok_s": size * tokens / seconds,
            "ms_per_step": 1000 * seconds / tokens, "miss_rate": miss,
            "distinct_per_layer": (t.hits + t.fills + t.cpu) / tokens / max(1, moe),
            "uniform_distinct": e * (1 - (1 - k / e) ** size), "top_k": k,
            "bound_tok_s": size / bound if bound else None,
            "of_bound": tokens / seconds * bound if bound else None}  # measured over bound, as decode's


def _sides(rt: Runtime) -> list[int] | None:
    """The device planner's counters of decode layers with CPU items: [GPU ns, layers, worker
    ns] (None without its CPU worker). Read after a sync; the GPU's are in mapped memory."""
    plan = rt.store.device_planner
    if plan is None or plan.worker is None:
        return None
    return [int(plan.gpu_ns[0]), int(plan.busy_ns[1]), int(plan.busy_ns[0])]


def _profiled(rt: Runtime, fn, path: Path) -> None:
    """Run fn under torch.profiler; write tables sorted by host time and by device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(rt)
    sort = "self_cuda_time_total" if rt.device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    gpu = prof.key_averages().table(sort_by=sort, row_limit=40) if rt.device.type == "cuda" else ""
    Path(path).write_text(table + "\n\n" + gpu)
    if os.environ.get("FTKIT_CHROME_TRACE"):  # the timeline too (Perfetto); torch gzips a .gz path
        prof.export_chrome_trace(str(Path(path).with_suffix(".trace.json.gz")))


def _host_profiled(rt: Runtime, fn, path: Path, rows: int = 40) -> None:
    """Run fn under cProfile (the host's Python, which torch.profiler does not see); write its
    functions sorted by own time and by cumulative time, in milliseconds."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    sync(rt)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, ncalls, own s, cumulative s, callers)
    lines = []
    for title, col in (("own", 2), ("cumulative", 3)):
        lines.append(f"{'calls':>7} {'own ms':>9} {'cum ms':>9}  function (by {title} time)")
        for (file, line, name), v in sorted(stats.items(), key=lambda kv: -kv[1][col])[:rows]:
            lines.append(f"{v[1]:>7} {1e3 * v[2]:>9.3f} {1e3 * v[3]:>9.3f}  {name} {Path(file).name}:{line}")
        lines.append("")
    Path(path).write_text("\n".join(lines))


def expert_bytes(rt: Runtime, layer: int) -> int:
    """The bytes one expert of `layer` moves or streams: its parts', not its slot's padding (the
    layers of a llama-quantize mix differ: Q4_K_M's Q4_K-down layers 2.65 MB in slots of 3.06)."""
    return rt.ftw.layout.for_layer(rt.spec.moe_index(layer)).data_bytes


def _decode_bound(rt: Runtime, stats, tokens: int, f: Figures, kv_bytes: float) -> float | None:
    """Seconds per token (see the module docstring); `kv_bytes`: attention's K/V reads, a
    step's mean over the timed steps."""
    per_layer, hit_bytes = 0.0, 0
    for layer, c in stats.per_layer().items():
        s = expert_bytes(rt, layer)
        hit_bytes += c.hits * s
        if (c.fills and not f.pcie_gbps) or (c.cpu and not f.cpu_gbps):
            return None
        both = c.fills and c.cpu  # a layer whose counts use one path gets that path's solo speed
        pcie = f.pcie_gbps if both or not f.pcie_solo_gbps else f.pcie_solo_gbps
        cpu_gbps = f.cpu_gbps if both or not f.cpu_solo_gbps else f.cpu_solo_gbps
        fill = c.fills * s / (pcie * 1e9) if c.fills else 0.0
        cpu = c.cpu * s / (cpu_gbps * 1e9) if c.cpu else 0.0
        per_layer += max(fill, cpu)
    gpu = 0.0
    if f.hbm_gbps:
        gpu = (step_dense_bytes(rt) + kv_bytes + hit_bytes / tokens) / (f.hbm_gbps * 1e9)
    total = per_layer / tokens + gpu
    return total or None


def worker_bound(rt: Runtime, stats, tokens: int, f: Figures, kv_bytes: float, cpu_gbps: float) -> float | None:
    """The decode bound with the CPU side at `cpu_gbps`, the rate the run's worker streamed,
    where that beat the profile's. That rate moves with the machine's state (other guests'
    memory traffic); the hardware did at least what the worker did, so this bound is the
    tighter one, and "of bound" does not pass 100% on a profile taken in a slow moment."""
    if f.cpu_gbps and cpu_gbps > f.cpu_gbps:
        f = dataclasses.replace(f, cpu_gbps=cpu_gbps, cpu_solo_gbps=max(cpu_gbps, f.cpu_solo_gbps or 0.0))
    return _decode_bound(rt, stats, tokens, f, kv_bytes)


def prefill(rt: Runtime, chunk: int, figures: Figures, trace_to: Path | None = None, extend: int = 0,
            answer: int = 32, repeat: int = 1, anchors: int = 0) -> dict:
    """Seconds to prefill one `chunk`-token prompt (TTFT; as ft-run runs it: layer by layer in
    pieces of at most the runtime's `prefill_chunk` tokens, each layer streamed once) and how many of the experts resident
    before it still are after it. Timed warm: an untimed chunk of the same size runs first
    (`first_seconds`: its time; a new shape's first call pays allocations and kernel choices
    once), then `answer` untimed decode steps put a decode's experts back on top of the cache,
    as a server's previous turn leaves them. `extend`: then an agent turn: `answer` tokens
    decoded (the turn's reply), then that many more tokens timed on top (the next turn after a
    prefix hit); its shape also runs once untimed before. `repeat`: the timed turn (answer,
    chunk, answer, extend) runs this many times; times are medians, counts are means (every
    turn's times, moved bytes, layer phases and fill fraction in `*_all`). `trace_to` also writes
    torch.profiler tables of a further chunk (and extend). `anchors`: the chunk snapshots its
    recurrent state every this many tokens (`prefill_forward`)."""
    gen = torch.Generator().manual_seed(1)
    n = chunk + answer + extend
    ids = torch.randint(0, rt.spec.vocab_size, (n,), generator=gen).to(rt.device)
    kv = rt.new_kv(prefill_length(chunk, answer, extend))
    with torch.inference_mode():
        scratch = rt.new_kv(chunk + 1)
        sync(rt)
        t0 = time.perf_counter()
        prefill_forward(rt, ids[:chunk], scratch, anchors)
        sync(rt)
        first = time.perf_counter() - t0
        del scratch
        if extend:  # behind one token, as the extend is behind the chunk (attention's masked path)
            scratch = rt.new_kv(extend + 1)
            rt.step.forward(ids[:1], scratch)
            rt.step.forward(ids[n - extend:], scratch, last_only=True)
    turns = [_turn(rt, ids, kv, chunk, answer, extend, anchors) for _ in range(repeat)]
    if trace_to is not None:  # counted above: the profiled repeats do not add to the figures
        kv.truncate(0)
        with torch.inference_mode():
            _profiled(rt, lambda: prefill_forward(rt, ids[:chunk], kv, anchors), trace_to)
            if extend:
                extend_fn = lambda: rt.step.forward(ids[n - extend:], kv, last_only=True)  # noqa: E731
                behind = kv.snapshot()  # recurrent states cannot be truncated back to the chunk
                _profiled(rt, extend_fn, trace_to.with_name(trace_to.stem + "-extend.txt"))
                kv.restore(behind)  # the same extend again, behind the same chunk
                _host_profiled(rt, extend_fn, trace_to.with_name(trace_to.stem + "-extend-host.txt"))
    out = {key: _summary(key, [t[key] for t in turns]) for key in turns[0]}
    if repeat > 1:
        # every turn's times, moved bytes, layer phases and fill fraction, in turn order (a drift shows there)
        out.update({key + "_all": [t[key] for t in turns] for key in turns[0] if key.endswith(("seconds", "_gb", "_ms", "_fraction"))})
    moved = out.pop("missed_bytes")
    pcie = figures.pcie_solo_gbps or figures.pcie_gbps
    bound = moved / (pcie * 1e9) if pcie and moved else None
    return {
        "chunk": chunk,
        "pieces": -(-chunk // (rt.prefill_chunk or chunk)),  # per layer: activations of one piece at a time
        "anchors": len(range(anchors, chunk, anchors)) if anchors else 0,
        "first_seconds": first,
        "tok_s": chunk / out["seconds"],
        "missed_gb": moved / 1e9,
        "pcie_bound_s": bound,
        "of_bound": bound / out["seconds"] if bound else None,
        "streaming": rt.store.streaming.prefetcher is not None,
        **out,
    }


def _summary(key: str, values: list):
    if any(v is None for v in values) or key in ("extend", "answer"):
        return values[0]
    return statistics.median(values) if key.endswith("seconds") else statistics.fmean(values)


def _turn(rt: Runtime, ids: torch.Tensor, kv, chunk: int, answer: int, extend: int, anchors: int = 0) -> dict:
    """One timed turn of `prefill`: `answer` untimed decode steps (a previous turn's), the chunk
    timed from position 0 of `kv`, then with `extend`: `answer` steps and the extend timed."""
    n = chunk + answer + extend
    with torch.inference_mode():
        scratch = rt.new_kv(answer + 1)
        for i in range(chunk, chunk + answer):
            int(rt.step.forward(ids[i : i + 1], scratch)[-1].argmax())
        del scratch
        before = set(rt.store.resident_rows())
        kv.truncate(0)
        rt.store.stats.reset()
        sync(rt)
        t0 = time.perf_counter()
        prefill_forward(rt, ids[:chunk], kv, anchors)
        sync(rt)
        seconds = time.perf_counter() - t0
        t, slot = rt.store.stats.totals(), rt.ftw.layout.slot_bytes
        out = {"seconds": seconds, "miss_rate": rt.store.stats.miss_rate, "missed_bytes": t.misses * slot,
               "resident_kept": len(before & set(rt.store.resident_rows())) / len(before) if before else None}
        if not extend:
            return out
        for i in range(chunk, chunk + answer):
            int(rt.step.forward(ids[i : i + 1], kv)[-1].argmax())
        rt.store.stats.reset()
        rt.store.clock = clock = LayerClock()
        sync(rt)
        t0 = time.perf_counter()
        rt.step.forward(ids[n - extend:], kv, last_only=True)
        sync(rt)
        seconds = time.perf_counter() - t0
        rt.store.clock = None
        e, dp = rt.store.stats.totals(), rt.store.device_planner
        on_device = dp is not None and dp.strategy == HYBRID and dp.takes(extend)  # the extend was planned there
        split = dp.fractions[1].fraction if on_device else rt.store.planner.fill_fraction
        phases = {f"extend_{name}_ms": ms for name, ms in clock.phases_ms().items()}
        return {**out, "extend": extend, "answer": answer, "extend_seconds": seconds, "extend_active": e.active,
                "extend_moved_gb": e.misses * slot / 1e9, "extend_cpu_gb": e.cpu * slot / 1e9, **phases,
                # hybrid's split after the extend: the device planner's (extends planned there) or the
                # host planner's up-front one (None: not balanced from outcomes)
                "extend_fill_fraction": split}


def hbm_gbps(device: torch.device) -> float | None:
    """A large device-to-device copy, counting bytes read plus written."""
    if device.type != "cuda":
        return None
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize(device)
    return 2 * 10 * a.numel() / (time.perf_counter() - t0) / 1e9
