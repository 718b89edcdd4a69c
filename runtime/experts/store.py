"""ExpertStore: the one call a family makes, `run(layer, hidden, topk_ids, topk_weights)`.

Per MoE layer: de-duplicate the active experts, plan hits / fills / CPU set, start the CPU
branch first, fill and evaluate hits + fills on the device, then merge. The merge is exact:
each (token, k) assignment's weighted output lands in its own row of a buffer, whichever tier
computed it, and the rows are summed over k in a fixed order, so results never depend on cache
size or split (bitwise on CPU in float32).

Each decision has its own owner, which `run` calls in order: the fill fraction (`Planner`), the
prefill streaming policy (`PrefillStreaming`), the CPU branch (`CPUBranch`) and which kernel
computes the resident experts (`ExpertKernels`). The store owns the cache, the fills and how
the two branches share a layer's misses.

Graph decode and short extends on CUDA (engine/graphs.py) plan their layers on the GPU through
`DevicePlanner`, which makes the same decisions there; the next host-planned call takes the
residency back first.
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

from ftkit.kernels.cpu import int8_activations
from ftkit.kernels.cpu import load as load_cpu_kernel
from ftkit.kernels.triton import optional
from ftkit.vocab import CPU, FUSED, HYBRID, OFFLOAD

from ..spec import ModelSpec
from .cache import SlotCache
from .cpu import CPUExecutor
from .cpu_branch import CPUBranch
from .dispatch import ExpertKernels
from .planner import CPU_MAX_TOKENS, LayerPlan, Planner
from .pool import HostPool
from .stats import ExpertStats, LayerClock
from .streaming import LayerPrefetcher, PrefillStreaming

if TYPE_CHECKING:
    from .device_planner import DevicePlanner

__all__ = ["ExpertStore"]

HOST_SORT_ITEMS = 4096  # routed items up to which the host sorts them by expert (beyond: the device)




class ExpertStore:
    def __init__(
        self,
        spec: ModelSpec,
        pool: HostPool,
        strategy: str,
        capacity: int,
        device: str | torch.device = "cpu",
        threads: int | None = None,
        fill_fraction: float | None = None,
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
        self.planner = Planner(self.strategy, fill_fraction)
        self.stats = ExpertStats()
        kernel = load_cpu_kernel()
        grouped = optional("experts") if self.device.type == "cuda" else None
        self.kernels = ExpertKernels(pool.layout, self.device, kernel, threads or CPUExecutor.default_threads(), grouped,
                                     int8_activations(dtype))
        # hybrid's prefill-sized batches fill every miss; so do the cpu strategy's where it has
        # device slots (resolve.prefill_staging): long prompts stream through them
        self.fills_prefill = self.strategy == HYBRID or (self.strategy == CPU and capacity > 0)
        self.cpu = CPUBranch(spec, pool, self.strategy, self.device, self.kernels, self.fills_prefill, threads)
        # its layer's fills (start and end events) and how long after they started the CPU did
        self._fill_span: tuple[torch.cuda.Event, torch.cuda.Event, float] | None = None
        if stream_prefill is None:
            stream_prefill = self.device.type == "cuda" and (self.strategy == OFFLOAD or self.fills_prefill)
        prefetcher = LayerPrefetcher(pool, self.device) if stream_prefill else None
        self.streaming = PrefillStreaming(spec, prefetcher)
        if prefetcher and not prefetcher.fits(self.cache):
            print(f"ftkit: expert cache of {capacity} slots holds fewer than two layers "
                  f"({2 * spec.num_experts}): disabling prefill layer streaming (on-demand fills)",
                  file=sys.stderr)
        self._fill_events: deque = deque()  # (bytes, start, end) CUDA events of fills not yet timed
        self.device_planner: DevicePlanner | None = None  # device-side planning of graph decode steps
        self.version = 0  # bumped when the cache is rebuilt (captured graphs point at its slots)
        # each next piece's routing (the ids tensor itself), read back ahead by `expect` and sorted
        self.ahead: deque[tuple[torch.Tensor, np.ndarray, list[int]]] = deque()
        self.clock: LayerClock | None = None  # marks each host-planned layer's phases when set
        if self.strategy == FUSED:
            for row in range(rows):
                self.cache.fill(self.cache.claim(row, set()), pool.slot(row))

    def expect(self, layer: int, topk_ids: list[torch.Tensor]) -> None:
        """A layer-by-layer prefill's pieces of `layer`, routed before any of their experts run:
        on a GPU their routing comes back to the host in one copy, so the GPU drains once a layer
        instead of once a piece, and the host plans each next piece while the GPU runs the one
        before (a 32768-token prompt in pieces of 8192: 12 drains instead of 48). Not where the
        CPU branch may get work: its inputs are staged to ride on each piece's own read-back."""
        if len(topk_ids) < 2 or not topk_ids[0].is_cuda or (self.strategy == CPU and not self.fills_prefill) or (
                self.fills_prefill
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
        if self.device_planner is not None and self.device_planner.on_device:
            self.device_planner.to_host()  # the host planner takes over again (prefill, batches)
        self._mark("enter")
        t, k = topk_ids.shape
        moe = self.spec.moe_index(layer)
        staged = self.cpu.stage(hidden, topk_weights)  # before the read-back below, which it rides on
        order, counts = self._routing(topk_ids)
        self._mark("routed")
        self._collect_cpu()
        groups = _groups(order, counts, moe * self.spec.num_experts)
        rows = sorted(groups, key=lambda r: (-len(groups[r]), r))  # most-used first: worth filling
        streamed = self.streaming.begin(self.cache, moe, len(rows), t * k, final)
        plan, shared, signal = self._plan(rows, t * k, streamed)
        weights = topk_weights.reshape(-1, 1)
        y = torch.zeros((t * k, hidden.shape[-1]), dtype=hidden.dtype, device=hidden.device)
        self._time_cuda_fills()
        if shared:
            wait_cpu, host_y = self._share(plan, groups, hidden, weights, y, k, staged)
        else:
            wait_cpu, host_y = self._fill_beside_cpu(plan, streamed, groups, hidden, weights, y, k, staged, signal)
        self.stats.record(layer, plan)
        self.streaming.ahead(self.cache, moe, len(rows), t * k, 1)
        self.kernels.resident(self.cache, plan.hits + plan.fills, groups, hidden, weights, y, k)
        self.streaming.end(self.cache, moe, len(rows), t * k, final)
        busy = wait_cpu()
        self._mark("cpu_done")
        if busy:
            self.planner.observe_cpu(len(plan.cpu) * self.pool.layout.slot_bytes, busy)
        if host_y is not None:
            self.cpu.merge(y, host_y)
        self._mark("exit")
        return y.view(t, k, -1).sum(dim=1)

    def _plan(self, rows: list[int], items: int, streamed: set[int]) -> tuple[LayerPlan, bool, bool]:
        """The layer's plan, and how its misses are split: `shared` while both branches run
        (CUDA without Triton: `_share`), or up front, with the CPU's end `signal`led to the
        stream where the device has Triton. The stream waits for that signal before the merge,
        so the host goes straight on to launch the layer's device work and the next layer's
        while both branches run; the split then comes from how the last layers' branches ended
        (`Planner.balance`). A CPU device splits up front from the rates and runs the branches
        in turn."""
        fill_all = items > CPU_MAX_TOKENS * len(rows)
        native = not fill_all and self.cpu.shares()
        signal = native and self.cpu.zero_copy is not None
        shared = native and not signal
        plan = self.planner.plan(self.cache, rows, fill_all=fill_all, shared=shared)
        if streamed:  # copied in ahead for this layer: count them as this layer's fills
            plan.fills += [(r, s) for r, s in plan.hits if r in streamed]
            plan.hits = [(r, s) for r, s in plan.hits if r not in streamed]
        return plan, shared, signal

    def _fill_beside_cpu(self, plan: LayerPlan, streamed: set[int], groups: dict[int, np.ndarray],
                         hidden: torch.Tensor, weights: torch.Tensor, y: torch.Tensor, k: int,
                         staged: tuple[torch.Tensor, torch.Tensor] | None, signal: bool,
                         ) -> tuple[Callable[[], float | None], tuple[torch.Tensor, torch.Tensor] | None]:
        """Queue the plan's fills with the CPU set started after the first (the copy engine
        starts at once, the CPU while it copies); returns as CPUBranch.start. With `signal`, the
        span from the first fill's start to the last's end, and the CPU's lead, are kept for
        `_collect_cpu` to weigh the branches by."""
        fills = [(r, s) for r, s in plan.fills if r not in streamed]
        timed = bool(plan.cpu)  # the planner weighs fills by their time beside a CPU branch
        # looked up once a layer: torch.cuda.current_stream() costs ~30 us of Python a call
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        # `balance` weighs the two branches, also one given nothing (it took no time), where the
        # split decided it: a single miss is filled whatever the split
        weigh = signal and len(fills) + len(plan.cpu) > 1
        t0 = time.perf_counter()  # the device is idle here: its first copy starts at once
        first = self._fill(fills[:1], timed, stream)
        wait_cpu, host_y = self.cpu.start(plan.cpu, groups, hidden, weights, y, k, staged, signal=signal)
        lead = time.perf_counter() - t0
        self._mark("started")
        rest = self._fill(fills[1:], timed, stream)
        if weigh and (first is not None or self.cpu.signalled is not None):
            if first is None:
                first = (_timing_event(stream),) * 2
            self._fill_span = first[0], (rest or first)[1], lead
        self._mark("met")
        return wait_cpu, host_y

    def _mark(self, name: str) -> None:
        if self.clock is not None:
            self.clock.mark(name)

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
        `CPUBranch.start`."""
        kernel = self.kernels.kernel
        misses, split = plan.cpu, kernel.new_split(len(plan.cpu))
        protected = {r for r, _ in plan.hits + plan.fills}
        pending: deque = deque()  # CUDA events of the fills queued and not yet known to have started
        # looked up once: torch.cuda.current_stream() took ~30 us of Python per event recorded
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        taken, wait_cpu, host_y = 0, None, None
        while taken < len(misses):
            if len(pending) > 1:  # the one before the last is done: the last is being copied
                if not kernel.split_left(split):
                    break  # the CPU took the rest: go on to the device's work without waiting
                pending.popleft().synchronize()
            row = misses[taken]
            slot = self.cache.claim(row, protected)
            if slot is None:  # no slot this layer is not using: the CPU takes the rest
                break
            if kernel.take_front(split) is None:
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
                wait_cpu, host_y = self.cpu.start(plan.cpu, groups, hidden, weights, y, k, staged, split)
                self._mark("started")
        if wait_cpu is None:
            wait_cpu, host_y = self.cpu.start(plan.cpu, groups, hidden, weights, y, k, staged, split)
        self._mark("met")
        plan.cpu = misses[taken:]
        if host_y is not None:  # only the rows of the experts the CPU took come back
            done = sum(len(groups[r]) for r in misses[:taken])
            host_y = (host_y[0][done:], host_y[1][done:])
        return wait_cpu, host_y

    def _collect_cpu(self) -> None:
        """End the last layer's signalled CPU call (after the routing read-back the stream has
        waited for it, so it has ended) and give the planner its time and the layer's outcome."""
        span, self._fill_span = self._fill_span, None
        cpu_seconds = 0.0  # a layer that left the CPU nothing: it ended at once, idle while fills ran
        if self.cpu.signalled is not None:
            nbytes, busy = self.cpu.end_signalled()
            if not busy:
                return
            self.planner.observe_cpu(nbytes, busy)
            cpu_seconds = span[2] + busy if span else 0.0
        if span is not None and span[1].query():  # both from the first fill's start
            self.planner.balance(span[0].elapsed_time(span[1]) / 1e3, cpu_seconds)

    def resident_rows(self) -> list[int]:
        """The resident rows, least recently used first (takes the residency back from graph
        decode: a synchronisation)."""
        if self.device_planner is not None:
            self.device_planner.to_host()
        return list(self.cache.lru)

    def resident(self) -> int:
        """Experts resident in the device cache: from the device table while graph decode owns
        the residency (the host cache catches up only when the host planner takes over)."""
        p = self.device_planner
        if p is not None and p.on_device:
            return int((p.owner >= 0).sum())
        return len(self.cache)

    def device_planner_unsupported(self) -> str | None:
        """Why graph decode cannot plan on the device with this store, or None."""
        k = self.spec.top_k
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed"
        if not self.pool.pinned and self.device.type == "cuda":
            return "the host pool is not page-locked"
        if self.strategy != CPU and self.cache.capacity < 2 * k:
            return f"the expert cache holds fewer than {2 * k} slots (2 x top-k)"
        if self.strategy in (CPU, HYBRID) and self.kernels.kernel is None:
            return "the CPU branch needs the compiled CPU kernel"
        return None

    def device_planner_for_graphs(self) -> DevicePlanner:
        if self.device_planner is None:
            from .device_planner import DevicePlanner  # imports Triton

            # its state must stay writable outside inference mode (graph capture restores it),
            # also when an extend under inference mode creates it
            with torch.inference_mode(False):
                self.device_planner = DevicePlanner(self.spec, self.pool, self.cache, self.strategy, self.planner.rate_fraction,
                                              self.kernels.kernel, self.cpu.threads, self.stats, self.kernels.int8)
            self.stats.pull = self.device_planner.flush_stats
        return self.device_planner

    def _drop_device_planner(self) -> None:
        if self.device_planner is not None:
            self.device_planner.to_host()
            self.device_planner.close()
            self.device_planner = None
            self.stats.pull = None

    def rebuild(self, capacity: int) -> None:
        """Resize the device cache to `capacity` slots, 1 to the model's rows (call at a safe
        point: no `run` in flight; the scheduler checks the count); the host pool is
        untouched, so refills come from it. A transaction: if the new cache cannot be allocated
        the old one stays (or, when both did not fit together, an empty one of the old size) and
        the error is raised."""
        if self.strategy in (FUSED, CPU):
            raise ValueError(f"strategy {self.strategy} has no resizable cache")
        self._drop_device_planner()
        self.version += 1
        self.streaming.release(self.cache)
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
        self._drop_device_planner()
        self.cpu.close()


def _timing_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A timing event recorded on `stream` now."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def _groups(order: np.ndarray, counts: list[int], base: int) -> dict[int, np.ndarray]:
    """Expert row -> its flat assignment indices (t * k + j), from the assignments sorted by
    expert and each expert's count (`base`: the layer's first row)."""
    groups, start = {}, 0
    for e, n in enumerate(counts):
        if n:
            groups[base + e] = order[start : start + n]
            start += n
    return groups
