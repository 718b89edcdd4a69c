"""CPU expert throughput: `python -m ftkit.tools.bench.cpu_experts --threads 1,2,4,8,16 --json OUT`.

GB/s (expert bytes read / time) of the ftkit CPU kernel, of the same SwiGLU through torch matmuls,
and of a plain parallel read of the same buffer (the DRAM ceiling), per thread count, on a working
set of bf16 qwen3-30b-a3b experts much larger than the caches, cycled so no expert is reused warm.
`--dtype` takes the GGUF block formats ftkit quantizes too, and `q4_k_m` (llama-quantize's mix
for most layers: gate and up q4_k, down q6_k): the GB/s are then of the quantized bytes, as the
kernel reads them, and GFLOP/s count the SwiGLU's 6 H I flops per token and expert, beside the
cores' peak at that thread count from registers alone (`Kernel.peak_gflops`: float32 FMAs, or
with `--int8` the int8 path's byte products; parts whose format has no int8 kernel still
multiply in float32). `--compare A/experts.cpp B/experts.cpp ...` measures instead the kernel
built from each copy of the source, the builds taking turns for `--rounds` rounds in this one
process: a kernel change's A/B on a machine whose memory speed drifts.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ftkit.kernels.cpu import Kernel, build, load
from ftkit.kernels.quantize import QUANTIZERS
from ftkit.tools.calibrate.measure import (
    QWEN3_30B_A3B,
    Copier,
    ExpertCycle,
    cpu_experts_gbps,
    dram_read_gbps,
    layout_for,
    overlapped_gbps,
    shared_experts_gbps,
    torch_experts_gbps,
    working_set,
)
from ftkit.tools.calibrate.sysinfo import cpu_model
from ftkit.vocab import FLOAT_FORMATS

MIXES = {"q4_k_m": ("q4_k", "q4_k", "q6_k")}  # a mix of formats by part: gate, up, down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--gib", type=float, default=2.0, help="working set in GiB (>> L3)")
    ap.add_argument("--shape", default=",".join(map(str, QWEN3_30B_A3B)), help="H,I of one expert")
    ap.add_argument("--dtype", default="bfloat16", choices=(*FLOAT_FORMATS, *QUANTIZERS, *MIXES))
    ap.add_argument("--tokens", type=int, default=1, help="tokens per expert (decode: 1)")
    ap.add_argument("--experts-per-call", type=int, default=8, help="experts per kernel call (a layer's CPU set)")
    ap.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    ap.add_argument("--no-torch", action="store_true", help="skip the (slow) torch reference")
    ap.add_argument("--shared", action="store_true",
                    help="also the runner's shared-split schedule (hybrid's: one expert at a time)")
    ap.add_argument("--overlap", action="store_true",
                    help="also each kernel figure while pinned host-to-device copies run (needs CUDA)")
    ap.add_argument("--int8", action="store_true",
                    help="the kernel's int8 path (activations quantized, as a run in bf16 computes)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--compare", type=Path, nargs="+", metavar="SOURCE",
                    help="instead: the kernel built from each of these experts.cpp copies (its headers beside "
                         "each), alternated in this process for --rounds rounds: an A/B on one machine")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of --compare")
    args = ap.parse_args()
    console = Console()
    kernel = load()
    if kernel is None:
        raise SystemExit("the CPU kernel cannot be built here (see the warning above)")
    hidden, inter = (int(v) for v in args.shape.split(","))
    layout = layout_for(hidden, inter, MIXES.get(args.dtype, args.dtype))
    slots = working_set((layout,), int(args.gib * 2**30))
    cycle = ExpertCycle((layout,), slots, args.tokens, args.experts_per_call, int8=args.int8)
    if args.compare:
        _compare(console, args.compare, cycle, [int(v) for v in args.threads.split(",")], args.rounds, args.seconds)
        return
    runner = kernel.runner() if args.shared else None
    copier = _copier(args.overlap, args.gib)
    rows = []
    flop_per_byte = 6 * hidden * inter * args.tokens / layout.data_bytes  # GFLOP/s per GB/s
    with console.status("measuring") as status:
        for t in (int(v) for v in args.threads.split(",")):
            status.update(f"{t} thread(s)")
            row = {"threads": t,
                   "dram_read_gbps": dram_read_gbps(kernel, slots, t, args.seconds),
                   "peak_gflops": kernel.peak_gflops(t, args.int8),
                   "ftkit_gbps": cpu_experts_gbps(kernel, cycle, t, args.seconds),
                   "torch_gbps": None if args.no_torch else torch_experts_gbps(cycle, t, args.seconds)}
            if runner is not None:
                row["shared_gbps"] = shared_experts_gbps(kernel, runner, cycle, t, args.seconds)
            if copier is not None:  # each step again, beside the copies (a kernel step prepares its calls)
                steps = {"ftkit": cycle.kernel_step(kernel, t)}
                if runner is not None:
                    steps["shared"] = cycle.shared_step(kernel, runner, t)
                for name, step in steps.items():
                    pcie, cpu = overlapped_gbps(copier, kernel, cycle, t, args.seconds, step)
                    row[f"{name}_overlapped_gbps"], row[f"pcie_with_{name}_gbps"] = cpu, pcie
            rows.append(row)
    if runner is not None:
        runner.close()
    result = {
        "cpu": cpu_model(), "host": platform.node(), "isa": kernel.isa, "dtype": args.dtype, "int8": args.int8,
        "formats": list(layout.formats), "gflop_per_gb": flop_per_byte,
        "shape": [hidden, inter], "expert_bytes": layout.data_bytes, "working_set_bytes": slots.nbytes,
        "tokens": args.tokens, "experts_per_call": cycle.per_call, "rows": rows,
    }
    table = Table(title=f"CPU experts {args.dtype} H={hidden} I={inter}, {args.tokens} token(s), "
                        f"{cycle.per_call} per call, {slots.nbytes / 2**30:.1f} GiB working set, {kernel.isa}"
                        f"{', int8 path' if args.int8 else ''}")
    extra = [c for c in ("shared_gbps", "ftkit_overlapped_gbps", "pcie_with_ftkit_gbps", "shared_overlapped_gbps",
                         "pcie_with_shared_gbps") if c in rows[0]]
    for col in ("threads", "ftkit GB/s", "ftkit GFLOP/s", "peak GFLOP/s", "ftkit / peak", "torch GB/s",
                "DRAM read GB/s", "ftkit / DRAM",
                *(c.removesuffix("_gbps").replace("_", " ") + " GB/s" for c in extra)):
        table.add_column(col, justify="right")
    for r in rows:
        torch_gbps = "-" if r["torch_gbps"] is None else f"{r['torch_gbps']:.1f}"
        gflops, peak = r["ftkit_gbps"] * flop_per_byte, r["peak_gflops"]
        table.add_row(str(r["threads"]), f"{r['ftkit_gbps']:.1f}", f"{gflops:.1f}",
                      "-" if peak is None else f"{peak:.0f}", "-" if peak is None else f"{gflops / peak:.1%}",
                      torch_gbps, f"{r['dram_read_gbps']:.1f}", f"{r['ftkit_gbps'] / r['dram_read_gbps']:.0%}",
                      *(f"{r[c]:.1f}" for c in extra))
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


def _compare(console: Console, sources: list[Path], cycle: ExpertCycle, threads: list[int], rounds: int,
             seconds: float) -> None:
    """GB/s of the kernel built from each source, the builds taking turns round by round, so a
    machine's drift hits them alike."""
    kernels = {s: Kernel(build(source=s)) for s in sources}
    got: dict[tuple[Path, int], list[float]] = {}
    for r in range(rounds):
        for source, kernel in kernels.items():
            for t in threads:
                got.setdefault((source, t), []).append(cpu_experts_gbps(kernel, cycle, t, seconds))
                console.print(f"round {r + 1}: {source} at {t} threads {got[source, t][-1]:.1f} GB/s", soft_wrap=True)
    for (source, t), rates in got.items():
        console.print(f"{source} at {t} threads: {' / '.join(f'{g:.1f}' for g in rates)}, "
                      f"mean {sum(rates) / len(rates):.1f} GB/s", soft_wrap=True)


def _copier(overlap: bool, gib: float) -> Copier | None:
    """Fills' copies to run beside the kernel: pinned host slots of their own (the kernel's
    working set stays pageable, as the host pool's reads are not what is measured here)."""
    if not overlap:
        return None
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--overlap needs CUDA (it measures the kernel while host-to-device copies run)")
    return Copier(working_set((layout_for(*QWEN3_30B_A3B, "bfloat16"),), int(gib * 2**30), pin=True))


if __name__ == "__main__":
    main()
