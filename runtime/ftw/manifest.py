"""FTW v3: the manifest schema and the fingerprint (spec: docs/ftw.md); the slot layout it
records is `ftkit.vocab.expert_layout`. Version 1 directories (one format for every part of
every layer) and version 2 ones (dense tensors only floats) are still read."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ftkit.errors import InputError, shown
from ftkit.vocab import (
    BIAS_PARTS,
    DENSE_FORMATS,
    EXPERT_PARTS,
    STORED_DENSE_FORMATS,
    ExpertLayout,
    FormatError,
    expert_layout,
    stored_nbytes,
)

from ..checkpoint.base import inside
from ..checkpoint.jsonfile import type_name
from ..spec import ModelSpec, SpecError

FORMAT = "ftw"
VERSION = 3  # 3: dense tensors may be GGUF blocks too, kept as stored (dequantized when loaded)
DENSE_BLOCKS = 3  # the first version whose dense tensors may be blocks
OLDEST = 1  # 1: one format for every slot part, `experts.layout` that one slot's parts
# (2: each MoE layer's parts have their own format, GGUF blocks kept as stored)
MANIFEST = "manifest.json"
DENSE_FILE = "dense.safetensors"
ROW_ORDER = "moe_layer * num_experts + expert"


class FTWError(InputError):
    """An FTW directory cannot be read exactly; the message says what to do."""


@dataclass(frozen=True)
class Bank:
    file: str
    first_row: int
    rows: int
    sha256: str


def fingerprint(spec: dict[str, Any], layout: dict[str, Any], banks: list[dict[str, Any]],
                version: int = VERSION) -> str:
    """What the banks were packed for: spec, slot layout, row order and bank split."""
    what = {
        "format": FORMAT,
        "version": version,
        "spec": spec,
        "layout": layout,
        "row_order": ROW_ORDER,
        "banks": [[b["file"], b["first_row"], b["rows"]] for b in banks],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


@dataclass
class Manifest:
    spec: ModelSpec
    layout: ExpertLayout
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
        """Refuse, with advice, anything this version cannot read exactly: every field the
        reader and the runtime use is type-checked here, before any of it is used."""
        if d.get("format") != FORMAT:
            raise FTWError(f"{where}: not an FTW manifest (format {shown(d.get('format'))})")
        version = d.get("version")
        if type(version) is not int:
            raise FTWError(f"{where}: malformed FTW manifest (version {shown(version)} is not a whole number)")
        if version > VERSION:
            raise FTWError(
                f"{where}: FTW version {shown(version)} was written by a newer ftkit ({shown(d.get('writer'))}); "
                f"this ftkit reads version {VERSION}: upgrade ftkit, or reconvert with this one"
            )
        if version < OLDEST:
            raise FTWError(f"{where}: FTW version {version} is no longer read; reconvert with ftw-convert")
        m = _Fields(where)
        if "spec" not in d:
            m.fail("no spec")
        try:
            spec = ModelSpec.from_dict(d["spec"])
        except SpecError as e:
            raise FTWError(f"{where}: spec: {e}") from None
        ex = m.object(d.get("experts"), "experts")
        lay = m.object(ex.get("layout"), "experts.layout")
        if version > 1:
            formats = m.formats(lay, spec.num_moe_layers)
        elif type(formats := lay.get("dtype")) is not str:  # v1: one format for every part
            m.fail(f"experts.layout.dtype is {type_name(formats)}, not a format name")
        try:
            layout = expert_layout(spec, formats)
        except FormatError as e:
            raise FTWError(f"{where}: expert layout: {e}") from None
        recomputed = layout.to_dict() if version > 1 else layout.layers[0].to_dict()
        if recomputed != lay or ex.get("row_order") != ROW_ORDER:
            raise FTWError(
                f"{where}: expert banks use a slot layout this ftkit does not produce "
                f"(written by {shown(d.get('writer'))}); reconvert with ftw-convert"
            )
        banks = m.banks(ex.get("banks"), spec.num_expert_rows)
        if type(d.get("fingerprint")) is not str or fingerprint(d["spec"], lay, ex["banks"], version) != d["fingerprint"]:
            raise FTWError(f"{where}: manifest fingerprint mismatch (edited or corrupt); reconvert")
        m.rows(banks, spec.num_expert_rows)
        if ex.get("rows") != spec.num_expert_rows:
            m.fail(f"experts.rows is {shown(ex.get('rows'))}, the spec has {spec.num_expert_rows} expert rows")
        dense = m.dense(d.get("dense"), STORED_DENSE_FORMATS if version >= DENSE_BLOCKS else DENSE_FORMATS)
        files = m.files(d.get("files", {}))
        named = [b.file for b in banks] + [dense["file"], MANIFEST, *files]
        if len(set(named)) != len(named):
            m.fail(f"{next(n for n in named if named.count(n) > 1)} is named twice")
        writer, source = d.get("writer", "?"), d.get("source", {})
        if type(writer) is not str or type(source) is not dict:
            m.fail("writer is not a string or source not an object")
        return cls(spec, layout, banks, dense, files, writer, source)


_HEX64 = re.compile(r"[0-9a-f]{64}")


class _Fields:
    """Type checks of a manifest's parts, each failure one FTWError naming the field."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, what: str) -> NoReturn:
        raise FTWError(f"{self.where}: malformed FTW manifest ({what})")

    def object(self, value: Any, what: str) -> dict[str, Any]:
        if type(value) is not dict:
            self.fail(f"{what} is {type_name(value)}, not an object")
        return value

    def file(self, value: Any, what: str) -> str:
        if not inside(value):
            self.fail(f"{what} {shown(value)} is not a file name inside the directory")
        return value

    def formats(self, layout: dict[str, Any], layers: int) -> list[tuple[str, ...]]:
        """Each MoE layer's part formats, from a v2 layout's `layers` (checked against the
        layout recomputed from them afterwards)."""
        value = layout.get("layers")
        if type(value) is not list or len(value) != layers:
            self.fail(f"experts.layout.layers is not a list of {layers} layers")
        out = []
        for i, lay in enumerate(value):
            parts = self.object(lay, f"layout layer #{i}").get("parts")
            # gate, up, down, then (experts with biases) their three float32 biases
            if (type(parts) is not list or len(parts) not in (len(EXPERT_PARTS), len(EXPERT_PARTS) + len(BIAS_PARTS))
                    or not all(type(p) is dict for p in parts)):
                self.fail(f"layout layer #{i} parts is not a list of {len(EXPERT_PARTS)} "
                          f"or {len(EXPERT_PARTS) + len(BIAS_PARTS)} objects")
            out.append(tuple(p.get("dtype") for p in parts[: len(EXPERT_PARTS)]))
        return out

    def sha(self, value: Any, what: str) -> str:
        if type(value) is not str or not _HEX64.fullmatch(value):
            self.fail(f"{what} is not a SHA-256 in hex")
        return value

    def banks(self, value: Any, rows: int) -> list[Bank]:
        """The bank list, each entry's fields typed (at most one bank per row)."""
        if type(value) is not list or not 0 < len(value) <= rows:
            self.fail(f"experts.banks is not a list of 1..{rows} banks")
        banks = []
        for i, b in enumerate(value):
            b = self.object(b, f"bank #{i}")
            if set(b) != {"file", "first_row", "rows", "sha256"}:
                self.fail(f"bank #{i} has fields {sorted(b)}, expected file, first_row, rows, sha256")
            if type(b["first_row"]) is not int or type(b["rows"]) is not int or b["rows"] < 1:
                self.fail(f"bank #{i} first_row or rows is not a positive whole number")
            banks.append(Bank(self.file(b["file"], f"bank #{i} file"), b["first_row"], b["rows"],
                              self.sha(b["sha256"], f"bank #{i} sha256")))
        return banks

    def rows(self, banks: list[Bank], rows: int) -> None:
        """The banks hold rows 0..rows-1 in order, each but the last the same number of rows
        (HostBanks.slot finds a row's bank by one division)."""
        at = 0
        for i, b in enumerate(banks):
            if b.first_row != at:
                raise FTWError(f"{self.where}: bank {b.file} starts at row {b.first_row}, expected {at}")
            if (i < len(banks) - 1 and b.rows != banks[0].rows) or b.rows > banks[0].rows:
                self.fail(f"bank {b.file} holds {b.rows} rows, the first bank {banks[0].rows}")
            at += b.rows
        if at != rows:
            raise FTWError(f"{self.where}: banks hold {at} expert rows, the model needs {rows}")

    def dense(self, value: Any, formats: tuple[str, ...]) -> dict[str, Any]:
        """{"file", "sha256", "tensors": {name: {"dtype", "shape"}}}, each dtype one of `formats`
        (the version's: floats, and from v3 GGUF blocks, whose rows must be whole blocks)."""
        dense = self.object(value, "dense")
        self.file(dense.get("file"), "dense file")
        self.sha(dense.get("sha256"), "dense sha256")
        for name, t in self.object(dense.get("tensors"), "dense tensors").items():
            t = self.object(t, f"dense tensor {name}")
            if t.get("dtype") not in formats:
                self.fail(f"dense tensor {name} dtype {shown(t.get('dtype'))} is not one of {', '.join(formats)}")
            shape = t.get("shape")
            if type(shape) is not list or len(shape) > 8 or not all(type(n) is int and n >= 0 for n in shape):
                self.fail(f"dense tensor {name} shape {shown(shape)} is not a list of sizes")
            try:
                stored_nbytes(t["dtype"], tuple(shape))
            except FormatError as e:
                self.fail(f"dense tensor {name}: {e}")
        return dense

    def files(self, value: Any) -> dict[str, str]:
        files = self.object(value, "files")
        for rel, sha in files.items():
            self.file(rel, "carried file")
            self.sha(sha, f"checksum of {rel}")
        return files


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
