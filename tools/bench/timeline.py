"""Where a forward's device time goes, from a Chrome trace (host-planned: layer by layer):
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
read-back: the expert GEMM, the merge, the next layer's dense part and router). For any trace
(graph decode too) it also reports the device's idle time and where its largest gaps fall.
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


def idle(events: list[dict], min_us: float = 1.0) -> dict:
    """The device's idle time: span, busy (the union of its events) and the gaps of at least
    `min_us`, summed per (event before, event after) pair, largest first, times in ms. Made for
    a graph decode trace, which has no read-backs: its steps are replayed kernels only."""
    end, last, busy, pairs = events[0]["ts"], events[0]["name"], 0.0, {}
    for e in events:
        if e["ts"] - end >= min_us:
            pair = pairs.setdefault((last[:40], e["name"][:40]), [0, 0.0])
            pair[0] += 1
            pair[1] += e["ts"] - end
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        if e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e["name"]
    span = end - events[0]["ts"]
    gaps = sorted(([a, b, n, t / 1e3] for (a, b), (n, t) in pairs.items()), key=lambda g: -g[3])
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3, "gaps": gaps}


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
    if not events:
        raise SystemExit(f"{a.trace}: no device events")
    rows, gaps = layers(events, a.min_bytes), idle(events)
    console = Console()
    if rows:
        m = means(rows)
        table = Table(title=f"{a.trace.name}: {len(rows)} layers with fills, device span {gaps['span_ms']:.1f} ms (means)")
        for col in m:
            table.add_column(col.replace("_gbps", " GB/s") if col == "fill_gbps" else f"{col} ms", justify="right")
        table.add_row(*("-" if v is None else f"{v:.1f}" if k == "fill_gbps" else f"{v:.3f}" for k, v in m.items()))
        console.print(table)
    table = Table(title=f"{a.trace.name}: device span {gaps['span_ms']:.2f} ms, busy {gaps['busy_ms']:.2f}, "
                        f"idle {gaps['idle_ms']:.2f} (largest idle gaps of >= 1 us)")
    for col in ("before", "after", "gaps", "idle ms"):
        table.add_column(col, justify="right" if col in ("gaps", "idle ms") else "left")
    for before, after, n, ms in gaps["gaps"][:12]:
        table.add_row(before, after, str(n), f"{ms:.3f}")
    console.print(table)
    if a.json:
        a.json.write_text(json.dumps({"span_ms": gaps["span_ms"], "means": means(rows) if rows else None,
                                      "layers": rows, "idle": gaps}, indent=1))


if __name__ == "__main__":
    main()
