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

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .cache import SlotCache
from .pool import HostPool


class LayerPrefetcher:
    def __init__(self, pool: HostPool, device: torch.device):
        self.pool, self.device = pool, device
        self.num_experts = pool.spec.num_experts
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # cudaMemcpyAsync blocks its caller once the copy queue is deep, and two layers of some
        # hundred 9 MB copies are: a thread of its own issues them, so the host goes on with
        # routing and launching the layers in between.
        self.issuer = ThreadPoolExecutor(1, thread_name_prefix="ftkit-prefetch") if self.stream else None
        self.pending: dict[int, tuple[list[int], Future | None]] = {}  # moe index -> (rows filled, copies issued)

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
        pairs = []  # (slot, row)
        for row in want:
            if row in protected:
                continue
            slot = cache.claim(row, protected)
            if slot is None:
                break
            protected.add(row)
            pairs.append((slot, row))
        filled = [row for _, row in pairs]
        if self.issuer is None:
            self._copy(cache, pairs)
            self.pending[moe_index] = (filled, None)
            return
        ready = torch.cuda.Event()  # the copies must not start before the slots' last readers
        ready.record(torch.cuda.current_stream(self.device))
        self.pending[moe_index] = (filled, self.issuer.submit(self._issue, cache, pairs, ready))

    def _copy(self, cache: SlotCache, pairs: list[tuple[int, int]]) -> None:
        for slot, row in pairs:
            cache.fill(slot, self.pool.slot(row))

    def _issue(self, cache: SlotCache, pairs: list[tuple[int, int]], ready: torch.cuda.Event) -> torch.cuda.Event:
        """On the issuer thread: the copies on the copy stream behind `ready`; returns their end."""
        with torch.inference_mode(), torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            self._copy(cache, pairs)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, moe_index: int) -> list[int]:
        """Make the compute stream wait for layer `moe_index`'s copies; returns the rows they
        filled (reported as that layer's fills)."""
        filled, issued = self.pending.pop(moe_index, ([], None))
        if issued is not None:
            torch.cuda.current_stream(self.device).wait_event(issued.result())
        return filled

    def close(self) -> None:
        if self.issuer is not None:
            self.issuer.shutdown(wait=True)
