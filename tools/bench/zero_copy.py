"""Device-driven fills against DMA copies: `python -m ftkit.tools.bench.zero_copy --json OUT`.

Graph decode fills cache slots with a Triton kernel that reads mapped pinned host memory
(zero-copy), because no host thread knows which experts to copy. This measures its GB/s next
to cudaMemcpyAsync of the same slots (the copy engines), for 1..8 slots of a qwen3-30b-a3b
bf16 expert (9.44 MB) per call, as in one layer's fills. Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ftkit.kernels.triton import zero_copy

SLOT = 9_437_184  # bytes of one qwen3-30b-a3b bf16 expert (gate, up, down of 768 x 2048)


def _gbps(fn, nbytes: int, seconds: float = 1.0) -> float:
    fn()
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    torch.cuda.synchronize()
    return n * nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=128, help="host slots to cycle through (>> GPU L2)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    host = torch.empty((args.rows, SLOT), dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty((8, SLOT), dtype=torch.uint8, device="cuda")
    addr = torch.tensor([zero_copy.device_pointer(host[r].data_ptr()) for r in range(args.rows)],
                        dtype=torch.int64, device="cuda")
    rows_cycle = [0]
    results = []
    for n in (1, 2, 4, 8):
        slots = torch.arange(8, dtype=torch.int32, device="cuda")
        flags = (torch.arange(8, device="cuda") < n).to(torch.int32)

        def kernel(flags: torch.Tensor = flags, slots: torch.Tensor = slots) -> None:
            r = rows_cycle[0] = (rows_cycle[0] + 8) % (args.rows - 8)
            rows = torch.arange(r, r + 8, device="cuda")
            zero_copy.fill_slots(addr, rows, flags, slots, dev)

        def dma(n: int = n) -> None:
            r = rows_cycle[0] = (rows_cycle[0] + 8) % (args.rows - 8)
            for i in range(n):
                dev[i].copy_(host[r + i], non_blocking=True)

        kernel()
        torch.cuda.synchronize()
        r = rows_cycle[0]
        assert torch.equal(dev[:n].cpu(), host[r : r + n]), "zero-copy fill copied the wrong bytes"
        results.append({"slots": n, "zero_copy_gbps": _gbps(kernel, n * SLOT), "dma_gbps": _gbps(dma, n * SLOT)})
    table = Table(title="fills: zero-copy kernel vs DMA (pinned host -> GPU)")
    for col in ("slots per call", "zero-copy GB/s", "DMA GB/s"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r["slots"]), f"{r['zero_copy_gbps']:.1f}", f"{r['dma_gbps']:.1f}")
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
