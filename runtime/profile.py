"""The bandwidth profile: B_P (pinned host-to-device copies) and B_H (CPU expert execution).

This is the minimal form the planner needs (the calibrate tool writes the full schema, see
docs/profile.md): a JSON object with `pcie_gbps` and `cpu_gbps`, optionally measured while both
run at once as `pcie_overlapped_gbps` and `cpu_overlapped_gbps`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Bandwidths:
    pcie_gbps: float
    cpu_gbps: float
    overlapped: bool  # both figures measured while the other path was busy

    @property
    def ratio(self) -> float:
        """The fraction of misses worth filling, q* = m * ratio.

        Plain figures: B_P / B_H (the CPU keeps B_H - B_P while DMA runs). Overlapped figures
        already include that contention, so fill and CPU time balance at p / (p + c).
        """
        if self.overlapped:
            return self.pcie_gbps / (self.pcie_gbps + self.cpu_gbps)
        return self.pcie_gbps / self.cpu_gbps


def load_profile(path: Path) -> Bandwidths:
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"profile {path} does not exist (run ft-calibrate)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {path} is not valid JSON ({e})") from None
    figures = d.get("figures", d) if isinstance(d, dict) else {}
    for p_key, c_key, overlapped in (("pcie_overlapped_gbps", "cpu_overlapped_gbps", True),
                                     ("pcie_gbps", "cpu_gbps", False)):
        p, c = figures.get(p_key), figures.get(c_key)
        if isinstance(p, (int, float)) and isinstance(c, (int, float)) and p > 0 and c > 0:
            return Bandwidths(float(p), float(c), overlapped)
    raise ValueError(f"profile {path} has no pcie_gbps and cpu_gbps figures")
