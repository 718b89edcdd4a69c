"""A CPU decode step's attention: `python -m ftkit.tools.bench.cpu_attention --threads 16`.

One query of `--heads` heads of `--head-dim` over `--kv-heads` key/value heads, behind each of
`--keys` cached positions, as the decoder runs it on a CPU: the CPU kernel's (kernels/cpu/
decode_attention.h, reading the cache's rows as stored) beside torch's products
(`layers.decode_attention`, float32 copies of K and V), the two taking turns for `--rounds` rounds.
Reported: microseconds a call (best round), and the kernel's GB/s of K and V read, beside a plain
parallel read of a buffer larger than the caches (the DRAM ceiling). Long caches are read from
DRAM; short ones come from the caches after the first round.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from ftkit.kernels.cpu import Kernel, load
from ftkit.runtime.models.layers import decode_attention
from ftkit.tools.calibrate.measure import dram_read_gbps


def _best_us(fn, seconds: float, rounds: int) -> float:
    fn()
    n = 1
    while True:  # calls a round: about `seconds`
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t0 >= seconds / 4 or n >= 1 << 16:
            break
        n *= 2
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def _row(kernel: Kernel, dtype: torch.dtype, keys: int, args: argparse.Namespace) -> list[str]:
    gen = torch.Generator().manual_seed(keys)
    q = torch.randn(1, args.heads, args.head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(keys, args.kv_heads, args.head_dim, generator=gen).to(dtype) for _ in range(2))
    ours = _best_us(lambda: kernel.attention(q, k, v, 0, args.threads), args.seconds, args.rounds)
    theirs = _best_us(lambda: decode_attention(q, k, v, None), args.seconds, args.rounds)
    gbps = (k.nbytes + v.nbytes) / ours / 1e3
    return [str(dtype).removeprefix("torch."), str(keys), f"{ours:.1f}", f"{theirs:.1f}", f"{theirs / ours:.2f}x",
            f"{gbps:.1f}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--keys", default="64,1024,8192,32768", help="cached positions, comma-separated")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="the cache's dtypes, comma-separated")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=0.3, help="about this long a round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    console = Console()
    kernel = load()
    if kernel is None:
        raise SystemExit("the CPU kernel cannot be built here (no C++ compiler)")
    torch.set_num_threads(args.threads)  # torch's products run on as many threads as the kernel
    table = Table(title=f"decode attention, {args.heads} heads of {args.head_dim} over {args.kv_heads} KV heads, "
                        f"{args.threads} threads ({kernel.isa})")
    for col in ("cache", "keys", "kernel us", "torch us", "speed-up", "kernel GB/s"):
        table.add_column(col, justify="right")
    for name in args.dtypes.split(","):
        for keys in (int(x) for x in args.keys.split(",")):
            table.add_row(*_row(kernel, getattr(torch, name), keys, args))
    console.print(table)
    buf = torch.ones(1 << 30, dtype=torch.uint8)
    read = dram_read_gbps(kernel, buf, args.threads, args.seconds)
    console.print(f"plain parallel read of 1 GiB at {args.threads} threads: {read:.1f} GB/s")


if __name__ == "__main__":
    main()
