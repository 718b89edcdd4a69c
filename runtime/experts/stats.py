"""Expert counters: per layer and per step, hits + fills + CPU-run = active experts."""

from __future__ import annotations

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
