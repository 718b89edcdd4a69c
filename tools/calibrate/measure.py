"""The measurements behind ft-calibrate and the CPU expert benchmark.

Every figure is bytes moved / wall time over a working set much larger than the last-level cache,
cycled so that no byte is read twice from cache: what decode sees, where each expert is read once
per token.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ftkit.kernels.cpu import Kernel, Runner
from ftkit.kernels.quantize import QUANTIZERS, quantize
from ftkit.runtime.experts.pool import expert_forward, expert_weights
from ftkit.runtime.random_model import demo_spec
from ftkit.vocab import BLOCK_FORMATS, FLOAT_FORMATS, SlotLayout, slot_layout

if TYPE_CHECKING:
    from ftkit.runtime.ftw.manifest import Part

QWEN3_30B_A3B = (2048, 768)  # (H, I) of qwen3-30b-a3b: 9 MiB per bf16 expert


def layout_for(hidden: int, inter: int, dtype: str) -> SlotLayout:
    """The FTW slot layout of one expert of this shape and dtype."""
    return slot_layout(dataclasses.replace(demo_spec(64), hidden_size=hidden, moe_intermediate_size=inter), dtype)


def _part_bytes(p: Part, gen: torch.Generator) -> torch.Tensor:
    w = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5  # normal numbers (no denormal stalls); biases are 1-D
    if p.dtype in BLOCK_FORMATS:
        if p.dtype not in QUANTIZERS:
            raise ValueError(f"no quantizer writes {p.dtype} experts here; measure a model stored in it (--model)")
        return quantize(w, p.dtype).reshape(-1)
    return w.to(getattr(torch, p.dtype)).reshape(-1).view(torch.uint8)


def working_set(layouts: tuple[SlotLayout, ...], total_bytes: int, pin: bool = False) -> torch.Tensor:
    """[n, slot_bytes] uint8 expert slots filling `total_bytes`, slot i in layouts[i % L] (the
    layers of a model whose layers differ in format, all of one slot size): one random expert per
    layout, copied (the values do not matter for bandwidth, the distinct addresses do)."""
    size = layouts[0].slot_bytes
    n = max(2 * len(layouts), total_bytes // size // len(layouts) * len(layouts))
    slots = torch.empty((n, size), dtype=torch.uint8, pin_memory=pin)
    gen = torch.Generator().manual_seed(0)
    for i, layout in enumerate(layouts):
        one = torch.zeros(size, dtype=torch.uint8)
        for p in layout.parts:
            one[p.offset : p.offset + p.nbytes] = _part_bytes(p, gen)
        slots[i :: len(layouts)] = one
    return slots


PREPARED = 4096  # calls a kernel step prepares ahead (one pass over the working set, if no more)
WINDOWS = 5  # a measurement's rate is also taken over this many equal windows: its spread
SPREAD_WARN = 1.5  # fastest / slowest window above this: something else used the CPU meanwhile


def _rate(step: Callable[[], int], seconds: float, stop: threading.Event | None = None,
          windows: list[float] | None = None) -> float:
    """GB/s of `step` (returns bytes moved) repeated for about `seconds` after one warm-up call;
    each window's GB/s is appended to `windows` when given."""
    step()
    done, t0 = 0, time.perf_counter()
    mark, mark_done, width = t0, 0, seconds / WINDOWS
    while (now := time.perf_counter()) - t0 < seconds and not (stop and stop.is_set()):
        done += step()
        if windows is not None and (now := time.perf_counter()) - mark >= width:
            windows.append((done - mark_done) / (now - mark) / 1e9)
            mark, mark_done = now, done
    return done / (time.perf_counter() - t0) / 1e9


def spread(windows: list[float]) -> float | None:
    """Fastest over slowest window of one measurement (None with fewer than two)."""
    return max(windows) / min(windows) if len(windows) > 1 and min(windows) > 0 else None


def spread_warning(what: str, windows: list[float]) -> str | None:
    """A line when a measurement's windows differ by more than SPREAD_WARN: its figure is not
    the machine's (other work shared the CPU, or the clock changed)."""
    s = spread(windows)
    if s is None or s <= SPREAD_WARN:
        return None
    return (f"{what} varied {s:.1f}x within its measurement ({min(windows):.1f} to {max(windows):.1f} GB/s "
            f"over {len(windows)} windows): something else used the CPU; measure again on an idle machine")


def load_warning(load: float, cores: int) -> str | None:
    """A line when the machine is busy before measuring: B_H would read low (the kernel's threads
    share the cores)."""
    if load <= cores / 2:
        return None
    return (f"the 1-minute load average is {load:.1f} on {cores} cores: other work shares the CPU, so B_H "
            f"will read low; measure on an idle machine")


