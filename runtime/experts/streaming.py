"""Prefill streaming: full-layer double buffering, and when a forward uses it.

A long prompt chunk routes to nearly every expert of every layer, so prefill streams whole
layers: while layer l computes, the copy stream moves every expert of layer l+1 that is not
already resident, without waiting for that layer's routing; as soon as layer l's compute is
queued, the copy stream is queued to refill its buffer with layer l+2 behind it, so copies run
back to back. The store starts this when the current layer's routing touched most of its experts
(a short extend after a prefix hit does not, and moves only its misses). The two "layer buffers"
are not fixed regions: they are slots claimed from the one LRU, protected while their layer is in use,
so what prefill leaves behind is the decode cache's initial state and experts already resident are
used where they are. The chunk gets only those two layers of room: the store holds the rest of
the cache, the most recently used rows, for the decode that follows (`PrefillStreaming.begin`).

Needs room for two whole layers (2E slots); with less, the store falls back to on-demand fills
and says so once.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ..spec import ModelSpec
from .cache import SlotCache
from .pool import HostPool

STREAM_FRACTION = 0.75  # a layer routed to this share of its experts makes prefill stream whole layers
STREAM_ITEMS = 4  # ... if it also routes this many items per expert: the next layer then needs ~all of its own


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
        missing = [r for r in want if r not in protected]
        slots = cache.claim_many(missing, protected)
        filled = missing[: len(slots)]
        if self.stream is not None:  # the copies must not start before the slots' last readers
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            for row, slot in zip(filled, slots, strict=True):
                cache.fill(slot, self.pool.slot(row))
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



class PrefillStreaming:
    """The one owner of the prefill policy: whether a layer streams the next layers in whole,
    and how much of the cache a chunk-sized forward may use. The store tells it where each
    layer's routing landed (`begin`, `ahead`, `end`)."""

    def __init__(self, spec: ModelSpec, prefetcher: LayerPrefetcher | None):
        self.spec, self.prefetcher = spec, prefetcher
        self.holding = False  # a chunk-sized forward holds the hottest rows (`begin`)
        self.open_layer: int | None = None  # a MoE layer whose forward has more pieces to run

    def begin(self, cache: SlotCache, moe_index: int, active: int, items: int, final: bool) -> set[int]:
        """A layer's routing is known: hold the cache for a chunk-sized batch, and wait for the
        rows streamed in ahead for it (returned: they count as this layer's fills).

        A chunk-sized batch (one that routes to most of a layer's experts) sends every expert
        of every layer through the cache. Only what that needs is given to it: the staging room
        for two layers while streaming (one for on-demand fills: an extend's), and the rest of
        the cache, the most recently used rows, stays resident for the decode that follows. Held
        from the forward's first chunk-sized layer to its last MoE layer."""
        if moe_index == 0 and self.open_layer != 0:
            self.release(cache)  # a new forward (not the next piece of its first layer)
        if not self.holding and active >= STREAM_FRACTION * self.spec.num_experts:
            staging = (2 if self.streams(cache, active, items) else 1) * self.spec.num_experts
            cache.hold(cache.capacity - staging)
            self.holding = True
        self.open_layer = None if final else moe_index
        return set(self.prefetcher.wait(moe_index)) if self.prefetcher else set()

    def streams(self, cache: SlotCache, active: int, items: int) -> bool:
        """Whether a layer with this routing streams whole layers ahead (see `ahead`)."""
        p, e = self.prefetcher, self.spec.num_experts
        return p is not None and active >= STREAM_FRACTION * e and items >= STREAM_ITEMS * e and p.fits(cache)

    def ahead(self, cache: SlotCache, moe_index: int, active: int, items: int, layers: int) -> None:
        """Prefill streams whole layers: when this layer's routing touches most of its experts,
        the next ones' will too, so copy layer `moe_index + layers` in without waiting for its
        routing. layers=1 runs before this layer's compute and only starts anything on a chunk's
        first layer; layers=2 runs after it, so the copy stream refills this layer's buffer while
        the compute stream works on the next layer: the copies run back to back. A short extend
        after a prefix hit moves only its misses: even where its routing touches most experts (a
        32-token extend of uniform routing: 256 items over 128 experts reach ~75% of them), a
        whole next layer would be a quarter waste, with too little compute to hide the copies
        behind (streaming was 2x slower than on-demand there)."""
        if self.streams(cache, active, items):
            p = self.prefetcher
            p.prefetch(cache, moe_index + layers, set(p.rows(moe_index + layers - 1)))

    def end(self, cache: SlotCache, moe_index: int, active: int, items: int, final: bool) -> None:
        """A layer's device work is queued: the next piece of it would find its buffer refilled;
        the forward's last MoE layer gives the held cache back."""
        if final:
            self.ahead(cache, moe_index, active, items, 2)
        if final and moe_index == self.spec.num_moe_layers - 1:
            self.release(cache)

    def release(self, cache: SlotCache) -> None:
        cache.release()
        self.holding = False
