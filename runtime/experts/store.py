"""ExpertStore: the one call a family makes, `run(layer, hidden, topk_ids, topk_weights)`.

Per MoE layer: de-duplicate the active experts, plan hits / fills / CPU set, start the CPU
branch first, fill and evaluate hits + fills on the device, then merge. The merge is exact:
each (token, k) assignment's weighted output lands in its own row of a buffer, whichever tier
computed it, and the rows are summed over k in a fixed order, so results never depend on cache
size or split (bitwise on CPU in float32).
"""

from __future__ import annotations

import torch

from ..spec import ModelSpec
from .cache import SlotCache
from .cpu import CPUExecutor
from .planner import AUTO, CPU, FUSED, HYBRID, OFFLOAD, STRATEGIES, LayerPlan, Planner
from .pool import HostPool, expert_forward, expert_weights
from .stats import ExpertStats

__all__ = ["STRATEGIES", "ExpertStore", "resolve_strategy"]


def resolve_strategy(strategy: str, ratio: float | None, device: torch.device) -> str:
    """`auto`: hybrid when a bandwidth ratio is known; otherwise `cpu` when the device tier is
    host memory (copying slots within RAM buys nothing) and `offload` on a GPU."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if strategy != AUTO:
        return strategy
    if ratio:
        return HYBRID
    return CPU if device.type == "cpu" else OFFLOAD


class ExpertStore:
    def __init__(
        self,
        spec: ModelSpec,
        pool: HostPool,
        strategy: str = AUTO,
        cache_slots: int | None = None,
        device: str | torch.device = "cpu",
        threads: int | None = None,
        ratio: float | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.spec, self.pool, self.dtype = spec, pool, dtype
        self.device = torch.device(device)
        self.strategy = resolve_strategy(strategy, ratio, self.device)
        rows = spec.num_expert_rows
        if self.strategy == FUSED:
            capacity = rows
        elif self.strategy == CPU:
            capacity = 0
        else:
            capacity = rows if cache_slots is None else min(cache_slots, rows)
            if capacity < 1:
                raise ValueError(f"strategy {self.strategy} needs a cache of at least one expert slot")
        self.cache = SlotCache(capacity, pool.layout.slot_bytes, rows, self.device)
        self.planner = Planner(self.strategy, ratio)
        self.cpu = CPUExecutor(threads)
        self.stats = ExpertStats()
        if self.strategy == FUSED:
            for row in range(rows):
                self.cache.fill(self.cache.claim(row, set()), pool.slot(row))

    @property
    def ratio(self) -> float | None:
        return self.planner.ratio

    def run(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Gate-weighted sum of the routed experts for `hidden` [T, H] at model layer `layer`."""
        t, k = topk_ids.shape
        base = self.spec.moe_index(layer) * self.spec.num_experts
        flat = topk_ids.reshape(-1).to("cpu", torch.int64)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()
        groups: dict[int, torch.Tensor] = {}  # row -> flat assignment indices (t * k + j)
        start = 0
        for e, n in enumerate(counts):
            if n:
                groups[base + e] = order[start : start + n]
                start += n
        # Most-used experts first: they are the ones worth filling.
        rows = sorted(groups, key=lambda r: (-len(groups[r]), r))
        plan = self.planner.plan(self.cache, rows)
        self.stats.record(layer, plan)

        weights = topk_weights.reshape(-1, 1)
        y = torch.zeros((t * k, hidden.shape[-1]), dtype=hidden.dtype, device=hidden.device)
        futures, host_y = self._start_cpu(plan, groups, hidden, weights, y, k)
        for row, slot in plan.fills:
            self.cache.fill(slot, self.pool.slot(row))
        for row, slot in plan.hits + plan.fills:
            self._eval(self.cache.slots[slot], groups[row].to(hidden.device), hidden, weights, y, k)
        CPUExecutor.wait(futures)
        if host_y is not y:  # rows are disjoint and zero elsewhere, so adding is exact
            y = y + host_y.to(y.device)
        return y.view(t, k, -1).sum(dim=1)

    def _eval(self, slot: torch.Tensor, idx: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
              y: torch.Tensor, k: int) -> None:
        """One expert for its assignments `idx` (flat t * k + j), weighted, into y[idx]."""
        gate, up, down = expert_weights(self.pool.layout, slot, x.dtype)
        y[idx] = expert_forward(x[idx // k], gate, up, down) * w[idx]

    def _start_cpu(self, plan: LayerPlan, groups: dict[int, torch.Tensor], hidden: torch.Tensor,
                   weights: torch.Tensor, y: torch.Tensor, k: int):
        """Start the CPU set from the host pool; returns its futures and the buffer it writes."""
        if not plan.cpu:
            return [], y
        if hidden.device.type == "cpu":
            x, w, out = hidden, weights, y
        else:
            x, w = hidden.to("cpu"), weights.to("cpu")
            out = torch.zeros(y.shape, dtype=y.dtype)

        def job(row: int):
            def run() -> None:
                with torch.inference_mode():  # thread-local: the caller's mode does not carry over
                    self._eval(self.pool.slot(row), groups[row], x, w, out, k)
            return run

        return self.cpu.start([job(r) for r in plan.cpu]), out

    def rebuild(self, cache_slots: int) -> None:
        """Resize the device cache (at a safe point); the host pool is untouched."""
        if self.strategy in (FUSED, CPU):
            raise ValueError(f"strategy {self.strategy} has no resizable cache")
        self.cache = SlotCache(min(cache_slots, self.spec.num_expert_rows), self.pool.layout.slot_bytes,
                               self.spec.num_expert_rows, self.device)

    def close(self) -> None:
        self.cpu.close()

