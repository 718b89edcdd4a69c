"""ftw-convert: HF safetensors directories and GGUF files to FTW."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from ftkit.runtime.checkpoint.hub import local_path
from ftkit.runtime.checkpoint.quant_presets import PRESETS
from ftkit.runtime.console import PlainUsage, Version, guarded, parse_bytes
from ftkit.vocab import human_bytes

from .pipeline import CAST_DTYPES, Conversion, convert, prepare

console = Console()
app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False, help="Convert a checkpoint (HF directory or GGUF file) to FTW.")


def conversion_table(conv: Conversion, out: Path) -> Table:
    spec, inv = conv.spec, conv.inventory
    t = Table(title=f"ftw-convert -> {out}", show_header=False)
    t.add_row("source", f"{inv.source.kind}: {inv.source.path}")
    t.add_row("family", f"{spec.family} ({spec.architecture})")
    t.add_row("layers", f"{spec.num_layers} ({spec.num_moe_layers} MoE), hidden {spec.hidden_size}")
    t.add_row("experts", f"{spec.num_experts} per layer, top-{spec.top_k}, FFN {spec.moe_intermediate_size}, "
                         f"stored {inv.expert_layout}")
    t.add_row("expert dtype", f"{'/'.join(sorted(inv.expert_dtypes))} -> {conv.layout.describe()}")
    t.add_row("expert slot", f"{human_bytes(conv.layout.slot_bytes)} ({conv.layout.slot_bytes} bytes, 4096-aligned)")
    t.add_row("expert pool", f"{human_bytes(conv.expert_bytes)} in {conv.num_banks} bank file(s), "
                             f"{spec.num_expert_rows} rows")
    t.add_row("dense", f"{len(conv.dense)} tensors, {human_bytes(conv.dense_bytes)}")
    t.add_row("side files", ", ".join(rel for _, rel in conv.side_files) or "none")
    if inv.unexpected:
        t.add_row("skipped", f"{len(inv.unexpected)} tensor(s) the family does not use, e.g. {inv.unexpected[0]}")
    return t


@app.command(cls=PlainUsage)
def main(
    src: str = typer.Argument(..., metavar="SRC", help="HF model directory (safetensors, single or sharded) or a "
                              "GGUF file; or a Hugging Face id (org/name) in the local hub cache (a path that "
                              "exists wins)"),
    out: Path = typer.Option(..., "-o", "--out", help="FTW directory to write"),
    dtype: str | None = typer.Option(None, help=f"cast weights to one of {', '.join(CAST_DTYPES)} (with "
                                     "--quantize: the dense ones)"),
    quantize: str | None = typer.Option(None, help="quantize float experts into GGUF blocks as llama-quantize's "
                                        f"preset or type lays them out (no importance matrix): {', '.join(PRESETS)}"),
    threads: int | None = typer.Option(None, min=1, help="quantizer threads (default: every core)"),
    force: bool = typer.Option(False, help="replace OUT if it exists"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print what would be written, write nothing"),
    bank_size: str = typer.Option("4G", help="largest expert bank file (whole layers per file)"),
    version: Version = False,
) -> None:
    """Convert SRC to an FTW directory OUT (atomically: a temporary sibling renamed at the end)."""

    def run() -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            conv = prepare(local_path(src), dtype, parse_bytes(bank_size, "--bank-size"), quantize,
                           threads or os.cpu_count())
        for w in caught:
            console.print(f"[yellow]note:[/] {w.message}")
        console.print(conversion_table(conv, out))
        inv = conv.inventory
        for note in (*getattr(inv.source, "notes", ()), inv.skipped_note()):
            if note:
                console.print(f"[yellow]note:[/] {note}")
        if note := inv.dense_note(dtype):
            console.print(f"[yellow]note:[/] {note}")
        if quantize:
            console.print(f"[yellow]note:[/] experts quantized by {quantize} as llama-quantize lays it out (no "
                          f"importance matrix); dense tensors kept {dtype or 'as stored'}")
        if dry_run:
            console.print("[yellow]dry run: nothing written[/]")
            return
        if out.exists() and not force:
            raise FileExistsError(f"{out} exists; pass --force to replace it")
        cols = (BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
        with Progress("[progress.description]{task.description}", *cols, console=console) as bar:
            task = bar.add_task("converting", total=conv.source_bytes)
            convert(conv, out, force, on_bytes=lambda n: bar.advance(task, n))
        console.print(f"[green]wrote[/] {out} ({human_bytes(conv.expert_bytes + conv.dense_bytes)})")

    guarded(run)


def cli() -> None:
    app()
