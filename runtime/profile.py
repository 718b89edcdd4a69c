"""The bandwidth profile: B_P (pinned host-to-device copies) and B_H (CPU expert execution).

One type, `Profile`, for the file ft-calibrate writes and the runtime reads (docs/profile.md):
the machine it was measured on, the slot size, and one row of figures per CPU thread count. The
minimal form is still read: a JSON object (or its `figures`) with `pcie_gbps` and `cpu_gbps`,
optionally `pcie_overlapped_gbps` and `cpu_overlapped_gbps`.

ft-calibrate saves to `default_path(gpu)`, where the runtime looks a GPU's profile up. The
profile is only the planner's starting point: the runtime then corrects the ratio from its own
clock (planner.py).
"""

from __future__ import annotations

import json
import os
import platform
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .ftw.manifest import write_json_atomic

SCHEMA = 1


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


@dataclass(frozen=True)
class GPU:
    name: str
    uuid: str  # "GPU-…", as nvidia-smi prints it; "" where torch does not say


@dataclass(frozen=True)
class CPUInfo:
    model: str
    cores: int | None
    kernel: str  # the ISA the CPU kernel was built for, or "torch"


@dataclass(frozen=True)
class ExpertInfo:
    dtype: str
    shape: tuple[int, int]  # [H, I] of one expert
    slot_bytes: int


@dataclass(frozen=True)
class Row:
    """The figures measured at one CPU thread count (GB/s; None: not measured)."""

    threads: int | None  # None: the minimal form, measured at no stated count
    cpu_gbps: float | None
    pcie_overlapped_gbps: float | None = None
    cpu_overlapped_gbps: float | None = None
    dram_read_gbps: float | None = None


FIGURES = ("cpu_gbps", "pcie_overlapped_gbps", "cpu_overlapped_gbps", "dram_read_gbps")


