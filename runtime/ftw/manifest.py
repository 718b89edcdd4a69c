"""FTW v1: the manifest schema, the expert slot layout and the fingerprint (spec: docs/ftw.md)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.base import Q8_0, TORCH_DTYPES, one_line, stored_nbytes, stored_shape
from ..spec import EXPERT_PARTS, ModelSpec

FORMAT = "ftw"
VERSION = 1
ALIGN = 4096  # one slot = one DMA = one O_DIRECT read
PART_ALIGN = 64  # each part starts on a cache line, so kernels can load it with full-width vectors
MANIFEST = "manifest.json"
DENSE_FILE = "dense.safetensors"
ROW_ORDER = "moe_layer * num_experts + expert"
EXPERT_DTYPES = ("float32", "float16", "bfloat16", Q8_0)


class FTWError(Exception):
    """An FTW directory cannot be read exactly; the message says what to do."""

    def __init__(self, message: str):
        super().__init__(one_line(message))


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Part:
    name: str
    dtype: str
    shape: tuple[int, ...]  # logical element shape
    offset: int  # bytes from the start of the slot
    nbytes: int

    def view(self, slot: torch.Tensor) -> torch.Tensor:
        """This part of a uint8 slot, in its stored dtype and shape (raw rows for q8_0)."""
        raw = slot[self.offset : self.offset + self.nbytes]
        if self.dtype == Q8_0:
            return raw.view(stored_shape(self.dtype, self.shape))
        return raw.view(TORCH_DTYPES[self.dtype]).view(self.shape)


@dataclass(frozen=True)
class SlotLayout:
    """How one (layer, expert) is laid out in its slot: gate, up, down, padded to ALIGN."""

    dtype: str
    parts: tuple[Part, ...]
    slot_bytes: int

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "alignment": ALIGN,
            "slot_bytes": self.slot_bytes,
            "parts": [
                {"name": p.name, "dtype": p.dtype, "shape": list(p.shape), "offset": p.offset, "nbytes": p.nbytes}
                for p in self.parts
            ],
        }


def slot_layout(spec: ModelSpec, dtype: str) -> SlotLayout:
    """The one layout this version writes and reads for `spec` and expert dtype `dtype`."""
    if dtype not in EXPERT_DTYPES:
        raise FTWError(f"expert dtype {dtype} is not one of {', '.join(EXPERT_DTYPES)}")
    parts, off = [], 0
    for name in EXPERT_PARTS:
        shape = spec.expert_part_shapes()[name]
        n = stored_nbytes(dtype, shape)
        parts.append(Part(name, dtype, shape, off, n))
        off = align_up(off + n, PART_ALIGN)
    return SlotLayout(dtype, tuple(parts), align_up(off, ALIGN))


@dataclass(frozen=True)
class Bank:
    file: str
    first_row: int
    rows: int
    sha256: str


def fingerprint(spec: dict[str, Any], layout: dict[str, Any], banks: list[dict[str, Any]]) -> str:
    """What the banks were packed for: spec, slot layout, row order and bank split."""
    what = {
        "format": FORMAT,
        "version": VERSION,
        "spec": spec,
        "layout": layout,
        "row_order": ROW_ORDER,
        "banks": [[b["file"], b["first_row"], b["rows"]] for b in banks],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


@dataclass
class Manifest:
    spec: ModelSpec
    layout: SlotLayout
    banks: list[Bank]
    dense: dict[str, Any]  # {"file", "sha256", "tensors": {name: {"dtype", "shape"}}}
    files: dict[str, str]  # carried side files: relative path -> sha256
    writer: str
    source: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        spec, layout = self.spec.to_dict(), self.layout.to_dict()
        banks = [vars(b) for b in self.banks]
        return {
            "format": FORMAT,
            "version": VERSION,
            "writer": self.writer,
            "spec": spec,
            "experts": {"row_order": ROW_ORDER, "rows": self.spec.num_expert_rows, "layout": layout, "banks": banks},
            "dense": self.dense,
            "files": self.files,
            "source": self.source,
            "fingerprint": fingerprint(spec, layout, banks),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> Manifest:
        """Refuse, with advice, anything this version cannot read exactly."""
        if d.get("format") != FORMAT:
            raise FTWError(f"{where}: not an FTW manifest (format {d.get('format')!r})")
        version = d.get("version")
        if not isinstance(version, int) or version > VERSION:
            raise FTWError(
                f"{where}: FTW version {version} was written by a newer ftkit ({d.get('writer')}); "
                f"this ftkit reads version {VERSION}: upgrade ftkit, or reconvert with this one"
            )
        if version < VERSION:
            raise FTWError(f"{where}: FTW version {version} is no longer read; reconvert with ftw-convert")
        try:
            spec = ModelSpec.from_dict(d["spec"])
            ex = d["experts"]
            layout = slot_layout(spec, ex["layout"]["dtype"])
            banks = [Bank(**b) for b in ex["banks"]]
            stored_fp = d["fingerprint"]
            dense, files = d["dense"], d.get("files", {})
        except (KeyError, TypeError, ValueError) as e:
            raise FTWError(f"{where}: malformed FTW manifest ({type(e).__name__}: {e})") from None
        if layout.to_dict() != ex["layout"] or ex.get("row_order") != ROW_ORDER:
            raise FTWError(
                f"{where}: expert banks use a slot layout this ftkit does not produce "
                f"(written by {d.get('writer')}); reconvert with ftw-convert"
            )
        if fingerprint(d["spec"], ex["layout"], ex["banks"]) != stored_fp:
            raise FTWError(f"{where}: manifest fingerprint mismatch (edited or corrupt); reconvert")
        rows = 0
        for b in banks:
            if b.first_row != rows:
                raise FTWError(f"{where}: bank {b.file} starts at row {b.first_row}, expected {rows}")
            rows += b.rows
        if rows != spec.num_expert_rows:
            raise FTWError(f"{where}: banks hold {rows} expert rows, the model needs {spec.num_expert_rows}")
        return cls(spec, layout, banks, dense, files, d.get("writer", "?"), d.get("source", {}))


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
