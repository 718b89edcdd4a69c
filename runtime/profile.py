"""The bandwidth profile: B_P (pinned host-to-device copies) and B_H (CPU expert execution).

ft-calibrate writes the full schema (docs/profile.md): machine, slot size, and one row of figures
per CPU thread count. The minimal form is still read: a JSON object (or its `figures`) with
`pcie_gbps` and `cpu_gbps`, optionally `pcie_overlapped_gbps` and `cpu_overlapped_gbps`.

The profile is only the planner's starting point: the runtime then corrects the ratio from its own
clock (planner.py).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Bandwidths:
    pcie_gbps: float | None  # None: measured without a GPU
    cpu_gbps: float
    overlapped: bool  # both figures measured while the other path was busy
    threads: int | None = None  # the CPU thread count these figures were measured at

    @property
    def ratio(self) -> float:
        """The fraction of misses worth filling, q* = m * ratio; 0 without PCIe figures.

        Plain figures: B_P / B_H (the CPU keeps B_H - B_P while DMA runs). Overlapped figures
        already include that contention, so fill and CPU time balance at p / (p + c).
        """
        if self.pcie_gbps is None:
            return 0.0
        if self.overlapped:
            return self.pcie_gbps / (self.pcie_gbps + self.cpu_gbps)
        return self.pcie_gbps / self.cpu_gbps


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _nearest_row(rows: list[dict[str, Any]], threads: int | None, path: Path) -> dict[str, Any]:
    """The row measured at `threads` or nearest to it (the largest when `threads` is None)."""
    rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("threads"), int)]
    if not rows:
        raise ValueError(f"profile {path} has no rows of figures")
    if threads is None:
        return max(rows, key=lambda r: r["threads"])
    row = min(rows, key=lambda r: (abs(r["threads"] - threads), -r["threads"]))
    if row["threads"] != threads:
        warnings.warn(f"profile {path} was measured at {row['threads']} CPU thread(s), not {threads}: using "
                      f"its figures as a start (the runtime corrects them from its own timings)", stacklevel=3)
    return row


def load_profile(path: Path, threads: int | None = None, overlapped: bool = True) -> Bandwidths:
    """The figures for `threads` CPU threads: overlapped ones when measured, else the plain ones
    (`overlapped=False`: the plain ones, each path measured alone)."""
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"profile {path} does not exist (run ft-calibrate)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {path} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"profile {path} is not a JSON object")
    if "rows" in d:
        row = _nearest_row(d["rows"] if isinstance(d["rows"], list) else [], threads, path)
        figures, at = {"pcie_gbps": d.get("pcie_gbps"), **row}, row["threads"]
    else:
        figures, at = d.get("figures", d), None
    kinds = (("pcie_overlapped_gbps", "cpu_overlapped_gbps", True), ("pcie_gbps", "cpu_gbps", False))
    for p_key, c_key, both in kinds if overlapped else kinds[::-1]:
        p, c = figures.get(p_key), figures.get(c_key)
        if _positive(p) and _positive(c):
            return Bandwidths(float(p), float(c), both, at)
    if figures.get("pcie_gbps") is None and _positive(figures.get("cpu_gbps")):
        return Bandwidths(None, float(figures["cpu_gbps"]), False, at)
    raise ValueError(f"profile {path} has no pcie_gbps and cpu_gbps figures")
