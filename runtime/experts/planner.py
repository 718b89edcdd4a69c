"""Per layer: which active experts are hits, which misses are filled (q), which run on the CPU.

The split follows q* = m * B_P / B_H: filling and CPU work then finish together when DMA and
CPU reads share host memory bandwidth. At least one miss is filled whenever there is one, so the
cache keeps warming even when the CPU takes most misses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cache import SlotCache

FUSED, OFFLOAD, CPU, HYBRID, AUTO = "fused", "offload", "cpu", "hybrid", "auto"
STRATEGIES = (FUSED, OFFLOAD, CPU, HYBRID, AUTO)


@dataclass
class LayerPlan:
    hits: list[tuple[int, int]] = field(default_factory=list)  # (row, slot) already resident
    fills: list[tuple[int, int]] = field(default_factory=list)  # (row, slot) to copy in, then run on device
    cpu: list[int] = field(default_factory=list)  # rows run on the CPU from the host pool

    @property
    def misses(self) -> int:
        return len(self.fills) + len(self.cpu)


def hybrid_fill_count(m: int, ratio: float) -> int:
    """q = round(m * B_P / B_H), within 1..m when m >= 1."""
    return 0 if m == 0 else min(m, max(1, round(m * ratio)))


class Planner:
    def __init__(self, strategy: str, ratio: float | None = None):
        if strategy not in (FUSED, OFFLOAD, CPU, HYBRID):
            raise ValueError(f"strategy must be resolved before planning, got {strategy}")
        if strategy == HYBRID and not ratio:
            raise ValueError("hybrid needs a bandwidth ratio B_P / B_H (a profile or --bandwidth-ratio)")
        self.strategy, self.ratio = strategy, ratio

    def plan(self, cache: SlotCache, rows: list[int]) -> LayerPlan:
        """`rows`: the layer's distinct active experts, most-used first (they are filled first)."""
        plan = LayerPlan()
        if self.strategy == CPU:
            plan.cpu = list(rows)
            return plan
        misses = []
        for row in rows:
            slot = cache.lookup(row)
            if slot is None:
                misses.append(row)
            else:
                plan.hits.append((row, slot))
        q = len(misses) if self.strategy in (OFFLOAD, FUSED) else hybrid_fill_count(len(misses), self.ratio)
        protected = {r for r, _ in plan.hits}
        for i, row in enumerate(misses):
            slot = cache.claim(row, protected) if i < q else None
            if slot is None:  # not chosen, or no slot left that this step is not using
                plan.cpu.append(row)
            else:
                plan.fills.append((row, slot))
                protected.add(row)
        return plan
