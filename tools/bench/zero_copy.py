"""Device-planned fills, two ways: `python -m ftkit.tools.bench.zero_copy --json OUT`.

Graph decode and device-planned extends fill cache slots without the host: no host thread knows
which experts to copy. For a layer's misses of a qwen3-30b-a3b bf16 expert (9.44 MB), this
times the fills plus the grouped kernel over them:
- decode, 1..8 misses of one token each, the grouped GEMV;
- an extend, 4..16 misses of 4 tokens each (32 tokens in all), the grouped GEMM;
each as `dma` (cudaMemcpyAsync per slot: the copy engines, what a host planner can issue, then
the kernel), `fill-through` (the kernel reads the misses from mapped pinned memory and writes
the slots as it goes: what the device planner runs), and, as the floor, the kernel alone over
resident slots. GB/s = expert bytes / time. Needs CUDA. (A separate zero-copy copy kernel before
the GEMV was measured too and dropped: no faster than DMA, and slower than the fill-through
GEMV for one or two misses.)
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
from ftkit.kernels.triton.experts import gemm_tiles, grouped_expert_gemm, grouped_expert_gemv
from ftkit.vocab import slot_layout

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
    dev = torch.zeros((16, size), dtype=torch.uint8, device="cuda")
    addr = torch.tensor([zero_copy.device_pointer(host[r].data_ptr()) for r in range(args.rows)],
                        dtype=torch.int64, device="cuda")
    cursor = [0]

    def next_rows(n: int) -> int:
        """The first of n host rows not used by the last call (so nothing is read from L2)."""
        cursor[0] = (cursor[0] + n) % (args.rows - n)
        return cursor[0]

    def dma(n: int, kernel) -> None:
        r = next_rows(n)
        for i in range(n):
            dev[i].copy_(host[r + i], non_blocking=True)
        kernel(None)

    def fill_through(n: int, kernel) -> None:
        r = next_rows(n)
        kernel((ones, torch.arange(r, r + 16, device="cuda"), addr))

    def check(n: int, kernel, rows: int, name: str) -> None:
        """The fill-through kernel fills the right bytes and computes (its first `rows` output
        rows) what it computes resident."""
        fill_through(n, kernel)
        torch.cuda.synchronize()
        r = cursor[0]
        assert torch.equal(dev[:n].cpu(), host[r : r + n]), f"the fill-through {name} filled the wrong bytes"
        ref = kernel(None)[:rows].clone()
        again = kernel((ones, torch.arange(r, r + 16, device="cuda"), addr))[:rows]  # another specialization
        assert torch.allclose(again.float(), ref.float(), rtol=1e-2, atol=1e-3), f"fill-through {name} results differ"

    def measure(kind: str, n: int, kernel, rows: int) -> dict:
        check(n, kernel, rows, kind)
        nbytes = n * size
        return {"kernel": kind, "slots": n, "dma_gbps": _gbps(lambda: dma(n, kernel), nbytes),
                "fill_through_gbps": _gbps(lambda: fill_through(n, kernel), nbytes),
                "resident_gbps": _gbps(lambda: kernel(None), nbytes)}

    x1 = torch.randn((1, spec.hidden_size), dtype=torch.bfloat16, device="cuda")
    slots = torch.arange(16, dtype=torch.int32, device="cuda")
    weights = torch.full((16,), 0.125, dtype=torch.bfloat16, device="cuda")
    ones = torch.ones(16, dtype=torch.int32, device="cuda")
    results = []
    for n in (1, 2, 4, 8):  # decode: n items of token 0, each its own expert
        count = torch.tensor([n], dtype=torch.int32, device="cuda")
        tokens = torch.zeros(16, dtype=torch.int32, device="cuda")

        def gemv(fills, count: torch.Tensor = count, tokens: torch.Tensor = tokens) -> torch.Tensor:
            return grouped_expert_gemv(x1, dev, layout, slots, tokens, weights, count, fills)

        results.append(measure("GEMV", n, gemv, n))
    per = 4  # an extend's tokens per missed expert (32 tokens, top-8: a few each)
    x32 = torch.randn((32, spec.hidden_size), dtype=torch.bfloat16, device="cuda")
    for n in (4, 8, 16):
        tiles = torch.tensor(gemm_tiles([(s, per) for s in range(n)]), dtype=torch.int32, device="cuda")
        tok = torch.randint(0, 32, (n * per,), dtype=torch.int32, device="cuda")
        dst = torch.arange(n * per, dtype=torch.int32, device="cuda")
        wts = torch.full((n * per,), 0.125, dtype=torch.float32, device="cuda")
        y = torch.empty((n * per, spec.hidden_size), dtype=torch.bfloat16, device="cuda")
        count = torch.tensor([n], dtype=torch.int32, device="cuda")

        def gemm(fills, tiles=tiles, tok=tok, dst=dst, wts=wts, y=y, count=count, n=n) -> torch.Tensor:
            flags = None if fills is None else (fills[0][:n], fills[1][:n], fills[2])
            grouped_expert_gemm(x32, dev, layout, tiles, tok, dst, wts, y, count=count, fills=flags)
            return y

        results.append(measure("GEMM", n, gemm, n * per))
    table = Table(title="one layer's fills + the grouped kernel (pinned host -> GPU), GB/s of expert bytes")
    for col in ("kernel", "misses", "DMA + kernel", "fill-through", "all resident"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["kernel"], str(r["slots"]),
                      *(f"{r[k]:.1f}" for k in ("dma_gbps", "fill_through_gbps", "resident_gbps")))
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
