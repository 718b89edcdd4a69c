"""ft-bench sweep: how fast at how much device memory. Decode (and a prefill chunk) for each
strategy at each expert-cache fraction, and the CPU side at each thread count, every figure
beside its bound; written as JSON rows and drawn as SVG charts (tok/s against the cache's
device bytes, the bound dashed beside each strategy; tok/s against threads)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.ftw.reader import FTWModel

from . import run
from .plot import Series, line_chart

CACHELESS = ("cpu",)  # strategies whose speed no cache size changes: measured once, drawn flat

# What a point needs from the CLI: the bound's bandwidths, and the routing override (or None).
Figures = Callable[[Runtime], run.Figures]
Routing = Callable[[Runtime, int], object]


def point(model: Path, opts: RuntimeOptions, figures: Figures, routing: Routing, tokens: int, prompt: int,
          chunk: int) -> dict:
    """One runtime's decode (and `chunk`-token prefill, if any) beside their bounds."""
    rt = Runtime(model, opts)
    try:
        figs = figures(rt)
        r = run.decode(rt, tokens, prompt, routing(rt, prompt + tokens + 8), figs)
        out = {"strategy": rt.store.strategy, "threads": rt.store.cpu.threads,
               "cache_slots": rt.store.cache.capacity, "cache_bytes": rt.store.cache.capacity * rt.ftw.layout.slot_bytes,
               "tok_s": r["tok_s"], "bound_tok_s": r["bound_tok_s"], "miss_rate": r["miss_rate"]}
        if chunk:
            p = run.prefill(rt, chunk, figs)
            out.update(prefill_tok_s=p["tok_s"], prefill_bound_tok_s=chunk / p["pcie_bound_s"] if p.get("pcie_bound_s") else None)
        return out
    finally:
        rt.close()


def cache_sweep(model: Path, opts: RuntimeOptions, strategies: list[str], fractions: list[float],
                figures: Figures, routing: Routing, tokens: int, prompt: int, chunk: int = 0,
                say: Callable[[str], None] = print) -> list[dict]:
    """A point per strategy and cache fraction (a cacheless strategy once)."""
    rows = FTWModel(model).spec.num_expert_rows
    out = []
    for s in strategies:
        for f in fractions[:1] if s in CACHELESS else fractions:
            o = dataclasses.replace(opts, strategy=s, cache_experts=max(1, int(rows * f)))
            out.append({"fraction": f, **point(model, o, figures, routing, tokens, prompt, chunk)})
            say(f"{s} at {f:.0%} of the experts: {out[-1]['tok_s']:.1f} tok/s")
    return out


def thread_sweep(model: Path, opts: RuntimeOptions, strategy: str, threads: list[int], figures: Figures,
                 routing: Routing, tokens: int, prompt: int, say: Callable[[str], None] = print) -> list[dict]:
    """A point per CPU thread count, `strategy` at the options' cache size."""
    out = []
    for t in threads:
        out.append(point(model, dataclasses.replace(opts, strategy=strategy, threads=t), figures, routing,
                         tokens, prompt, 0))
        say(f"{strategy} at {t} threads: {out[-1]['tok_s']:.1f} tok/s")
    return out


def cache_chart(points: list[dict], title: str) -> str:
    """tok/s against the cache's device bytes (GB), a line per strategy and its bound dashed."""
    span = [p["cache_bytes"] / 1e9 for p in points if p["strategy"] not in CACHELESS] or [0.0]
    lo, hi = min(span), max(span)
    series = []
    for n, s in enumerate(dict.fromkeys(p["strategy"] for p in points)):
        mine = [p for p in points if p["strategy"] == s]

        def at(key: str, mine: list[dict] = mine) -> list[tuple[float, float]]:
            if mine[0]["strategy"] in CACHELESS:  # no cache: flat across the swept sizes
                return [(lo, mine[0][key]), (hi, mine[0][key])] if mine[0][key] else []
            return [(p["cache_bytes"] / 1e9, p[key]) for p in mine if p[key]]

        series.append(Series(s, at("tok_s"), n))
        if bound := at("bound_tok_s"):
            series.append(Series(f"{s} bound", bound, n, dashed=True))
    return line_chart(series, title, "expert cache on the device (GB)", "decode tok/s")


def thread_chart(points: list[dict], title: str) -> str:
    """tok/s against CPU threads, with the bound dashed."""
    series = [Series(points[0]["strategy"], [(p["threads"], p["tok_s"]) for p in points])]
    if bound := [(p["threads"], p["bound_tok_s"]) for p in points if p["bound_tok_s"]]:
        series.append(Series("bound", bound, 0, dashed=True))
    return line_chart(series, title, "CPU expert threads", "decode tok/s")
