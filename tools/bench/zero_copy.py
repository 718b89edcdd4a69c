"""Decode fills, two ways: `python -m ftkit.tools.bench.zero_copy --json OUT`.

Graph decode fills cache slots without the host: no host thread knows which experts to copy.
For 1..8 misses of a qwen3-30b-a3b bf16 expert (9.44 MB) in one layer, this times the fills
plus the grouped GEMV over them:
- `dma`: cudaMemcpyAsync per slot (the copy engines; what a host planner can issue), then GEMV;
- `fill-through GEMV`: the GEMV reads the misses from mapped pinned memory and writes the
  slots as it goes (what graph decode runs);
and, as the floor, the GEMV alone over resident slots. GB/s = expert bytes / time. Needs CUDA.
(A separate zero-copy copy kernel before the GEMV was measured too and dropped: no faster than
DMA, and slower than the fill-through GEMV for one or two misses.)
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
from ftkit.kernels.triton.experts import grouped_expert_gemv
from ftkit.runtime.ftw.manifest import slot_layout

from .presets import preset_spec


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
    spec = preset_spec("qwen3-30b-a3b", 1)
    layout = slot_layout(spec, "bfloat16")
    size = layout.slot_bytes
    host = torch.empty((args.rows, size), dtype=torch.uint8, pin_memory=True)
    host.view(torch.bfloat16).normal_(0, 0.02)
    dev = torch.zeros((8, size), dtype=torch.uint8, device="cuda")
    addr = torch.tensor([zero_copy.device_pointer(host[r].data_ptr()) for r in range(args.rows)],
                        dtype=torch.int64, device="cuda")
    x = torch.randn((1, spec.hidden_size), dtype=torch.bfloat16, device="cuda")
    slots = torch.arange(8, dtype=torch.int32, device="cuda")
    tokens = torch.zeros(8, dtype=torch.int32, device="cuda")
    weights = torch.full((8,), 0.125, dtype=torch.bfloat16, device="cuda")
    ones = torch.ones(8, dtype=torch.int32, device="cuda")
    cursor = [0]

    def next_rows() -> torch.Tensor:
        r = cursor[0] = (cursor[0] + 8) % (args.rows - 8)
        return torch.arange(r, r + 8, device="cuda")

    results = []
    for n in (1, 2, 4, 8):
        count = torch.tensor([n], dtype=torch.int32, device="cuda")

        def gemv(fills=None, count: torch.Tensor = count) -> torch.Tensor:
            return grouped_expert_gemv(x, dev, layout, slots, tokens, weights, count, fills)

        def dma(n: int = n) -> None:
            r = cursor[0] = (cursor[0] + 8) % (args.rows - 8)
            for i in range(n):
                dev[i].copy_(host[r + i], non_blocking=True)
            gemv()

        def fused() -> None:
            gemv((ones, next_rows(), addr))

        fused()
        torch.cuda.synchronize()
        r = cursor[0]
        assert torch.equal(dev[:n].cpu(), host[r : r + n]), "the fill-through GEMV filled the wrong bytes"
        ref = gemv()
        again = gemv((ones, torch.arange(r, r + 8, device="cuda"), addr))  # another specialization: rounding differs
        assert torch.allclose(again[:n].float(), ref[:n].float(), rtol=1e-2, atol=1e-3), "fill-through GEMV results differ"
        nbytes = n * size
        results.append({"slots": n, "dma_gbps": _gbps(dma, nbytes), "fill_through_gbps": _gbps(fused, nbytes), "resident_gbps": _gbps(gemv, nbytes)})
    table = Table(title="one layer's fills + grouped GEMV (pinned host -> GPU), GB/s of expert bytes")
    for col in ("misses", "DMA + GEMV", "fill-through GEMV", "GEMV, all resident"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r["slots"]), *(f"{r[k]:.1f}" for k in ("dma_gbps", "fill_through_gbps", "resident_gbps")))
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
