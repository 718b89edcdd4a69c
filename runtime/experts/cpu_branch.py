"""The CPU branch of a layer: the routed experts that run from the host pool, on the CPU.

One kernel call on the runner's native thread (no GIL to start), or one torch job per expert
on the thread pool without the compiled kernel; on a CPU device, a call on the caller's thread.
On a GPU its inputs are staged into page-locked memory to ride on the routing read-back, and
its rows come back in one copy; with the native runner the call may signal its end through a
done word the stream waits on, so the host launches the device's work at once and reads the
branch's time later (`end_signalled`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from ftkit.kernels.triton import optional
from ftkit.vocab import CPU, HYBRID

from ..spec import ModelSpec
from .cpu import CPUExecutor
from .dispatch import ExpertKernels
from .planner import CPU_MAX_TOKENS
from .pool import HostPool


class CPUBranch:
    def __init__(self, spec: ModelSpec, pool: HostPool, strategy: str, device: torch.device,
                 kernels: ExpertKernels, fills_prefill: bool, threads: int | None = None):
        """`fills_prefill`: the store fills every miss of a prefill-sized batch
        (`ExpertStore.fills_prefill`), so the CPU gets none of it."""
        self.spec, self.pool, self.strategy, self.kernels = spec, pool, strategy, kernels
        self.fills_prefill = fills_prefill
        self.executor = CPUExecutor(threads)
        self.kernel = kernels.kernel
        # the branch's own thread, beside a GPU only: a CPU device has nothing to overlap (`start`)
        self.runner = self.kernel.runner() if self.kernel is not None and device.type != "cpu" else None
        self.zero_copy = optional("zero_copy") if self.runner is not None else None
        self._done: tuple[torch.Tensor, object] | None = None  # the done word, and its mapped view
        self._done_value = 0
        self.signalled: int | None = None  # a signalled call not yet ended: the bytes it runs

    @property
    def threads(self) -> int:
        return self.executor.threads

    def stage(self, hidden: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """On a GPU, queue the CPU branch's inputs (float32 activations and router weights) into
        page-locked host memory ahead of the routing read-back, so that one synchronisation per
        layer serves both. Only where the CPU may get work: batches small enough that not every
        miss is filled (`CPU_MAX_TOKENS`, where `fills_prefill`), else every cpu-strategy batch."""
        if hidden.device.type == "cpu" or self.strategy not in (CPU, HYBRID):
            return None
        if self.fills_prefill and weights.numel() > CPU_MAX_TOKENS * self.spec.num_experts:
            return None
        n = hidden.numel()  # one page-locked block for both (an allocation costs ~40 us of Python)
        both = torch.empty(n + weights.numel(), dtype=torch.float32, pin_memory=True)
        x, w = both[:n].view(hidden.shape), both[n:].view(-1, 1)
        x.copy_(hidden.float(), non_blocking=True)
        w.copy_(weights.reshape(-1, 1), non_blocking=True)
        return x, w

    def shares(self) -> bool:
        """Whether a hybrid layer's misses go to a split shared while both branches run: where
        the CPU set runs on the runner's native thread, beside a GPU. A CPU device has no runner:
        shared, its host slots' branch and the runner's team took the same cores (the demo's
        hybrid decode: 25-29 tok/s so, 416-419 with the split up front and the branches in turn)."""
        return self.strategy == HYBRID and self.runner is not None

    def start(self, experts: list[int], groups: dict[int, np.ndarray], hidden: torch.Tensor,
              weights: torch.Tensor, y: torch.Tensor, k: int,
              staged: tuple[torch.Tensor, torch.Tensor] | None, split: np.ndarray | None = None,
              signal: bool = False,
              ) -> tuple[Callable[[], float | None], tuple[torch.Tensor, torch.Tensor] | None]:
        """Start the CPU set `experts` (rows) from the host pool: one kernel call on the runner's native thread,
        or one torch job per expert on the thread pool without the kernel; on a CPU device
        (nothing to overlap) the set runs at once on the calling thread. Returns
        a wait that gives the branch's own compute time (the planner weighs it by that, as it weighs fills
        by their copy time, not by the hand-over before them) and, on a GPU, the page-locked
        buffer it fills (the set's rows in `experts` order) with their rows of `y` (None: it
        writes `y`, in host memory). `split`: the set is shared with the store's fills
        (ExpertStore._share). `signal` (a GPU, the native runner): the call writes the done word
        the stream waits on before the merge; the wait returned is a no-op and `end_signalled`
        gives its time later."""
        if not experts:
            return lambda: None, None
        idxs = [groups[r] for r in experts]
        slots = [self.pool.slot(r) for r in experts]
        layout = self.pool.layout.for_row(experts[0])  # one layer's experts
        if hidden.device.type == "cpu":
            x, w, out, rows = hidden, weights, y, idxs
        else:
            # `staged` came with the routing; large batches (prefill on the cpu strategy) copy now
            x, w = staged if staged is not None else (hidden.float().cpu(), weights.float().cpu())
            ends = np.cumsum([len(i) for i in idxs])
            out = torch.empty((int(ends[-1]), y.shape[-1]), dtype=torch.float32, pin_memory=True)
            rows = None  # the compact rows of `out`, in order
        host = None if out is y else (out, torch.from_numpy(np.concatenate(idxs)))
        if hidden.device.type == "cpu":
            # no device branch to overlap: the set runs here, in the caller's OpenMP team. On
            # another thread, with a team of its own on the same cores, torch's ops between the
            # layers' calls took 2-3x as long (3-layer Q4_K_M at bf16 on the dev box's 2 cores,
            # alternated: 68.3 / 69.2 -> 80.9 / 81.6 tok/s)
            start = time.perf_counter()
            self.kernels.host(layout, slots, idxs, x, w, out, k, rows)
            busy = time.perf_counter() - start
            return lambda: busy, host
        if self.runner is not None and x.dtype == out.dtype == torch.float32:
            signal = signal and host is not None
            out_rows = np.arange(out.shape[0]) if rows is None else np.concatenate(rows)
            self.kernel.start_experts(self.runner, layout, slots, idxs, x.contiguous(), w, out, k,
                                      self.executor.threads, out_rows, split, self._done_word() if signal else None,
                                      self.kernels.int8)
            if signal:
                self.signalled = len(slots) * self.pool.layout.slot_bytes
                return lambda: None, host
            return self.runner.wait, host
        if rows is None:  # the torch path hands each expert its own rows
            rows = np.split(np.arange(out.shape[0]), ends[:-1])
        spans: list[tuple[float, float]] = []

        def job(part: slice):
            def run() -> None:
                start = time.perf_counter()
                with torch.inference_mode():  # thread-local: the caller's mode does not carry over
                    self.kernels.host(layout, slots[part], idxs[part], x, w, out, k, rows[part])
                spans.append((start, time.perf_counter()))
            return run

        parts = [slice(None)] if self.kernel else [slice(i, i + 1) for i in range(len(idxs))]
        futures = self.executor.start([job(p) for p in parts])

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

    def end_signalled(self) -> tuple[int, float | None]:
        """End the last signalled call (the stream has waited for its done word, so it has
        ended): the bytes it ran and its busy time."""
        nbytes, self.signalled = self.signalled, None
        return nbytes, self.runner.wait()

    def merge(self, y: torch.Tensor, host: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The branch's rows (`start`'s page-locked buffer, with their rows of y), disjoint from
        the device's, copied into y in place; after a signalled call the stream first waits for
        its done word."""
        rows_y, idx = host
        if self.signalled is not None:
            self.zero_copy.wait_word(self._done[1], self._done_value)
        y.index_copy_(0, idx.to(y.device, non_blocking=True), rows_y.to(y.device, non_blocking=True).to(y.dtype))

    def close(self) -> None:
        self.executor.close()
        if self.runner is not None:
            self.runner.close()
