"""ft-diagnose: a loadability verdict from headers alone (exit 0 PASS, 1 FAIL, 2 usage error).

The checks (`.report`) are imported only once a source is given, so `--help` and `--version`
load no reader."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from ftkit.errors import InputError
from ftkit.runtime.checkpoint.hub import local_path
from ftkit.runtime.console import USAGE, PlainUsage, Version, err_console, fail, guarded
from ftkit.vocab import human_bytes

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
        t.add_row("KV per 1,000 tokens", f"{_bytes(m['kv_bytes_per_1k_tokens'])}, {m['dtype']}"
                  + (f" (full-attention layers); the sliding-window layers {_bytes(m['kv_window_bytes'])} a "
                     "sequence, whatever its length" if m["kv_window_bytes"] else ""))
        t.add_row("prefix cache (default)", f"{_bytes(m['prefix_cache_bytes'])}: K/V of the whole context"
                  + (" (full layers; the sliding ones' windows at its anchors)" if m["kv_window_bytes"] else ""))
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


def unusable(src: str, problem: str) -> dict[str, Any]:
    """The report of a source that cannot even be opened: a FAIL naming why."""
    return {"verdict": "FAIL", "path": src, "kind": None, "header_only": False, "config": None, "files": 0,
            "tensors": 0, "family": None, "architecture": None, "layers": None, "moe_layers": None, "experts": None,
            "top_k": None, "expert_layout": None, "expert_dtype": None, "problems": [problem], "unexpected": [],
            "notes": [], "memory": None}


def remote_report(repo: str, quantize: str | None = None) -> dict[str, Any]:
    """The verdict of a Hugging Face repository from its headers, fetched into a scratch stub."""
    from .remote import fetch_stub
    from .report import diagnose

    with tempfile.TemporaryDirectory(prefix="ft-diagnose-") as tmp:
        fetched, target = fetch_stub(repo, Path(tmp))
        err_console.print(f"fetched {human_bytes(fetched.fetched)} ({fetched.fetched:,} bytes) of headers from "
                          f"{fetched.url('')}", highlight=False, soft_wrap=True)
        result = diagnose(target, quantize)
    return {**result, "path": repo}


@app.command(cls=PlainUsage)
def run(
    src: Annotated[str, typer.Argument(
        metavar="SRC", show_default=False,
        help="HF model directory, GGUF file, FTW directory, or a header-only stub of one; or a Hugging Face id "
             "(org/name) in the local hub cache (a path that exists wins); with --remote, a repository on the Hub "
             "(org/name; a GGUF one as org/name:TAG or org/name/FILE.gguf)"
    )],
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object (schema: docs/diagnose.md)")] = False,
    remote: Annotated[bool, typer.Option("--remote", help="SRC is a Hugging Face repository: fetch only its "
                                                          "headers (HTTP range requests; HF_ENDPOINT, HF_TOKEN)")] = False,
    quantize: Annotated[str | None, typer.Option(help="price a checkpoint's expert slots as `ftw-convert --quantize "
                                                      "PRESET` writes them (e.g. q4_k_m)")] = None,
    version: Version = False,
) -> None:
    """Check that SRC will load: every tensor present with the right shape and dtype, and its memory plan."""
    def show(result: dict[str, Any]) -> None:
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2, allow_nan=False) + "\n")  # strict JSON
        else:
            console.print(render(result))

    def report() -> dict[str, Any]:
        if remote:
            return remote_report(src, quantize)
        from .report import diagnose

        return diagnose(local_path(src), quantize)

    result: dict[str, Any] = {}
    try:
        result.update(report())
    except (FileNotFoundError, InputError) as e:
        if as_json:  # a CI step gets a verdict, not an empty file
            show(unusable(src, str(e)))
        fail(str(e), USAGE)
    guarded(lambda: show(result))
    raise typer.Exit(0 if result["verdict"] == "PASS" else 1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