class ExpertCycle:
    """Calls of `per_call` experts x `tokens` tokens over the working set, round robin; call c
    takes experts of layouts[c % L] (a layer's experts share a layout), as `working_set` lays
    them out."""

    def __init__(self, layouts: tuple[SlotLayout, ...], slots: torch.Tensor, tokens: int, per_call: int,
                 bytes_per_expert: int | None = None, int8: bool = False):
        """`bytes_per_expert`: what one expert counts for (default: the bytes the kernel reads;
        ft-calibrate counts whole slots, the unit fills move); `int8`: the kernel's int8 path
        (what a run in bf16 takes)."""
        self.layouts, self.slots, self.tokens, self.int8 = layouts, slots, tokens, int8
        self.per_call = min(per_call, len(slots) // len(layouts))
        self.at = 0  # the layout of the call `take` gave last
        hidden = layouts[0].parts[0].shape[1]
        self.x = torch.randn(tokens, hidden)
        self.w = torch.rand(tokens * self.per_call)
        self.out = torch.empty(tokens * self.per_call, hidden)
        # Expert e of a call takes token t as assignment t * per_call + e (k = per_call).
        self.groups = [torch.arange(e, tokens * self.per_call, self.per_call) for e in range(self.per_call)]
        self.calls, self.next = 0, 0  # calls made; the next row of the current layout
        self.bytes_per_call = [(bytes_per_expert or lay.data_bytes) * self.per_call for lay in layouts]

    @property
    def layout(self) -> SlotLayout:
        return self.layouts[self.at]

    def take(self) -> list[torch.Tensor]:
        """The next call's experts (its layout: `self.layout`)."""
        n = len(self.layouts)
        self.at = i = self.calls % n
        per = len(self.slots) // n  # rows of each layout
        rows = [((self.next + e) % per) * n + i for e in range(self.per_call)]
        self.calls += 1
        if i == n - 1:
            self.next = (self.next + self.per_call) % per
        return [self.slots[r] for r in rows]

    def kernel_step(self, kernel: Kernel, threads: int) -> Callable[[], int]:
        """The calls of one pass over the working set, prepared up front (at most PREPARED), so
        a step times the C kernel alone, as the graph-decode worker calls it: preparing a call
        of 8 experts in Python took ~70 us on the dev box (the kernel's time for 8 q4km experts
        at 15 threads on the GPU machine's hosts: ~270 us)."""
        n, per = len(self.layouts), len(self.slots) // len(self.layouts)
        count = min(PREPARED, n * per // math.gcd(per, self.per_call))
        calls = []
        for _ in range(count):
            slots = self.take()
            calls.append((kernel.prepare(self.layout, slots, self.groups, self.x, self.w, self.out, self.per_call,
                                         threads, int8=self.int8), self.bytes_per_call[self.at]))
        at = itertools.cycle(calls)

        def step() -> int:
            call, moved = next(at)
            kernel.run(call)
            return moved
        return step

    def shared_step(self, kernel: Kernel, runner: Runner, threads: int) -> Callable[[], int]:
        """The same call on the runner through a shared split the caller leaves whole: the
        kernel's one-expert-at-a-time schedule that hybrid's shared split runs."""
        def step() -> int:
            slots = self.take()
            kernel.start_experts(runner, self.layout, slots, self.groups, self.x, self.w, self.out,
                                 self.per_call, threads, split=kernel.new_split(self.per_call), int8=self.int8)
            runner.wait()
            return self.bytes_per_call[self.at]
        return step

    def torch_step(self) -> Callable[[], int]:
        """The same experts through torch matmuls in the stored dtype (what the runtime did)."""
        dtype = getattr(torch, self.layout.dtype) if self.layout.dtype in FLOAT_FORMATS else torch.float32
        x = self.x.to(dtype)

        def step() -> int:
            slots = self.take()
            for e, slot in enumerate(slots):
                weights = expert_weights(self.layout, slot, dtype)
                self.out[self.groups[e]] = (expert_forward(x, weights, self.layout.activation) * self.w[self.groups[e], None]).float()
            return self.bytes_per_call[self.at]
        return step


def cpu_experts_gbps(kernel: Kernel, cycle: ExpertCycle, threads: int, seconds: float,
                     windows: list[float] | None = None) -> float:
    return _rate(cycle.kernel_step(kernel, threads), seconds, windows=windows)


def shared_experts_gbps(kernel: Kernel, runner: Runner, cycle: ExpertCycle, threads: int, seconds: float) -> float:
    return _rate(cycle.shared_step(kernel, runner, threads), seconds)


def torch_experts_gbps(cycle: ExpertCycle, threads: int, seconds: float, windows: list[float] | None = None) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _rate(cycle.torch_step(), seconds, windows=windows)
    finally:
        torch.set_num_threads(before)


def dram_read_gbps(kernel: Kernel, buf: torch.Tensor, threads: int, seconds: float) -> float:
    flat = buf.view(-1)
    return _rate(lambda: (kernel.read(flat, threads), flat.nbytes)[1], seconds)


class Copier:
    """Pinned host slots to a ring of device slots on a side stream: what a fill does."""

    def __init__(self, slots: torch.Tensor, ring: int = 64, batch: int = 16):
        self.slots, self.batch = slots, batch
        self.dev = torch.empty((min(ring, len(slots)), slots.shape[1]), dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.next = 0

    def step(self) -> int:
        with torch.cuda.stream(self.stream):
            for _ in range(self.batch):
                self.dev[self.next % len(self.dev)].copy_(self.slots[self.next % len(self.slots)], non_blocking=True)
                self.next += 1
        self.stream.synchronize()
        return self.batch * self.slots.shape[1]


def h2d_gbps(copier: Copier, seconds: float) -> float:
    return _rate(copier.step, seconds)


def overlapped_gbps(copier: Copier, kernel: Kernel, cycle: ExpertCycle, threads: int,
                    seconds: float, step: Callable[[], int] | None = None) -> tuple[float, float]:
    """(B_P, B_H) measured while both run at once, as in a hybrid decode step. `step`: the CPU
    side (default: the cycle's plain kernel call)."""
    result: dict[str, float] = {}
    stop, go = threading.Event(), threading.Barrier(2)

    def copies() -> None:
        go.wait()
        result["pcie"] = _rate(copier.step, seconds * 2, stop)  # stopped when the CPU side ends

    side = threading.Thread(target=copies)
    side.start()
    go.wait()
    result["cpu"] = _rate(step or cycle.kernel_step(kernel, threads), seconds)
    stop.set()
    side.join()
    return result["pcie"], result["cpu"]
