"""The device memory plan of a server: dense weights + KV tokens + expert slots, against a budget.

Computed from the manifest before any weight is read, so a plan that cannot fit is refused with
advice instead of failing half-way through loading; the same check guards a cache rebuild.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..checkpoint.base import TORCH_DTYPES
from ..console import human_bytes
from ..experts.store import cache_capacity, resolve_strategy
from ..ftw.reader import FTWModel
from ..models.kv import kv_bytes_per_token
from ..profile import load_profile
from .loader import RuntimeOptions


@dataclass(frozen=True)
class MemoryPlan:
    dense_bytes: int
    kv_tokens: int
    kv_bytes_per_token: int
    expert_slots: int
    slot_bytes: int
    budget_bytes: int | None  # None: unknown, not checked
    prefix_tokens: int = 0  # K/V rows the prefix cache may hold, on the same device
    graph_tokens: int = 0  # static K/V rows of CUDA graph decode (engine/graphs.py)

    @property
    def prefix_bytes(self) -> int:
        return self.prefix_tokens * self.kv_bytes_per_token

    @property
    def graph_bytes(self) -> int:
        return self.graph_tokens * self.kv_bytes_per_token

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    @property
    def expert_bytes(self) -> int:
        return self.expert_slots * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.dense_bytes + self.kv_bytes + self.expert_bytes + self.prefix_bytes + self.graph_bytes

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.total_bytes <= self.budget_bytes

    def with_sizes(self, expert_slots: int | None = None, kv_tokens: int | None = None) -> MemoryPlan:
        return replace(self, expert_slots=self.expert_slots if expert_slots is None else expert_slots,
                       kv_tokens=self.kv_tokens if kv_tokens is None else kv_tokens)

    def describe(self) -> str:
        budget = human_bytes(self.budget_bytes) if self.budget_bytes is not None else "unchecked"
        return (f"memory plan: dense {human_bytes(self.dense_bytes)} + KV {self.kv_tokens} tokens "
                f"({human_bytes(self.kv_bytes)}) + {self.expert_slots} expert slots "
                f"({human_bytes(self.expert_bytes)}) + prefix cache {self.prefix_tokens} tokens "
                f"({human_bytes(self.prefix_bytes)})"
                + (f" + graph K/V {self.graph_tokens} tokens ({human_bytes(self.graph_bytes)})" if self.graph_tokens else "")
                + f" = {human_bytes(self.total_bytes)} of {budget}")

    def advice(self) -> str:
        """Why it does not fit and what would: the largest expert cache and KV that do."""
        assert self.budget_bytes is not None
        room = self.budget_bytes - self.dense_bytes - self.prefix_bytes - self.graph_bytes
        if room <= 0 and self.prefix_bytes:
            return (f"dense weights and the prefix cache ({self.prefix_tokens} tokens) exceed the budget "
                    f"of {human_bytes(self.budget_bytes)}; lower --prefix-cache-tokens")
        if room <= 0:
            return (f"the dense weights alone ({human_bytes(self.dense_bytes)}) exceed the budget of "
                    f"{human_bytes(self.budget_bytes)}; use a smaller --dtype or a larger device")
        slots = max(0, (room - self.kv_bytes) // self.slot_bytes) if self.slot_bytes else 0
        kv = max(0, (room - self.expert_bytes) // self.kv_bytes_per_token)
        return (f"{human_bytes(self.total_bytes)} does not fit {human_bytes(self.budget_bytes)}: lower "
                f"--cache-experts to {slots} or fewer (with {self.kv_tokens} KV tokens), or --kv-tokens "
                f"to {kv} or fewer (with {self.expert_slots} slots)")


def device_budget(device: str) -> int | None:
    """Free device memory now: VRAM on CUDA, available RAM on CPU (None where unknown)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def plan_memory(path: Path, opts: RuntimeOptions, kv_tokens: int, budget_bytes: int | None) -> MemoryPlan:
    """The plan `Runtime(path, opts)` plus a KV budget of `kv_tokens` would make."""
    ftw = FTWModel(Path(path))
    dense = ftw.manifest.dense["tensors"]
    dtype = TORCH_DTYPES[opts.dtype] if opts.dtype else TORCH_DTYPES[next(iter(dense.values()))["dtype"]]
    dense_bytes = sum(math.prod(t["shape"]) for t in dense.values()) * dtype.itemsize
    ratio = load_profile(opts.profile).ratio if opts.profile is not None else opts.bandwidth_ratio
    strategy = resolve_strategy(opts.strategy, ratio, torch.device(opts.device))
    requested = opts.cache_experts
    if opts.cache_bytes is not None:
        requested = opts.cache_bytes // ftw.layout.slot_bytes
    if opts.gpu_budget is not None:  # the expert cache gets what dense weights and KV leave
        left = opts.gpu_budget - dense_bytes - kv_tokens * kv_bytes_per_token(ftw.spec, dtype)
        requested = max(1, left // ftw.layout.slot_bytes)
    slots = cache_capacity(strategy, requested, ftw.spec.num_expert_rows)
    prefix = (opts.prefix_cache_tokens or ftw.spec.max_position_embeddings) if opts.prefix_cache else 0
    graphs = opts.kv_tokens if opts.graphs and torch.device(opts.device).type == "cuda" else 0
    return MemoryPlan(dense_bytes, kv_tokens, kv_bytes_per_token(ftw.spec, dtype), slots,
                      ftw.layout.slot_bytes, budget_bytes, prefix, graphs)
