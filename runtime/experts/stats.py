"""Expert counters: per layer and per step, hits + fills + CPU-run = active experts."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .planner import LayerPlan


@dataclass
class LayerCounts:
    active: int = 0
    hits: int = 0
    fills: int = 0
    cpu: int = 0

    @property
    def misses(self) -> int:
        return self.fills + self.cpu


@dataclass
class ExpertStats:
    layers: dict[int, LayerCounts] = field(default_factory=dict)
    steps: list[dict[int, LayerCounts]] = field(default_factory=list)  # kept when `trace` is on
    trace: bool = False
    # Counts kept elsewhere (device-side decode) and moved in by this call before any read.
    pull: Callable[[], None] | None = None

    def new_step(self) -> None:
        if self.trace:
            self.steps.append({})

    def record(self, layer: int, plan: LayerPlan) -> None:
        self.add(layer, len(plan.hits), len(plan.fills), len(plan.cpu))

    def add(self, layer: int, hits: int, fills: int, cpu: int) -> None:
        step = LayerCounts(hits + fills + cpu, hits, fills, cpu)
        total = self.layers.setdefault(layer, LayerCounts())
        total.active += step.active
        total.hits += step.hits
        total.fills += step.fills
        total.cpu += step.cpu
        if self.trace and self.steps:
            self.steps[-1][layer] = step

    def per_layer(self) -> dict[int, LayerCounts]:
        if self.pull is not None:
            self.pull()
        return self.layers

    def totals(self) -> LayerCounts:
        out = LayerCounts()
        for c in self.per_layer().values():
            out.active += c.active
            out.hits += c.hits
            out.fills += c.fills
            out.cpu += c.cpu
        return out

    @property
    def miss_rate(self) -> float:
        t = self.totals()
        return t.misses / t.active if t.active else 0.0

    def to_dict(self) -> dict:
        t = self.totals()
        return {
            "active": t.active, "hits": t.hits, "fills": t.fills, "cpu": t.cpu,
            "miss_rate": round(self.miss_rate, 4),
            "per_layer": {str(k): vars(v) for k, v in sorted(self.per_layer().items())},
        }

    def reset(self) -> None:
        self.per_layer().clear()
        self.steps.clear()


class LayerClock:
    """Host clock marks through each host-planned MoE layer (ft-bench turns it on for an
    extend): where a layer's time goes, without a profiler's 2-3x overhead on host work.
    Phases, summed over layers: `routing` (inputs staged, the routing read back: the device's
    merge, dense part and router of the layer before), `plan` (to the first fill or CPU start),
    `split` (to the end of the fills' hand-out: the shared split met), `cpu_wait` (the device's
    launches, then waiting for the CPU branch), `merge` (its rows copied in) and `between` (the
    model's launches up to the next MoE layer)."""

    MARKS = ("enter", "routed", "started", "met", "cpu_done", "exit")

    def __init__(self) -> None:
        self.layers: list[dict[str, float]] = []

    def mark(self, name: str) -> None:
        if name == "enter":
            self.layers.append({})
        self.layers[-1].setdefault(name, time.perf_counter())

    def phases_ms(self) -> dict[str, float]:
        """Milliseconds per phase, summed over the marked layers."""
        out = dict.fromkeys(("routing", "plan", "split", "cpu_wait", "merge", "between"), 0.0)
        for i, m in enumerate(self.layers):
            t = [m.get(name) for name in self.MARKS]
            for j in range(1, len(t)):  # a mark a layer skipped takes the one before's time
                t[j] = t[j - 1] if t[j] is None else t[j]
            for name, a, b in zip(out, t, t[1:], strict=False):
                out[name] += 1e3 * (b - a)
            if i + 1 < len(self.layers):
                out["between"] += 1e3 * (self.layers[i + 1]["enter"] - t[-1])
        return out
