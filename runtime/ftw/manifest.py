"""FTW v1: the manifest schema and the fingerprint (spec: docs/ftw.md); the slot layout it
records is `ftkit.vocab.slot_layout`."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftkit.vocab import SlotLayout, slot_layout

from ..checkpoint.base import one_line
from ..spec import ModelSpec

FORMAT = "ftw"
VERSION = 1
MANIFEST = "manifest.json"
DENSE_FILE = "dense.safetensors"
ROW_ORDER = "moe_layer * num_experts + expert"


class FTWError(Exception):
    """An FTW directory cannot be read exactly; the message says what to do."""

    def __init__(self, message: str):
        super().__init__(one_line(message))


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