@dataclass(frozen=True)
class Profile:
    pcie_gbps: float | None
    rows: tuple[Row, ...]  # ascending thread counts
    gpu: GPU | None = None  # None: measured without a GPU
    host: str | None = None
    created: str | None = None  # UTC, ISO 8601
    tool: str | None = None
    cpu: CPUInfo | None = None
    expert: ExpertInfo | None = None
    working_set_bytes: int | None = None
    schema: int | None = SCHEMA  # None: the minimal form, which says nothing of the machine
    path: Path | None = field(default=None, compare=False)  # where it was read from

    def to_dict(self) -> dict[str, Any]:
        if self.schema is None:  # read from the minimal form: written back as one
            return {"pcie_gbps": self.pcie_gbps, **{k: v for k, v in vars(self.rows[0]).items() if k != "threads"}}
        return {
            "schema": self.schema, "tool": self.tool, "created": self.created, "host": self.host,
            "gpu": None if self.gpu is None else {"name": self.gpu.name, "uuid": self.gpu.uuid},
            "cpu": None if self.cpu is None else vars(self.cpu),
            "expert": None if self.expert is None else {**vars(self.expert), "shape": list(self.expert.shape)},
            "working_set_bytes": self.working_set_bytes, "pcie_gbps": self.pcie_gbps,
            "rows": [vars(r) for r in self.rows],
        }

    @classmethod
    def from_dict(cls, d: Any, path: Path | None = None) -> Profile:
        """The full schema, or the minimal form as one row measured at no stated thread count;
        `path`: where `d` was read from (errors name it)."""
        where = f"profile {path}" if path is not None else "the profile"
        if not isinstance(d, dict):
            raise ValueError(f"{where} is not a JSON object")
        if "rows" not in d:
            figures = d.get("figures", d)
            figures = figures if isinstance(figures, dict) else {}
            row = Row(None, *(_number(figures.get(k)) for k in FIGURES))
            return cls(_number(figures.get("pcie_gbps")), (row,), schema=None, path=path)
        rows = d["rows"] if isinstance(d["rows"], list) else []
        rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("threads"), int)]
        if not rows:
            raise ValueError(f"{where} has no rows of figures")
        gpu, cpu, expert = d.get("gpu"), d.get("cpu"), d.get("expert")
        try:
            return cls(
                pcie_gbps=_number(d.get("pcie_gbps")),
                rows=tuple(Row(r["threads"], *(_number(r.get(k)) for k in FIGURES)) for r in rows),
                gpu=GPU(gpu["name"], gpu.get("uuid") or "") if isinstance(gpu, dict) else None,
                host=d.get("host"), created=d.get("created"), tool=d.get("tool"),
                cpu=CPUInfo(cpu["model"], cpu.get("cores"), cpu["kernel"]) if isinstance(cpu, dict) else None,
                expert=ExpertInfo(expert["dtype"], tuple(expert["shape"]), expert["slot_bytes"])
                if isinstance(expert, dict) else None,
                working_set_bytes=d.get("working_set_bytes"), schema=d.get("schema"), path=path,
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"{where} is malformed ({type(e).__name__}: {e})") from None

    def save(self, path: Path) -> None:
        """Write atomically (a reader never sees half a profile), making its folder."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, self.to_dict())

    def bandwidths(self, threads: int | None = None, overlapped: bool = True) -> Bandwidths:
        """The figures for `threads` CPU threads: overlapped ones when measured, else the plain
        ones (`overlapped=False`: the plain ones, each path measured alone)."""
        row = self._nearest_row(threads)
        kinds = (("pcie_overlapped_gbps", "cpu_overlapped_gbps", True), ("pcie_gbps", "cpu_gbps", False))
        for p_key, c_key, both in kinds if overlapped else kinds[::-1]:
            p = self.pcie_gbps if p_key == "pcie_gbps" else getattr(row, p_key)
            c = getattr(row, c_key)
            if _positive(p) and _positive(c):
                return Bandwidths(float(p), float(c), both, row.threads)
        if self.pcie_gbps is None and _positive(row.cpu_gbps):
            return Bandwidths(None, float(row.cpu_gbps), False, row.threads)
        raise ValueError(f"profile {self.path} has no pcie_gbps and cpu_gbps figures")

    def _nearest_row(self, threads: int | None) -> Row:
        """The row measured at `threads` or nearest to it (the largest when `threads` is None)."""
        if len(self.rows) == 1 and self.rows[0].threads is None:
            return self.rows[0]
        if threads is None:
            return max(self.rows, key=lambda r: r.threads)
        row = min(self.rows, key=lambda r: (abs(r.threads - threads), -r.threads))
        if row.threads != threads:
            warnings.warn(f"profile {self.path} was measured at {row.threads} CPU thread(s), not {threads}: using "
                          f"its figures as a start (the runtime corrects them from its own timings)", stacklevel=3)
        return row

    def mismatch(self, gpu: GPU | None, host: str) -> str | None:
        """Why this profile's figures are not this machine's (None: they are, or it does not say)."""
        if self.schema is None:
            return None
        if gpu is not None and self.gpu is None:
            return "was measured without a GPU"
        if gpu is not None and self.gpu.uuid != gpu.uuid:
            return f"was measured on {self.gpu.name} {self.gpu.uuid}, not this GPU ({gpu.uuid})"
        if self.host is not None and self.host != host:
            return f"was measured on host {self.host}, not this one ({host})"
        return None


def _number(v: Any) -> float | int | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _positive(v: Any) -> bool:
    return v is not None and v > 0


def load_profile(path: Path) -> Profile:
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"profile {path} does not exist (run ft-calibrate)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {path} is not valid JSON ({e})") from None
    return Profile.from_dict(d, Path(path))


def cache_dir() -> Path:
    """ftkit's cache: $XDG_CACHE_HOME/ftkit (~/.cache/ftkit)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ftkit"


def profiles_dir() -> Path:
    """Where ft-calibrate saves profiles: the cache's profiles/."""
    return cache_dir() / "profiles"


def default_path(gpu: GPU | None, base: Path | None = None, host: str | None = None) -> Path:
    """A machine's profile: `<gpu-uuid>.json`, or `cpu-<host>.json` without a GPU (or its uuid)."""
    name = gpu.uuid if gpu is not None and gpu.uuid else f"cpu-{host or platform.node()}"
    return (base or profiles_dir()) / f"{name}.json"


def gpu_identity(index: int | None = None) -> GPU | None:
    """The name and uuid of CUDA device `index` (None: the current one), or None without CUDA."""
    import torch  # only here: ft-calibrate's schema and the reader need no torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    uuid = str(getattr(props, "uuid", "") or "")
    return GPU(props.name, uuid if uuid.startswith("GPU-") or not uuid else f"GPU-{uuid}")
