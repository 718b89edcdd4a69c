"""ExpertStore: the one call a family makes, `run(layer, hidden, topk_ids, topk_weights)`.

Per MoE layer: de-duplicate the active experts, plan hits / fills / CPU set, start the CPU
branch first, fill and evaluate hits + fills on the device, then merge. The merge is exact:
each (token, k) assignment's weighted output lands in its own row of a buffer, whichever tier
computed it, and the rows are summed over k in a fixed order, so results never depend on cache
size or split (bitwise on CPU in float32).

Experts whose weights sit in host memory run through the CPU kernel (`ftkit.kernels.cpu`), one
call per layer. When the device tier is the CPU too, its hits and fills go through the same kernel:
the kernel's result for an assignment does not depend on what shares the call, so every strategy
stays bitwise equal to `fused`. On CUDA the device tier uses torch, and the two tiers agree to
float32 rounding, not bitwise. Without a compiler every tier uses the torch path.

During a CUDA graph decode step (engine/graphs.py) `run` hands the layer to `DevicePlan`, which
makes the same decisions on the GPU; the next host-planned call takes the residency back first.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from ftkit.kernels.cpu import load as load_cpu_kernel
from ftkit.vocab import CPU, FUSED, HYBRID, OFFLOAD

from ..spec import ModelSpec
from .cache import SlotCache
from .cpu import CPUExecutor
from .planner import CPU_MAX_TOKENS, LayerPlan, Planner
from .pool import HostPool, expert_forward, expert_weights
from .prefill import LayerPrefetcher
from .stats import ExpertStats, LayerClock

if TYPE_CHECKING:
    from .device_plan import DevicePlan

__all__ = ["ExpertStore"]

STREAM_FRACTION = 0.75  # a layer routed to this share of its experts makes prefill stream whole layers
STREAM_ITEMS = 4  # ... if it also routes this many items per expert: the next layer then needs ~all of its own
GEMV_MAX_ITEMS = 64  # routed (token, expert) items up to which decode uses the grouped GEMV
HOST_SORT_ITEMS = 4096  # routed items up to which the host sorts them by expert (beyond: the device)


def _triton(name: str):
    """A module of ftkit.kernels.triton (`experts`: the grouped expert kernels, `zero_copy`: the
    mapped-memory waits), or None where Triton is missing (torch per expert then)."""
    try:
        return importlib.import_module(f"ftkit.kernels.triton.{name}")
    except ImportError:
        return None


class ExpertStore:
    def __init__(
        self,
        spec: ModelSpec,
        pool: HostPool,
        strategy: str,
        capacity: int,
        device: str | torch.device = "cpu",
        threads: int | None = None,
        ratio: float | None = None,
        dtype: torch.dtype = torch.float32,
        stream_prefill: bool | None = None,
    ):
        """`strategy` and `capacity` (device cache slots) as engine/resolve.py resolves them;
        `stream_prefill`: copy whole layers ahead during long prefill chunks (default: on CUDA
        with a cache of at least two layers)."""
        self.spec, self.pool, self.dtype = spec, pool, dtype
        self.device = torch.device(device)
        self.strategy = strategy
        rows = spec.num_expert_rows
        self.cache = SlotCache(capacity, pool.layout.slot_bytes, rows, self.device)
        self.planner = Planner(self.strategy, ratio)
        self.cpu = CPUExecutor(threads)
        self.kernel = load_cpu_kernel()
        self.runner = self.kernel.runner() if self.kernel is not None else None  # the CPU branch's thread
        self.stats = ExpertStats()
        float_slots = pool.layout.dtype != "q8_0"
        self.grouped = _triton("experts") if self.device.type == "cuda" and float_slots else None
        cuda_runner = self.device.type == "cuda" and self.runner is not None
        self.zero_copy = _triton("zero_copy") if cuda_runner else None
        self._done: tuple[torch.Tensor, object] | None = None  # the done word, and its mapped view
        self._done_value = 0
        self._signalled: int | None = None  # a signalled CPU call not yet ended: the bytes it runs
        # its layer's fills (start and end events) and how long after they started the CPU did
        self._fill_span: tuple[torch.cuda.Event, torch.cuda.Event, float] | None = None
        if stream_prefill is None:
            stream_prefill = self.device.type == "cuda" and self.strategy in (OFFLOAD, HYBRID)
        self.prefetcher = LayerPrefetcher(pool, self.device) if stream_prefill else None
        if self.prefetcher and not self.prefetcher.fits(self.cache):
            print(f"ftkit: expert cache of {capacity} slots holds fewer than two layers "
                  f"({2 * spec.num_experts}): disabling prefill layer streaming (on-demand fills)",
                  file=sys.stderr)
        self._fill_events: deque = deque()  # (bytes, start, end) CUDA events of fills not yet timed
        self.device_plan: DevicePlan | None = None  # device-side planning of graph decode steps
        self.device_planned = False  # set while layers are planned on the device (graph decode, extends)
        self.version = 0  # bumped when the cache is rebuilt (captured graphs point at its slots)
        self.holding = False  # a chunk-sized forward holds the hottest rows (`_hold_hottest`)
        self.open_layer: int | None = None  # a MoE layer whose forward has more pieces to run
        # each next piece's routing (the ids tensor itself), read back ahead by `expect` and sorted
        self.ahead: deque[tuple[torch.Tensor, np.ndarray, list[int]]] = deque()
        self.clock: LayerClock | None = None  # marks each host-planned layer's phases when set
        if self.strategy == FUSED:
            for row in range(rows):
                self.cache.fill(self.cache.claim(row, set()), pool.slot(row))

    @property
    def ratio(self) -> float | None:
        return self.planner.ratio

    def expect(self, layer: int, topk_ids: list[torch.Tensor]) -> None:
        """A layer-by-layer prefill's pieces of `layer`, routed before any of their experts run:
        on a GPU their routing comes back to the host in one copy, so the GPU drains once a layer
        instead of once a piece, and the host plans each next piece while the GPU runs the one
        before (a 32768-token prompt in pieces of 8192: 12 drains instead of 48). Not where the
        CPU branch may get work: its inputs are staged to ride on each piece's own read-back."""
        if len(topk_ids) < 2 or not topk_ids[0].is_cuda or self.strategy == CPU or (
                self.strategy == HYBRID
                and min(ids.numel() for ids in topk_ids) <= CPU_MAX_TOKENS * self.spec.num_experts):
            return
        sorted_ = self._device_sorted([ids.reshape(-1) for ids in topk_ids])
        self.ahead = deque((ids, *done) for ids, done in zip(topk_ids, sorted_, strict=True))

    def _routing(self, topk_ids: torch.Tensor) -> tuple[np.ndarray, list[int]]:
        """The assignments sorted by expert and each expert's count: read back by `expect` (the
        same ids tensor, so nothing left by a forward that failed half-way is ever taken) or now."""
        if self.ahead and self.ahead[0][0] is topk_ids:
            _, order, counts = self.ahead.popleft()
            return order, counts
        self.ahead.clear()
        return self._sorted(topk_ids.reshape(-1))

    def run(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            final: bool = True) -> torch.Tensor:
        """Gate-weighted sum of the routed experts for `hidden` [T, H] at model layer `layer`.
        `final=False`: more pieces of this layer follow (a layer-by-layer prefill), so the layer
        streamed in stays where it is until its last piece."""
        if self.device_plan is not None and self.device_plan.on_device:
            if self.device_planned:
                return self.device_plan.run(layer, hidden, topk_ids, topk_weights)
            self.device_plan.to_host()  # the host planner takes over again (prefill, batches)
        self._mark("enter")
        t, k = topk_ids.shape
        moe = self.spec.moe_index(layer)
        base = moe * self.spec.num_experts
        staged = self._stage(hidden, topk_weights)  # before the read-back below, which it rides on
        order, counts = self._routing(topk_ids)
        self._mark("routed")
        self._collect_cpu()
        groups: dict[int, np.ndarray] = {}  # row -> flat assignment indices (t * k + j)
        start = 0
        for e, n in enumerate(counts):
            if n:
                groups[base + e] = order[start : start + n]
                start += n
        # Most-used experts first: they are the ones worth filling.
        rows = sorted(groups, key=lambda r: (-len(groups[r]), r))
        self._hold_hottest(moe, len(rows), t * k)
        self.open_layer = None if final else moe
        streamed = set(self.prefetcher.wait(moe)) if self.prefetcher else set()
        fill_all = t * k > CPU_MAX_TOKENS * len(rows)
        native = not fill_all and self._shares(hidden)
        # On a GPU the CPU branch's end is signalled to the stream, which waits for it before the
        # merge, so the host goes straight on to launch the layer's device work and the next
        # layer's while both branches run: the split is then decided up front, from how the
        # last layers' branches ended (`Planner.balance`). With host slots the split is shared
        # while both run (`_share`).
        signal = native and self.zero_copy is not None
        shared = native and not signal
        plan = self.planner.plan(self.cache, rows, fill_all=fill_all, shared=shared)
        if streamed:  # copied in ahead for this layer: count them as this layer's fills
            plan.fills += [(r, s) for r, s in plan.hits if r in streamed]
            plan.hits = [(r, s) for r, s in plan.hits if r not in streamed]

        weights = topk_weights.reshape(-1, 1)
        y = torch.zeros((t * k, hidden.shape[-1]), dtype=hidden.dtype, device=hidden.device)
        self._time_cuda_fills()
        if shared:
            wait_cpu, host_y = self._share(plan, groups, hidden, weights, y, k, staged)
        else:
            fills = [(r, s) for r, s in plan.fills if r not in streamed]
            timed = bool(plan.cpu)  # the planner weighs fills by their time beside a CPU branch
            # looked up once a layer: torch.cuda.current_stream() costs ~30 us of Python a call
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            # `balance` weighs the two branches, also one given nothing (it took no time), where the
            # split decided it: a single miss is filled whatever the split
            weigh = signal and len(fills) + len(plan.cpu) > 1
            t0 = time.perf_counter()  # the device is idle here: its first copy starts at once
            first = self._fill(fills[:1], timed, stream)  # the copy engine starts now; the CPU while it copies
            wait_cpu, host_y = self._start_cpu(plan, groups, hidden, weights, y, k, staged, signal=signal)
            lead = time.perf_counter() - t0
            self._mark("started")
            rest = self._fill(fills[1:], timed, stream)
            if weigh and (first is not None or self._signalled is not None):
                if first is None:
                    first = (_timing_event(stream),) * 2
                self._fill_span = first[0], (rest or first)[1], lead
            self._mark("met")
        self.stats.record(layer, plan)
        self._stream_ahead(moe, len(rows), t * k, 1)
        resident = plan.hits + plan.fills
        if self.device.type == "cpu":
            self._host_experts([self.cache.slots[s] for _, s in resident], [groups[r] for r, _ in resident],
                               hidden, weights, y, k)
        elif self.grouped is not None and t * k <= GEMV_MAX_ITEMS and resident:
            self._device_gemv(resident, groups, hidden, weights, y, k)
        elif self.grouped is not None and resident:
            self._device_gemm(resident, groups, hidden, weights, y, k)
        elif resident:
            self._device_segments(resident, groups, hidden, weights, y, k)
        if final:  # the next piece of this layer would find its buffer refilled
            self._stream_ahead(moe, len(rows), t * k, 2)
        if final and moe == self.spec.num_moe_layers - 1:
            self._release()
        busy = wait_cpu()
        self._mark("cpu_done")
        if busy:
            self.planner.observe_cpu(len(plan.cpu) * self.pool.layout.slot_bytes, busy)
        if host_y is not None:  # the CPU set's rows, disjoint from the device's: copied in place
            rows_y, idx = host_y
            if self._signalled is not None:  # the stream waits for the signalled CPU call's rows
                self.zero_copy.wait_word(self._done[1], self._done_value)
            y.index_copy_(0, idx.to(y.device, non_blocking=True), rows_y.to(y.device, non_blocking=True).to(y.dtype))
        self._mark("exit")
        return y.view(t, k, -1).sum(dim=1)

    def _mark(self, name: str) -> None:
        if self.clock is not None:
            self.clock.mark(name)

    def _stage(self, hidden: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """On a GPU, queue the CPU branch's inputs (float32 activations and router weights) into
        page-locked host memory ahead of the routing read-back, so that one synchronisation per
        layer serves both. Only where the CPU may get work: hybrid batches small enough that
        not every miss is filled (`CPU_MAX_TOKENS`), and the cpu strategy."""
        if hidden.device.type == "cpu" or self.strategy not in (CPU, HYBRID):
            return None
        if self.strategy == HYBRID and weights.numel() > CPU_MAX_TOKENS * self.spec.num_experts:
            return None
        n = hidden.numel()  # one page-locked block for both (an allocation costs ~40 us of Python)
        both = torch.empty(n + weights.numel(), dtype=torch.float32, pin_memory=True)
        x, w = both[:n].view(hidden.shape), both[n:].view(-1, 1)
        x.copy_(hidden.float(), non_blocking=True)
        w.copy_(weights.reshape(-1, 1), non_blocking=True)
        return x, w

    def _sorted(self, flat: torch.Tensor) -> tuple[np.ndarray, list[int]]:
        """The assignments' flat indices grouped by expert (stable) on the host, and each
        expert's count. Prefill-sized batches sort on the device and hand both over in one
        copy (a CPU sort of an 8192-token chunk's 65536 assignments took 1-5 ms per layer; an
        extend's few hundred take microseconds, less than the device's sort launches). The
        host's bookkeeping of a layer is numpy: torch costs microseconds per call on tiny arrays."""
        if flat.is_cuda and flat.numel() > HOST_SORT_ITEMS:
            return self._device_sorted([flat])[0]
        flat = flat.cpu().numpy().astype(np.int64, copy=False)
        return np.argsort(flat, kind="stable"), np.bincount(flat, minlength=self.spec.num_experts).tolist()

    def _device_sorted(self, flats: list[torch.Tensor]) -> list[tuple[np.ndarray, list[int]]]:
        """`_sorted` of each of `flats` (device tensors), sorted and counted on the device and
        handed over together in one copy."""
        e = self.spec.num_experts
        both = torch.cat([t for f in flats for t in (torch.argsort(f, stable=True), torch.bincount(f, minlength=e))])
        parts = np.split(both.cpu().numpy(), np.cumsum([n for f in flats for n in (f.numel(), e)])[:-1])
        return [(order, counts.tolist()) for order, counts in zip(parts[::2], parts[1::2], strict=True)]

    def _hold_hottest(self, moe_index: int, active: int, items: int) -> None:
        """A chunk-sized batch (one that routes to most of a layer's experts) sends every expert
        of every layer through the cache. Only what that needs is given to it: the staging room
        for two layers while streaming (one for on-demand fills: an extend's), and the rest of
        the cache, the most recently used rows, stays resident for the decode that follows. Held
        from the forward's first chunk-sized layer to its last MoE layer."""
        if moe_index == 0 and self.open_layer != 0:
            self._release()  # a new forward (not the next piece of its first layer)
        if self.holding or active < STREAM_FRACTION * self.spec.num_experts:
            return
        staging = (2 if self._streams(active, items) else 1) * self.spec.num_experts
        self.cache.hold(self.cache.capacity - staging)
        self.holding = True

    def _streams(self, active: int, items: int) -> bool:
        """Whether a layer with this routing streams whole layers ahead (see `_stream_ahead`)."""
        p, e = self.prefetcher, self.spec.num_experts
        return p is not None and active >= STREAM_FRACTION * e and items >= STREAM_ITEMS * e and p.fits(self.cache)

    def _release(self) -> None:
        self.cache.release()
        self.holding = False

    def _stream_ahead(self, moe_index: int, active: int, items: int, ahead: int) -> None:
        """Prefill streams whole layers: when this layer's routing touches most of its experts,
        the next ones' will too, so copy layer `moe_index + ahead` in without waiting for its
        routing. ahead=1 runs before this layer's compute and only starts anything on a chunk's
        first layer; ahead=2 runs after it, so the copy stream refills this layer's buffer while
        the compute stream works on the next layer: the copies run back to back. A short extend
        after a prefix hit moves only its misses: even where its routing touches most experts (a
        32-token extend of uniform routing: 256 items over 128 experts reach ~75% of them), a
        whole next layer would be a quarter waste, with too little compute to hide the copies
        behind (streaming was 2x slower than on-demand there)."""
        if self._streams(active, items):
            p = self.prefetcher
            p.prefetch(self.cache, moe_index + ahead, set(p.rows(moe_index + ahead - 1)))

    def _device_gemv(self, resident: list[tuple[int, int]], groups: dict[int, np.ndarray],
                     x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, k: int) -> None:
        """Every (token, expert) item of the resident experts in two grouped launches, the work
        list (slot, token, assignment per item, then the count) uploaded in one copy."""
        idx = np.concatenate([groups[r] for r, _ in resident])
        n = len(idx)
        slots = np.repeat([s for _, s in resident], [len(groups[r]) for r, _ in resident])
        meta = _upload(np.concatenate([slots, idx // k, idx, [n]]), x.device)
        idx_d = meta[2 * n : 3 * n]
        out = self.grouped.grouped_expert_gemv(x, self.cache.slots, self.pool.layout, meta[:n], meta[n : 2 * n],
                                               w[idx_d, 0].contiguous(), meta[3 * n :])
        y[idx_d] = out

    def _device_gemm(self, resident: list[tuple[int, int]], groups: dict[int, np.ndarray],
                     x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, k: int) -> None:
        """Prefill-sized work: every resident expert of the layer in two grouped launches, its
        assignments sorted by expert and uploaded once with the tile list."""
        idx = np.concatenate([groups[r] for r, _ in resident])
        tiles = self.grouped.gemm_tiles([(s, len(groups[r])) for r, s in resident])
        meta = _upload(np.concatenate([idx // k, idx, tiles]), x.device)
        n = len(idx)
        tokens, dst = meta[:n], meta[n : 2 * n]
        self.grouped.grouped_expert_gemm(x, self.cache.slots, self.pool.layout, meta[2 * n :], tokens, dst,
                                         w[dst, 0].contiguous(), y)

    def _device_segments(self, resident: list[tuple[int, int]], groups: dict[int, np.ndarray],
                         x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, k: int) -> None:
        """Without the grouped kernels (q8_0 slots, no Triton): the assignments sorted by expert,
        uploaded once, each expert one segment of a gathered batch."""
        idx = np.concatenate([groups[r] for r, _ in resident])
        ends = np.cumsum([len(groups[r]) for r, _ in resident]).tolist()
        idx_d = _upload(idx, x.device).long()
        xs = x[idx_d // k]
        out = torch.empty_like(xs)
        start = 0
        for (_, slot), end in zip(resident, ends, strict=True):
            gate, up, down = expert_weights(self.pool.layout, self.cache.slots[slot], x.dtype)
            out[start:end] = expert_forward(xs[start:end], gate, up, down)
            start = end
        y[idx_d] = out * w[idx_d]

    def _fill(self, fills: list[tuple[int, int]], timed: bool = True, stream: torch.cuda.Stream | None = None,
              ) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """Copy the fills in and, if `timed`, time them for the planner (CUDA: with events on
        `stream`, the current one, read when done). Returns those events on CUDA (the up-front
        split's balance needs when the fills ran, timed or not)."""
        if not fills:
            return None
        nbytes = len(fills) * self.pool.layout.slot_bytes
        cuda = self.device.type == "cuda"
        if cuda:
            stream = stream or torch.cuda.current_stream(self.device)
            start = _timing_event(stream)
        t0 = time.perf_counter()
        for row, slot in fills:
            self.cache.fill(slot, self.pool.slot(row))
        if cuda:
            end = _timing_event(stream)
            if timed:
                self._fill_events.append((nbytes, start, end))
            return start, end
        if timed:
            self.planner.observe_fill(nbytes, time.perf_counter() - t0)
        return None

    def _time_cuda_fills(self) -> None:
        """Feed the planner the fills that have completed since the last layer (never waits)."""
        while self._fill_events and self._fill_events[0][2].query():
            nbytes, start, end = self._fill_events.popleft()
            self.planner.observe_fill(nbytes, start.elapsed_time(end) / 1e3)

    def _host_experts(self, slots: list[torch.Tensor], idxs: list[np.ndarray], x: torch.Tensor,
                      w: torch.Tensor, y: torch.Tensor, k: int, rows: list[np.ndarray] | None = None) -> None:
        """Experts whose slots are in host memory, in one kernel call (float32 in and out).
        `rows`: per expert, the rows of `y` its assignments go to (default: the assignments)."""
        if not slots:
            return
        rows = idxs if rows is None else rows
        if self.kernel is None:
            for slot, idx, row in zip(slots, idxs, rows, strict=True):
                idx, row = torch.from_numpy(idx), torch.from_numpy(row)
                gate, up, down = expert_weights(self.pool.layout, slot, x.dtype)
                y[row] = (expert_forward(x[idx // k], gate, up, down) * w[idx]).to(y.dtype)
            return
        row = np.concatenate(rows)
        if x.dtype == torch.float32 and y.dtype == torch.float32:
            self.kernel.experts(self.pool.layout, slots, idxs, x.contiguous(), w, y, k, self.cpu.threads, row)
            return
        out = torch.zeros(y.shape, dtype=torch.float32)
        self.kernel.experts(self.pool.layout, slots, idxs, x.float(), w, out, k, self.cpu.threads, row)
        row_t = torch.from_numpy(row)
        y[row_t] = out[row_t].to(y.dtype)

    def _shares(self, hidden: torch.Tensor) -> bool:
        """Whether a hybrid layer's misses go to a split shared while both branches run: where
        the CPU set runs on the runner's native thread (float32 in and out)."""
        native = self.runner is not None and (hidden.device.type != "cpu" or hidden.dtype == torch.float32)
        return self.strategy == HYBRID and native

    def _share(self, plan: LayerPlan, groups: dict[int, np.ndarray], hidden: torch.Tensor,
               weights: torch.Tensor, y: torch.Tensor, k: int, staged: tuple[torch.Tensor, torch.Tensor] | None,
               ) -> tuple[Callable[[], float | None], tuple[torch.Tensor, torch.Tensor] | None]:
        """Split the misses (`plan.cpu`, most-used first) while both branches run: the runner
        takes experts from the back, one at a time, and this thread fills from the front (the
        first before it starts the runner), the next one as soon as the copy engine starts on
        the one before, until the two meet. A
        split fixed in advance from measured rates was off by up to a millisecond per layer in
        an extend: the rates move with the split itself (DMA and the CPU share host memory
        bandwidth) and with the tokens per expert. Leaves `plan` as it ended; returns as
        `_start_cpu`."""
        misses, split = plan.cpu, self.kernel.new_split(len(plan.cpu))
        protected = {r for r, _ in plan.hits + plan.fills}
        pending: deque = deque()  # CUDA events of the fills queued and not yet known to have started
        # looked up once: torch.cuda.current_stream() took ~30 us of Python per event recorded
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        taken, wait_cpu, host_y = 0, None, None
        while taken < len(misses):
            if len(pending) > 1:  # the one before the last is done: the last is being copied
                if not self.kernel.split_left(split):
                    break  # the CPU took the rest: go on to the device's work without waiting
                pending.popleft().synchronize()
            row = misses[taken]
            slot = self.cache.claim(row, protected)
            if slot is None:  # no slot this layer is not using: the CPU takes the rest
                break
            if self.kernel.take_front(split) is None:
                self.cache.unclaim(row, slot)
                break
            self.cache.fill(slot, self.pool.slot(row))
            if stream is not None:
                pending.append(torch.cuda.Event())  # waits spin: a sleeping thread woke up to 2 ms late
                pending[-1].record(stream)
            plan.fills.append((row, slot))
            protected.add(row)
            taken += 1
            if wait_cpu is None:  # the first copy is under way: start the CPU branch meanwhile
                wait_cpu, host_y = self._start_cpu(plan, groups, hidden, weights, y, k, staged, split)
                self._mark("started")
        if wait_cpu is None:
            wait_cpu, host_y = self._start_cpu(plan, groups, hidden, weights, y, k, staged, split)
        self._mark("met")
        plan.cpu = misses[taken:]
        if host_y is not None:  # only the rows of the experts the CPU took come back
            done = sum(len(groups[r]) for r in misses[:taken])
            host_y = (host_y[0][done:], host_y[1][done:])
        return wait_cpu, host_y

    def _start_cpu(self, plan: LayerPlan, groups: dict[int, np.ndarray], hidden: torch.Tensor,
                   weights: torch.Tensor, y: torch.Tensor, k: int,
                   staged: tuple[torch.Tensor, torch.Tensor] | None, split: np.ndarray | None = None,
                   signal: bool = False,
                   ) -> tuple[Callable[[], float | None], tuple[torch.Tensor, torch.Tensor] | None]:
        """Start the CPU set from the host pool: one kernel call on the runner's native thread,
        or one torch job per expert on the thread pool without the kernel. Returns a wait that
        gives the branch's own compute time (the planner weighs it by that, as it weighs fills
        by their copy time, not by the hand-over before them) and, on a GPU, the page-locked
        buffer it fills (the set's rows in `plan.cpu` order) with their rows of `y` (None: it
        writes `y`, in host memory). `split`: the set is shared with `_share`'s fills. `signal`
        (a GPU, the native runner): the call writes the done word the stream waits on before
        the merge; the wait returned is a no-op and `_collect_cpu` reads its time later."""
        if not plan.cpu:
            return lambda: None, None
        idxs = [groups[r] for r in plan.cpu]
        slots = [self.pool.slot(r) for r in plan.cpu]
        if hidden.device.type == "cpu":
            x, w, out, rows = hidden, weights, y, idxs
        else:
            # `staged` came with the routing; large batches (prefill on the cpu strategy) copy now
            x, w = staged if staged is not None else (hidden.float().cpu(), weights.float().cpu())
            ends = np.cumsum([len(i) for i in idxs])
            out = torch.empty((int(ends[-1]), y.shape[-1]), dtype=torch.float32, pin_memory=True)
            rows = None  # the compact rows of `out`, in order
        host = None if out is y else (out, torch.from_numpy(np.concatenate(idxs)))
        if self.runner is not None and x.dtype == out.dtype == torch.float32:
            signal = signal and host is not None
            out_rows = np.arange(out.shape[0]) if rows is None else np.concatenate(rows)
            self.kernel.start_experts(self.runner, self.pool.layout, slots, idxs, x.contiguous(), w, out, k,
                                      self.cpu.threads, out_rows, split, self._done_word() if signal else None)
            if signal:
                self._signalled = len(slots) * self.pool.layout.slot_bytes
                return lambda: None, host
            return self.runner.wait, host
        if rows is None:  # the torch path hands each expert its own rows
            rows = np.split(np.arange(out.shape[0]), ends[:-1])
        spans: list[tuple[float, float]] = []

        def job(part: slice):
            def run() -> None:
                start = time.perf_counter()
                with torch.inference_mode():  # thread-local: the caller's mode does not carry over
                    self._host_experts(slots[part], idxs[part], x, w, out, k, rows[part])
                spans.append((start, time.perf_counter()))
            return run

        parts = [slice(None)] if self.kernel else [slice(i, i + 1) for i in range(len(idxs))]
        futures = self.cpu.start([job(p) for p in parts])

        def wait() -> float:
            CPUExecutor.wait(futures)
            return max(end for _, end in spans) - min(start for start, _ in spans)
        return wait, host

    def _done_word(self) -> tuple[int, int]:
        """(host address, value) of the done word for the next signalled CPU call."""
        if self._done is None:
            word = torch.zeros(16, dtype=torch.int32, pin_memory=True)  # a 64-byte line of its own
            self._done = word, self.zero_copy.Mapped(word)
        self._done_value = self._done_value % (2**31 - 1) + 1  # never 0: the cleared state
        return self._done[0].data_ptr(), self._done_value

    def _collect_cpu(self) -> None:
        """End the last layer's signalled CPU call (after the routing read-back the stream has
        waited for it, so it has ended) and give the planner its time and the layer's outcome."""
        span, self._fill_span = self._fill_span, None
        cpu_seconds = 0.0  # a layer that left the CPU nothing: it ended at once, idle while fills ran
        if self._signalled is not None:
            nbytes, self._signalled = self._signalled, None
            busy = self.runner.wait()
            if not busy:
                return
            self.planner.observe_cpu(nbytes, busy)
            cpu_seconds = span[2] + busy if span else 0.0
        if span is not None and span[1].query():  # both from the first fill's start
            self.planner.balance(span[0].elapsed_time(span[1]) / 1e3, cpu_seconds)

    def resident_rows(self) -> list[int]:
        """The resident rows, least recently used first (takes the residency back from graph
        decode: a synchronisation)."""
        if self.device_plan is not None:
            self.device_plan.to_host()
        return list(self.cache.lru)

    def resident(self) -> int:
        """Experts resident in the device cache: from the device table while graph decode owns
        the residency (the host cache catches up only when the host planner takes over)."""
        p = self.device_plan
        if p is not None and p.on_device:
            return int((p.owner >= 0).sum())
        return len(self.cache)

    def device_plan_unsupported(self) -> str | None:
        """Why graph decode cannot plan on the device with this store, or None."""
        k = self.spec.top_k
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed"
        if self.pool.layout.dtype == "q8_0" and self.strategy != CPU:
            return "the grouped GEMV reads float expert slots, not q8_0"
        if not self.pool.pinned and self.device.type == "cuda":
            return "the host pool is not page-locked"
        if self.strategy != CPU and self.cache.capacity < 2 * k:
            return f"the expert cache holds fewer than {2 * k} slots (2 x top-k)"
        if self.strategy in (CPU, HYBRID) and self.kernel is None:
            return "the CPU branch needs the compiled CPU kernel"
        return None

    def device_plan_for_graphs(self) -> DevicePlan:
        if self.device_plan is None:
            from .device_plan import DevicePlan  # imports Triton

            # its state must stay writable outside inference mode (graph capture restores it),
            # also when an extend under inference mode creates it
            with torch.inference_mode(False):
                self.device_plan = DevicePlan(self.spec, self.pool, self.cache, self.strategy, self.planner.ratio,
                                              self.kernel, self.cpu.threads, self.stats)
            self.stats.pull = self.device_plan.flush_stats
        return self.device_plan

    def _drop_device_plan(self) -> None:
        if self.device_plan is not None:
            self.device_plan.to_host()
            self.device_plan.close()
            self.device_plan = None
            self.stats.pull = None

    def rebuild(self, capacity: int) -> None:
        """Resize the device cache to `capacity` slots, 1 to the model's rows (call at a safe
        point: no `run` in flight; the scheduler checks the count); the host pool is
        untouched, so refills come from it. A transaction: if the new cache cannot be allocated
        the old one stays (or, when both did not fit together, an empty one of the old size) and
        the error is raised."""
        if self.strategy in (FUSED, CPU):
            raise ValueError(f"strategy {self.strategy} has no resizable cache")
        self._drop_device_plan()
        self.version += 1
        self.holding = False
        rows = self.spec.num_expert_rows
        old = self.cache.capacity
        try:
            self.cache = SlotCache(capacity, self.pool.layout.slot_bytes, rows, self.device)
            return
        except (RuntimeError, MemoryError):  # not both at once: free the old one and retry
            pass
        self.cache = SlotCache(0, self.pool.layout.slot_bytes, rows, self.device)
        try:
            self.cache = SlotCache(capacity, self.pool.layout.slot_bytes, rows, self.device)
        except (RuntimeError, MemoryError) as e:
            self.cache = SlotCache(old, self.pool.layout.slot_bytes, rows, self.device)
            raise MemoryError(f"cannot allocate {capacity} expert slots; kept {old}") from e

    def close(self) -> None:
        self._drop_device_plan()
        self.cpu.close()
        if self.runner is not None:
            self.runner.close()


def _timing_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A timing event recorded on `stream` now."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def _upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small int32 work list on `device` (one copy from page-locked memory on a GPU)."""
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32))
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
