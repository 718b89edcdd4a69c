"""ft-diagnose: a loadability verdict from headers alone (exit 0 PASS, 1 FAIL, 2 usage error)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from ftkit.runtime.console import guarded
from ftkit.vocab import human_bytes

from .report import diagnose

SHOWN = 20  # problems and unexpected tensors listed in the readable report; --json lists all
console = Console()
app = typer.Typer(add_completion=False, help="Will this checkpoint load? Checked from headers, no weight bytes.")


def _bytes(n: int) -> str:
    return f"{human_bytes(n)} ({n:,} bytes)"


def render(r: dict[str, Any]) -> Group:
    t = Table(title=f"ft-diagnose {r['path']}", show_header=False)
    stub = " (header-only stub)" if r["header_only"] else ""
    t.add_row("source", f"{r['kind'] or '?'}{stub}: {r['files']} weight file(s), {r['tensors']} tensors")
    t.add_row("config", r["config"] or "not found")
    if r["family"]:
        t.add_row("family", r["family"] + (f" ({r['architecture']})" if r["architecture"] else ""))
    if r["layers"] is not None:
        t.add_row("layers", f"{r['layers']} ({r['moe_layers']} MoE)")
        t.add_row("experts", f"{r['experts']} per MoE layer, top-{r['top_k']}, stored {r['expert_layout'] or '?'} "
                             f"as {r['expert_dtype'] or '?'}")
    m = r["memory"]
    if m:
        t.add_row("expert slot", f"{_bytes(m['expert_slot_bytes'])}, {m['expert_dtype']} "
                                 f"({_bytes(m['expert_data_bytes'])} of weights)")
        t.add_row("host expert pool", _bytes(m["host_expert_pool_bytes"]))
        t.add_row("dense (GPU)", f"{_bytes(m['dense_bytes'])}, {m['dtype']}")
        t.add_row("KV per 1,000 tokens", f"{_bytes(m['kv_bytes_per_1k_tokens'])}, {m['dtype']}")
        t.add_row("prefix cache (default)", f"{_bytes(m['prefix_cache_bytes'])}: K/V of the whole context")
        t.add_row("smallest GPU budget", f"{_bytes(m['min_gpu_bytes'])}: " + " + ".join(m["min_gpu_terms"])
                  + f" (ft-run --kv-tokens {m['min_gpu_context_tokens']} --no-prefix-cache)")
    parts: list[Any] = [t]
    if r["unexpected"]:
        parts.append(Text(f"{len(r['unexpected'])} tensor(s) the family does not use (ftw-convert skips them): "
                          + ", ".join(r["unexpected"][:SHOWN]) + (" ..." if len(r["unexpected"]) > SHOWN else ""),
                          style="yellow"))
    for note in r["notes"]:
        parts.append(Text(f"note: {note}", style="yellow"))
    for p in r["problems"][:SHOWN]:
        parts.append(Text(f"  - {p}", style="red"))
    if len(r["problems"]) > SHOWN:
        parts.append(Text(f"  ... and {len(r['problems']) - SHOWN} more (--json lists all)", style="red"))
    if r["verdict"] == "PASS":
        parts.append(Text("PASS", style="bold green"))
    else:
        parts.append(Text(f"FAIL: {len(r['problems'])} problem(s)", style="bold red"))
    return Group(*parts)


@app.command()
def run(
    src: Annotated[Path, typer.Argument(
        exists=True, metavar="SRC", help="HF model directory, GGUF file, FTW directory, or a header-only stub of one"
    )],
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object (schema: docs/diagnose.md)")] = False,
) -> None:
    """Check that SRC will load: every tensor present with the right shape and dtype, and its memory plan."""
    result: dict[str, Any] = {}

    def body() -> None:
        result.update(diagnose(src))
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2, allow_nan=False) + "\n")  # strict JSON
        else:
            console.print(render(result))

    guarded(body)
    raise typer.Exit(0 if result["verdict"] == "PASS" else 1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
