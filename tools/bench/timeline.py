"""Where a host-planned forward's device time goes, layer by layer, from a Chrome trace:
`python -m ftkit.tools.bench.timeline TRACE.trace.json.gz` (made for an extend's trace).

`ft-bench decode --trace-dir DIR` with `FTKIT_CHROME_TRACE=1` writes one for the profiled repeat
of each chunk and extend (torch.profiler: host work runs 1.5-3x slower than unprofiled, device
work does not). A host-planned MoE layer reads its routing back once, the only copy into pageable
host memory (`ExpertStore._sorted`); its expert fills are the copies from page-locked memory of
at least `--min-bytes`. Between two read-backs this reports, in means over the layers with
fills: `plan` (read-back to the first fill: nothing moves while the host plans), `lead_idle`
(the copy engine idle after the first fill while the host puts the CPU call together), `fills`
(first fill's start to the last one's end), `copying` (their own time) and `fill GB/s`,
`done_wait` (the stream waiting for the CPU branch's done word), `tail` (last fill to the next
read-back: the expert GEMM, the merge, the next layer's dense part and router).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

READ_BACK = "Device -> Pageable"
FILL = "Pinned -> Device"
DONE_WAIT = "_wait_word"


def load(path: Path) -> list[dict]:
    """The trace's device events (kernels, copies), in start order."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(device, key=lambda e: e["ts"])


def layers(events: list[dict], min_bytes: int = 2**20) -> list[dict[str, float]]:
    """Per layer with fills (from one routing read-back to the next), times in ms."""
    marks = [i for i, e in enumerate(events) if READ_BACK in e["name"]]
    out: list[dict[str, float]] = []
    if not marks:
        return out
    for a, b in zip(marks, marks[1:] + [len(events)], strict=True):
        back = events[a]["ts"] + events[a]["dur"]
        span = events[a + 1 : b]
        fills = [e for e in span if FILL in e["name"] and e.get("args", {}).get("bytes", 0) >= min_bytes]
        if not fills:
            continue
        end = fills[-1]["ts"] + fills[-1]["dur"]
        copying = sum(e["dur"] for e in fills)
        row = {
            "plan": fills[0]["ts"] - back,
            "lead_idle": fills[1]["ts"] - (fills[0]["ts"] + fills[0]["dur"]) if len(fills) > 1 else None,
            "fills": end - fills[0]["ts"],
            "copying": copying,
            "fill_gbps": sum(e["args"]["bytes"] for e in fills) / copying / 1e3,
            "done_wait": sum(e["dur"] for e in span if e["name"] == DONE_WAIT),
            "tail": events[b]["ts"] + events[b]["dur"] - end if b < len(events) else None,
        }
        out.append({k: v if v is None or k == "fill_gbps" else v / 1e3 for k, v in row.items()})
    return out


def means(rows: list[dict[str, float]]) -> dict[str, float | None]:
    """Each column's mean over the layers that have it."""
    keys = rows[0] if rows else {}
    return {k: statistics.fmean(vals) if (vals := [r[k] for r in rows if r[k] is not None]) else None for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--min-bytes", type=int, default=2**20, help="smallest copy counted as an expert fill")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    events = load(a.trace)
    rows = layers(events, a.min_bytes)
    if not rows:
        raise SystemExit(f"{a.trace}: no layer with expert fills (a graph decode step, or --min-bytes too high)")
    m = means(rows)
    span = (events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]) / 1e3
    table = Table(title=f"{a.trace.name}: {len(rows)} layers with fills, device span {span:.1f} ms (means)")
    for col in m:
        table.add_column(col.replace("_gbps", " GB/s") if col == "fill_gbps" else f"{col} ms", justify="right")
    table.add_row(*("-" if v is None else f"{v:.1f}" if k == "fill_gbps" else f"{v:.3f}" for k, v in m.items()))
    Console().print(table)
    if a.json:
        a.json.write_text(json.dumps({"span_ms": span, "means": m, "layers": rows}, indent=1))


if __name__ == "__main__":
    main()
