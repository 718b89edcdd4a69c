"""Full-layer double buffering for prefill.

A long prompt chunk routes to nearly every expert of every layer, so prefill streams whole
layers: while layer l computes, the copy stream moves every expert of layer l+1 that is not
already resident, without waiting for that layer's routing; as soon as layer l's compute is
queued, the copy stream is queued to refill its buffer with layer l+2 behind it, so copies run
back to back. The store starts this when the current layer's routing touched most of its experts
(a short extend after a prefix hit does not, and moves only its misses). The two "layer buffers"
are not fixed regions: they are slots claimed from the one LRU, protected while their layer is in use,
so what prefill leaves behind is the decode cache's initial state and experts already resident are
used where they are. The chunk gets only those two layers of room: the store holds the rest of
the cache, the most recently used rows, for the decode that follows (`ExpertStore._hold_hottest`).

Needs room for two whole layers (2E slots); with less, the store falls back to on-demand fills
and says so once.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .cache import SlotCache
from .pool import HostPool


class LayerPrefetcher:
    def __init__(self, pool: HostPool, device: torch.device):
        self.pool, self.device = pool, device
        self.num_experts = pool.spec.num_experts
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pending: dict[int, tuple[list[int], object]] = {}  # moe index -> (rows filled, event)

    def fits(self, cache: SlotCache) -> bool:
        return cache.capacity >= 2 * self.num_experts

    def rows(self, moe_index: int) -> range:
        base = moe_index * self.num_experts
        return range(base, base + self.num_experts)

    def prefetch(self, cache: SlotCache, moe_index: int, in_use: set[int]) -> None:
        """Start copying every non-resident expert of MoE layer `moe_index`; rows in `in_use`
        (the layer computing now) are never evicted for it."""
        if moe_index in self.pending or moe_index >= self.pool.spec.num_moe_layers:
            return
        want = list(self.rows(moe_index))
        protected = set(in_use) | {r for r in want if cache.lookup(r) is not None}
        filled = []
        if self.stream is not None:  # the copies must not start before the slots' last readers
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            for row in want:
                if row in protected:
                    continue
                slot = cache.claim(row, protected)
                if slot is None:
                    break
                cache.fill(slot, self.pool.slot(row))
                protected.add(row)
                filled.append(row)
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending[moe_index] = (filled, event)

    def wait(self, moe_index: int) -> list[int]:
        """Make the compute stream wait for layer `moe_index`'s copies; returns the rows they
        filled (reported as that layer's fills)."""
        filled, event = self.pending.pop(moe_index, ([], None))
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return filled

