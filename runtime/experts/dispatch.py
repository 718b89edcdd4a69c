"""Which kernel computes a set of experts, given where their weights are: the one owner of that choice.

A layer's experts resident in the device tier go through the grouped Triton GEMV (decode-sized
work) or GEMM (prefill-sized), through torch one expert at a time without Triton, or, when the
device tier is host memory, through the CPU kernel like the CPU branch's. Every path takes each
layer's own slot layout, GGUF blocks included (the Triton kernels decode them in registers).
Each (token, k) assignment's weighted output lands in its own row of `y`.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from ftkit.kernels.triton import optional
from ftkit.vocab import ExpertLayout, SlotLayout

from .cache import SlotCache
from .pool import expert_forward, expert_weights

GEMV_MAX_ITEMS = 64  # routed (token, expert) items up to which decode uses the grouped GEMV


class ExpertKernels:
    def __init__(self, layout: ExpertLayout, device: torch.device, cpu_kernel, threads: int, grouped,
                 int8: bool = False):
        """`cpu_kernel`: the compiled CPU kernel (ftkit.kernels.cpu) or None; `grouped`: the
        grouped Triton kernels' module, where the device is a GPU, or None; `int8`: every call
        of the CPU kernel takes its int8 path (`int8_activations` of the run's dtype)."""
        self.layouts, self.device, self.kernel, self.threads, self.grouped = layout, device, cpu_kernel, threads, grouped
        self.int8 = int8
        self.zero_copy = optional("zero_copy") if grouped is not None else None
        self._pulls: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()  # page-locked lists not yet read

    def resident(self, cache: SlotCache, resident: list[tuple[int, int]], groups: dict[int, np.ndarray],
                 x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, k: int) -> None:
        """The (row, slot) experts of `cache` on their assignments `groups[row]` (flat t * k + j
        indices) of x [T, H], weighted by w [T * k, 1], into y [T * k, H]. The GEMV or the
        GEMM by the layer's routed items (T * k, wherever they run): decode-sized or not."""
        if not resident:
            return
        if self.device.type == "cpu":
            self.host(self.layouts.for_row(resident[0][0]), [cache.slots[s] for _, s in resident],
                      [groups[r] for r, _ in resident], x, w, y, k)
        elif self.grouped is not None and x.shape[0] * k <= GEMV_MAX_ITEMS:
            self._device_gemv(cache, resident, groups, x, w, y, k)
        elif self.grouped is not None:
            self._device_gemm(cache, resident, groups, x, w, y, k)
        else:
            self._device_segments(cache, resident, groups, x, w, y, k)

    def _device_gemv(self, cache: SlotCache, resident: list[tuple[int, int]], groups: dict[int, np.ndarray],
                     x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, k: int) -> None:
        """Every (token, expert) item of the resident experts in two grouped launches, the work
        list (slot, token, assignment per item, then the count) uploaded in one copy."""
        idx = np.concatenate([groups[r] for r, _ in resident])
        n = len(idx)
        slots = np.repeat([s for _, s in resident], [len(groups[r]) for r, _ in resident])
        meta = _upload(np.concatenate([slots, idx // k, idx, [n]]), x.device)
        idx_d = meta[2 * n : 3 * n]
        layout = self.layouts.for_row(resident[0][0])  # one layer's experts
        out = self.grouped.grouped_expert_gemv(x, cache.slots, layout, meta[:n], meta[n : 2 * n],
                                               w[idx_d, 0].contiguous(), meta[3 * n :])
        y[idx_d] = out

    def _device_gemm(self, cache: SlotCache, resident: list[tuple[int, int]], groups: dict[int, np.ndarray],
                     x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, k: int) -> None:
        """Prefill-sized work: every resident expert of the layer in two grouped launches, its
        assignments sorted by expert and uploaded once with the tile list."""
        idx = np.concatenate([groups[r] for r, _ in resident])
        tiles = self.grouped.gemm_tiles([(s, len(groups[r])) for r, s in resident])
        meta = self._pull(np.concatenate([idx // k, idx, tiles]), x.device)
        n = len(idx)
        tokens, dst = meta[:n], meta[n : 2 * n]
        layout = self.layouts.for_row(resident[0][0])
        self.grouped.grouped_expert_gemm(x, cache.slots, layout, meta[2 * n :], tokens, dst, w[dst, 0].contiguous(), y)

    def _device_segments(self, cache: SlotCache, resident: list[tuple[int, int]], groups: dict[int, np.ndarray],
                         x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, k: int) -> None:
        """Without the grouped kernels (no Triton): the assignments sorted by expert, uploaded
        once, each expert one segment of a gathered batch."""
        idx = np.concatenate([groups[r] for r, _ in resident])
        ends = np.cumsum([len(groups[r]) for r, _ in resident]).tolist()
        idx_d = _upload(idx, x.device).long()
        xs = x[idx_d // k]
        out = torch.empty_like(xs)
        start, layout = 0, self.layouts.for_row(resident[0][0])
        for (_, slot), end in zip(resident, ends, strict=True):
            weights = expert_weights(layout, cache.slots[slot], x.dtype)
            out[start:end] = expert_forward(xs[start:end], weights, layout.activation)
            start = end
        y[idx_d] = out * w[idx_d]

    def host(self, layout: SlotLayout, slots: list[torch.Tensor], idxs: list[np.ndarray], x: torch.Tensor,
             w: torch.Tensor, y: torch.Tensor, k: int, rows: list[np.ndarray] | None = None) -> None:
        """Experts of one layer (`layout`, theirs) whose slots are in host memory, in one kernel
        call (float32 in and out). `rows`: per expert, the rows of `y` its assignments go to
        (default: the assignments)."""
        if not slots:
            return
        rows = idxs if rows is None else rows
        if self.kernel is None:
            for slot, idx, row in zip(slots, idxs, rows, strict=True):
                idx, row = torch.from_numpy(idx), torch.from_numpy(row)
                weights = expert_weights(layout, slot, x.dtype)
                y[row] = (expert_forward(x[idx // k], weights, layout.activation) * w[idx]).to(y.dtype)
            return
        row = np.concatenate(rows)
        if x.dtype == torch.float32 and y.dtype == torch.float32:
            self.kernel.experts(layout, slots, idxs, x.contiguous(), w, y, k, self.threads, row, self.int8)
            return
        # the kernel's float32 rows compact, then one scatter: a zeroed `y`-sized buffer and a
        # gather from it cost a 512-token CPU prompt ~22% of its time, mostly fresh pages'
        # faults (3-layer Q4_K_M at bf16, dev box: 395 -> 466-488 tok/s)
        out = torch.empty((len(row), y.shape[-1]), dtype=torch.float32)
        self.kernel.experts(layout, slots, idxs, x.float(), w, out, k, self.threads, np.arange(len(row)), self.int8)
        y[torch.from_numpy(row)] = out.to(y.dtype)

    def _pull(self, values: np.ndarray, device: torch.device) -> torch.Tensor:
        """`_upload` for prefill-sized work lists: read from page-locked memory by the SMs
        (`zero_copy.pull`), not by a copy engine, which layer streaming keeps busy with the next
        layer's experts. The page-locked list is kept until the stream has read it."""
        if self.zero_copy is None or device.type != "cuda":
            return _upload(values, device)
        while self._pulls and self._pulls[0][1].query():
            self._pulls.popleft()
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32)).pin_memory()
        out = torch.empty(host.shape, dtype=torch.int32, device=device)
        self.zero_copy.pull(host, out)
        read = torch.cuda.Event()
        read.record()
        self._pulls.append((host, read))
        return out


def _upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small int32 work list on `device` (one copy from page-locked memory on a GPU)."""
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32))
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
