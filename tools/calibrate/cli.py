"""ft-calibrate: measure B_P (pinned host-to-device slot copies) and B_H (the CPU expert kernel),
alone and at once, and write the bandwidth profile the planner starts from (docs/profile.md)."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TimeElapsedColumn
from rich.table import Table

from ftkit import __version__
from ftkit.kernels.cpu import load as load_cpu_kernel
from ftkit.runtime.console import Version, guarded, parse_bytes
from ftkit.runtime.experts.cpu import CPUExecutor
from ftkit.runtime.experts.planner import hybrid_fill_count
from ftkit.runtime.profile import CPUInfo, ExpertInfo, Profile, Row, default_path, gpu_identity
from ftkit.vocab import EXPERT_FORMATS, SlotLayout, human_bytes

from . import measure
from .sysinfo import cpu_model

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32", "f32": "float32"}
app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False, help=__doc__)


def _round(gbps: float | None) -> float | None:
    return None if gbps is None else round(gbps, 2)


def pick_layouts(model: Path | None, slot_bytes: str | None, shape: str | None, dtype: str) -> tuple[SlotLayout, ...]:
    """The expert slots to measure: a model's (each MoE layer's layout, so a llama-quantize mix
    is measured in the proportions of its layers), a shape's, or bf16 experts of H=2048 filling
    a size."""
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in EXPERT_FORMATS:
        raise ValueError(f"--dtype must be one of {', '.join(EXPERT_FORMATS)} (or bf16, fp16, fp32)")
    if sum(v is not None for v in (model, slot_bytes, shape)) > 1:
        raise ValueError("give one of --model, --slot-bytes, --shape")
    if model is not None:
        from ftkit.runtime.ftw.reader import FTWModel

        return FTWModel(model, allow_stub=True).layout.layers
    if slot_bytes is not None:
        hidden = measure.QWEN3_30B_A3B[0]
        inter = parse_bytes(slot_bytes, "--slot-bytes") // (3 * hidden * 2) // 32 * 32
        if inter < 32:
            raise ValueError(f"--slot-bytes {slot_bytes} is smaller than one expert of H={hidden}, I=32")
        return (measure.layout_for(hidden, inter, "bfloat16"),)
    try:
        hidden, inter = measure.QWEN3_30B_A3B if shape is None else (int(v) for v in shape.split(","))
    except ValueError:
        raise ValueError(f"--shape takes H,I (two integers), got {shape!r}") from None
    return (measure.layout_for(hidden, inter, dtype),)


def summary(profile: Profile) -> Table:
    t = Table(title=f"ft-calibrate: {profile.gpu.name if profile.gpu else 'no GPU'}, {profile.cpu.model}, "
                    f"slot {human_bytes(profile.expert.slot_bytes)}")
    t.add_column("threads", justify="right")
    for col in ("B_P", "B_H", "B_P overl.", "B_H overl.", "DRAM read"):
        t.add_column(f"{col} GB/s", justify="right")
    t.add_column("q* for m = 1..8")

    def gbps(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    for row in profile.rows:
        ratio = profile.bandwidths(row.threads).ratio
        qs = " ".join(str(hybrid_fill_count(m, ratio)) for m in range(1, 9)) if ratio else "-"
        t.add_row(str(row.threads), gbps(profile.pcie_gbps), gbps(row.cpu_gbps), gbps(row.pcie_overlapped_gbps),
                  gbps(row.cpu_overlapped_gbps), gbps(row.dram_read_gbps), qs)
    if not profile.gpu:
        t.caption = "no GPU: B_H only; with this profile `auto` runs the experts on the CPU (fused if all fit)"
    return t


@app.command()
def calibrate(
    model: Path | None = typer.Option(None, help="FTW directory: measure its expert slot"),
    slot_bytes: str | None = typer.Option(None, help="slot size to measure (bf16 experts of H=2048), e.g. 9M"),
    shape: str | None = typer.Option(None, help="H,I of one expert (default 2048,768: qwen3-30b-a3b)"),
    dtype: str = typer.Option("bf16", help="expert dtype with --shape: bf16, fp16, fp32, q8_0"),
    threads: str | None = typer.Option(None, help="CPU thread counts, e.g. 4,8,15 (default: the runtime's)"),
    working_set: str = typer.Option("2G", help="host memory cycled through (>> L3)"),
    seconds: float = typer.Option(2.0, help="per measurement"),
    out: Path | None = typer.Option(None, help="profile path (default ~/.cache/ftkit/profiles/<gpu-uuid>.json, "
                                               "where ft-run and ft-bench find it)"),
    as_json: bool = typer.Option(False, "--json", help="print the profile as JSON on stdout"),
    version: Version = False,
) -> None:
    """Measure and write the bandwidth profile."""
    console = Console(stderr=as_json)

    def run() -> None:
        layouts = pick_layouts(model, slot_bytes, shape, dtype)
        layout = layouts[0]
        counts = sorted({int(v) for v in threads.split(",")}) if threads else [CPUExecutor.default_threads()]
        if not counts or min(counts) < 1:
            raise ValueError("--threads takes positive integers, e.g. 4,8,15")
        warnings = [w for w in [measure.load_warning(os.getloadavg()[0], os.cpu_count() or 1)] if w]
        gpu_info, kernel = gpu_identity(), load_cpu_kernel()
        slots = measure.working_set(layouts, parse_bytes(working_set, "--working-set"), pin=gpu_info is not None)
        # with a GPU, B_H is what a GPU run's CPU side does: it computes in bf16, on the int8 path
        cycle = measure.ExpertCycle(layouts, slots, tokens=1, per_call=8, bytes_per_expert=layout.slot_bytes,
                                    int8=gpu_info is not None)
        copier = measure.Copier(slots) if gpu_info else None
        steps = (copier is not None) + len(counts) * (1 + 2 * (kernel is not None) * (copier is not None)
                                                      + (kernel is not None))
        rows, pcie = [], None
        with Progress("[progress.description]{task.description}", BarColumn(), TimeElapsedColumn(),
                      console=console) as bar:
            task = bar.add_task("measuring", total=steps)

            def step(what: str, fn: Callable[..., Any], *args: Any) -> Any:
                bar.update(task, description=what)
                value = fn(*args)
                bar.advance(task, 2 if fn is measure.overlapped_gbps else 1)
                return value

            if copier:
                pcie = step("B_P: pinned host-to-device slot copies", measure.h2d_gbps, copier, seconds)
            for t in counts:
                dram = po = co = None
                windows: list[float] = []
                if kernel:
                    dram = step(f"DRAM read, {t} thread(s)", measure.dram_read_gbps, kernel, slots, t, seconds)
                    cpu = step(f"B_H: CPU experts, {t} thread(s)", measure.cpu_experts_gbps, kernel, cycle, t,
                               seconds, windows)
                else:
                    cpu = step(f"B_H: torch experts, {t} thread(s)", measure.torch_experts_gbps, cycle, t, seconds,
                               windows)
                if w := measure.spread_warning(f"B_H at {t} thread(s)", windows):
                    warnings.append(w)
                if kernel and copier:
                    po, co = step(f"B_P and B_H at once, {t} thread(s)", measure.overlapped_gbps, copier, kernel,
                                  cycle, t, seconds)
                rows.append(Row(t, _round(cpu), _round(po), _round(co), _round(dram)))
        profile = Profile(
            pcie_gbps=_round(pcie), rows=tuple(rows), gpu=gpu_info, host=platform.node(),
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), tool=f"ft-calibrate {__version__}",
            cpu=CPUInfo(cpu_model(), os.cpu_count(), kernel.isa if kernel else "torch"),
            expert=ExpertInfo("/".join(sorted({f for lay in layouts for f in lay.formats})),
                              tuple(layout.parts[0].shape[::-1]), layout.slot_bytes),
            working_set_bytes=slots.nbytes,
        )
        path = out or default_path(gpu_info)
        profile.save(path)
        console.print(summary(profile))
        for w in warnings:
            console.print(f"[bold yellow]warning:[/] {w}", highlight=False)
        console.print(f"[green]wrote[/] {path}")
        if as_json:
            print(json.dumps(profile.to_dict(), indent=1))

    guarded(run)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
