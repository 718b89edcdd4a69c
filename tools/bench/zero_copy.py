"""Device-planned fills, two ways: `python -m ftkit.tools.bench.zero_copy --json OUT`.

Graph decode and device-planned extends fill cache slots without the host: no host thread knows
which experts to copy. For a layer's misses of a qwen3-30b-a3b expert (bf16: 9.44 MB; `--formats
q4_k_m`: llama-quantize's mix, 3.06 MB), this times the fills plus the grouped kernel over them:
- decode, 1..8 misses of one token each, the grouped GEMV;
- an extend, 4..16 misses of 4 tokens each (32 tokens in all), the grouped GEMM;
each as `dma` (cudaMemcpyAsync per slot: the copy engines, what a host planner can issue, then
the kernel), `fill-through` (the kernel reads the misses from mapped pinned memory and writes
the slots as it goes: what the device planner runs), and, as the floor, the kernel alone over
resident slots. GB/s = expert bytes / time. Needs CUDA. (A separate zero-copy copy kernel before
the GEMV was measured too and dropped: no faster than DMA, and slower than the fill-through
GEMV for one or two misses.) `--copy-blocks` sweeps the elements a fill's copy programs move
a step (each step waits for its PCIe reads), `--block-n` the GEMV's gate/up rows a program (so
a fill's reading programs); `--host-load N` keeps N threads reading host memory meanwhile, as
the CPU side of hybrid decode does. On an H100 host one q4_k_m fill read at ~20 GB/s whatever
the step or the programs (docs/benchmarks-history.md, third session of 2026-12-07).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ftkit.kernels.triton import zero_copy
from ftkit.kernels.triton.experts import (
    FILL_COPY,
    gemm_tiles,
    grouped_expert_gemm,
    grouped_expert_gemv,
)
from ftkit.vocab import slot_layout

from .cpu_experts import MIXES
from .presets import preset_spec

REPLAYS = 16  # calls in a timed graph, each on host rows the one before did not read


def _gbps(calls: list, nbytes: int, seconds: float = 1.0) -> float:
    """GB/s of `calls` (each moving `nbytes`) replayed from one CUDA graph, so the GPU's time is
    measured, not the launches' host time (one call of one or two misses takes less than its
    Python)."""
    for c in calls:  # compiled and warm before the capture
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        g.replay()
        n += len(calls)
        torch.cuda.synchronize()
    return n * nbytes / (time.perf_counter() - t0) / 1e9


class HostLoad:
    """While entered: `threads` torch threads summing a host buffer over and over (DRAM reads,
    as the CPU expert worker makes)."""

    def __init__(self, threads: int, gib: float = 4.0):
        self.threads, self.stopping = threads, threading.Event()
        self.buf = torch.ones(int(gib * (1 << 30)) // 4) if threads else None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        while not self.stopping.is_set():
            self.buf.sum()

    def __enter__(self) -> HostLoad:
        if self.threads:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        if self.threads:
            self.thread.join()


def layer_results(fmt: str, host_rows: int, copy_block: int, block_n: int, seconds: float = 1.0,
                  gemm: bool = True) -> list[dict]:
    """The fills bench's rows for experts in `fmt` (a format, or a mix of MIXES); `gemm`: the
    extend's GEMM rows too."""
    spec = preset_spec("qwen3-30b-a3b", 1)
    layout = slot_layout(spec, MIXES.get(fmt, fmt))
    size = layout.slot_bytes
    host = torch.randint(0, 256, (host_rows, size), dtype=torch.uint8).pin_memory()
    if fmt == "bfloat16":  # finite values, not random bit patterns
        host.view(torch.bfloat16).normal_(0, 0.02)
    dev = torch.zeros((16, size), dtype=torch.uint8, device="cuda")
    addr = torch.tensor([zero_copy.device_pointer(host[r].data_ptr()) for r in range(host_rows)],
                        dtype=torch.int64, device="cuda")
    cursor = [0]

    def next_rows(n: int) -> int:
        """The first of n host rows not used by the last call (so nothing is read from L2)."""
        cursor[0] = (cursor[0] + n) % (host_rows - n)
        return cursor[0]

    def dma(n: int, kernel) -> list:
        """A graph's worth of calls: copy engines, then the kernel over resident slots."""
        def call(r: int) -> None:
            for i in range(n):
                dev[i].copy_(host[r + i], non_blocking=True)
            kernel(None)
        return [lambda r=next_rows(n): call(r) for _ in range(REPLAYS)]

    def fill_through(n: int, kernel) -> list:
        return [lambda r=torch.arange(r0, r0 + 16, device="cuda"): kernel((ones, r, addr))
                for r0 in (next_rows(n) for _ in range(REPLAYS))]

    def check(n: int, kernel, rows: int, name: str) -> None:
        """The fill-through kernel fills the right bytes and computes (its first `rows` output
        rows) what it computes resident."""
        r = next_rows(n)
        kernel((ones, torch.arange(r, r + 16, device="cuda"), addr))
        torch.cuda.synchronize()
        assert torch.equal(dev[:n].cpu(), host[r : r + n]), f"the fill-through {name} filled the wrong bytes"
        ref = kernel(None)[:rows].clone()
        again = kernel((ones, torch.arange(r, r + 16, device="cuda"), addr))[:rows]  # another specialization
        assert torch.allclose(again.float(), ref.float(), rtol=1e-2, atol=1e-3, equal_nan=True), \
            f"fill-through {name} results differ"

    def measure(kind: str, n: int, kernel, rows: int) -> dict:
        check(n, kernel, rows, kind)
        nbytes = n * size
        return {"format": fmt, "copy_block": copy_block, "block_n": block_n, "kernel": kind, "slots": n,
                "dma_gbps": _gbps(dma(n, kernel), nbytes, seconds),
                "fill_through_gbps": _gbps(fill_through(n, kernel), nbytes, seconds),
                "resident_gbps": _gbps([lambda: kernel(None)] * REPLAYS, nbytes, seconds)}

    x1 = torch.randn((1, spec.hidden_size), dtype=torch.bfloat16, device="cuda")
    slots = torch.arange(16, dtype=torch.int32, device="cuda")
    weights = torch.full((16,), 0.125, dtype=torch.bfloat16, device="cuda")
    ones = torch.ones(16, dtype=torch.int32, device="cuda")
    results = []
    for n in (1, 2, 4, 8):  # decode: n items of token 0, each its own expert
        count = torch.tensor([n], dtype=torch.int32, device="cuda")
        tokens = torch.zeros(16, dtype=torch.int32, device="cuda")

        def gemv(fills, count: torch.Tensor = count, tokens: torch.Tensor = tokens) -> torch.Tensor:
            return grouped_expert_gemv(x1, dev, layout, slots, tokens, weights, count, fills, copy_block, block_n)

        results.append(measure("GEMV", n, gemv, n))
    per = 4  # an extend's tokens per missed expert (32 tokens, top-8: a few each)
    x32 = torch.randn((32, spec.hidden_size), dtype=torch.bfloat16, device="cuda")
    for n in (4, 8, 16) if gemm else ():
        tiles = torch.tensor(gemm_tiles([(s, per) for s in range(n)]), dtype=torch.int32, device="cuda")
        tok = torch.randint(0, 32, (n * per,), dtype=torch.int32, device="cuda")
        dst = torch.arange(n * per, dtype=torch.int32, device="cuda")
        wts = torch.full((n * per,), 0.125, dtype=torch.float32, device="cuda")
        y = torch.empty((n * per, spec.hidden_size), dtype=torch.bfloat16, device="cuda")
        count = torch.tensor([n], dtype=torch.int32, device="cuda")

        def gemm(fills, tiles=tiles, tok=tok, dst=dst, wts=wts, y=y, count=count, n=n) -> torch.Tensor:
            flags = None if fills is None else (fills[0][:n], fills[1][:n], fills[2])
            grouped_expert_gemm(x32, dev, layout, tiles, tok, dst, wts, y, count=count, fills=flags,
                                copy_block=copy_block)
            return y

        results.append(measure("GEMM", n, gemm, n * per))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=128, help="host slots to cycle through (>> GPU L2)")
    ap.add_argument("--formats", default="bfloat16", help="expert formats, comma-separated (or q4_k_m)")
    ap.add_argument("--copy-blocks", default=str(FILL_COPY), help="elements a copy step, comma-separated")
    ap.add_argument("--block-n", default="32", help="the GEMV's gate/up rows a program, comma-separated")
    ap.add_argument("--host-load", type=int, default=0, help="threads reading host memory meanwhile")
    ap.add_argument("--seconds", type=float, default=1.0, help="timed seconds a figure")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    results = []
    with HostLoad(args.host_load):
        for fmt in args.formats.split(","):
            for block in (int(b) for b in args.copy_blocks.split(",")):
                for i, block_n in enumerate(int(b) for b in args.block_n.split(",")):
                    results += layer_results(fmt, args.rows, block, block_n, args.seconds, gemm=i == 0)
    table = Table(title="one layer's fills + the grouped kernel (pinned host -> GPU), GB/s of expert bytes"
                  + (f", {args.host_load} threads reading host memory" if args.host_load else ""))
    for col in ("format", "copy step", "rows", "kernel", "misses", "DMA + kernel", "fill-through", "all resident"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["format"], str(r["copy_block"]), str(r["block_n"]), r["kernel"], str(r["slots"]),
                      *(f"{r[k]:.1f}" for k in ("dma_gbps", "fill_through_gbps", "resident_gbps")))
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "host_load": args.host_load,
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
