"""Writer primitives: a streaming safetensors writer for dense tensors, an expert bank writer,
and an atomic output directory. Each holds one tensor (or one slot) at a time."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from ftkit.vocab import (
    BLOCK_FORMATS,
    SLOT_ALIGN,
    ExpertLayout,
    storage_dtype,
    stored_nbytes,
    stored_shape,
)

from ..checkpoint.safetensors import ST_DTYPES
from .manifest import Bank

TO_ST = {v: k for k, v in ST_DTYPES.items()}


def raw_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


class HashingFile:
    """A file written sequentially, hashed as it goes (so checksums cost no second pass)."""

    def __init__(self, path: Path):
        self.path = path
        self.f = open(path, "wb")
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: memoryview | bytes) -> None:
        self.f.write(data)
        self.sha.update(data)
        self.size += len(data)

    def close(self) -> str:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return self.sha.hexdigest()


class DenseWriter:
    """Writes a safetensors file tensor by tensor: the header is known before any data."""

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...]]]):
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        off = 0
        self.expect: list[tuple[str, str, tuple[int, ...], int]] = []
        for name, dtype, shape in entries:  # GGUF blocks: their bytes, [..., bytes a row] of uint8
            n, stored = stored_nbytes(dtype, shape), stored_shape(dtype, shape)
            header[name] = {"dtype": "U8" if dtype in BLOCK_FORMATS else TO_ST[dtype], "shape": list(stored),
                            "data_offsets": [off, off + n]}
            self.expect.append((name, dtype, stored, n))
            off += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.out = HashingFile(path)
        self.out.write(struct.pack("<Q", len(blob)) + blob)
        self.next = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        ename, dtype, shape, n = self.expect[self.next]
        if name != ename or t.dtype != storage_dtype(dtype) or tuple(t.shape) != shape:
            raise ValueError(f"dense writer expected {ename} {dtype}{list(shape)}, got {name} {t.dtype}{list(t.shape)}")
        self.out.write(raw_bytes(t))
        self.next += 1

    def close(self) -> str:
        if self.next != len(self.expect):
            raise ValueError(f"dense writer closed after {self.next} of {len(self.expect)} tensors")
        return self.out.close()


class BankWriter:
    """Writes expert slots in row order, `rows_per_bank` rows per bank file, each row's parts
    where its layer's layout puts them."""

    def __init__(self, out_dir: Path, layout: ExpertLayout, rows: int, rows_per_bank: int):
        self.dir, self.layout, self.rows, self.per_bank = out_dir, layout, rows, max(1, rows_per_bank)
        self.banks: list[Bank] = []
        self.row = 0
        self.file: HashingFile | None = None
        self.slot = torch.zeros(layout.slot_bytes, dtype=torch.uint8)

    def write_slot(self, row: int, parts: dict[str, torch.Tensor]) -> None:
        if row != self.row:
            raise ValueError(f"bank writer expected row {self.row}, got {row}")
        if self.file is None:
            self.file = HashingFile(self.dir / f"experts-{len(self.banks):05d}.ftwb")
            self.first = row
        self.slot.zero_()
        for p in self.layout.for_row(row).parts:
            t = parts[p.name]
            want = storage_dtype(p.dtype)
            if t.dtype != want:
                raise ValueError(f"expert part {p.name} is {t.dtype}, layout says {p.dtype}")
            data = t.contiguous().view(torch.uint8).reshape(-1)
            if data.numel() != p.nbytes:
                raise ValueError(f"expert part {p.name} has {data.numel()} bytes, layout says {p.nbytes}")
            self.slot[p.offset : p.offset + p.nbytes] = data
        self.file.write(raw_bytes(self.slot))
        self.row += 1
        if self.row - self.first == self.per_bank or self.row == self.rows:
            self._close_bank()

    def _close_bank(self) -> None:
        assert self.file is not None
        sha = self.file.close()
        self.banks.append(Bank(self.file.path.name, self.first, self.row - self.first, sha))
        self.file = None

    def close(self) -> list[Bank]:
        if self.row != self.rows:
            raise ValueError(f"bank writer closed after {self.row} of {self.rows} rows")
        return self.banks


def rows_per_bank(slot_bytes: int, num_experts: int, bank_bytes: int) -> int:
    """Whole MoE layers per bank file, at least one layer."""
    assert slot_bytes % SLOT_ALIGN == 0
    return max(1, bank_bytes // (slot_bytes * num_experts)) * num_experts


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_dir(out: Path, force: bool) -> Iterator[Path]:
    """A temporary sibling of `out` to fill; renamed onto `out` only if the block succeeds. The
    writer holds a lock beside it while it writes, so a later run can tell an interrupted run's
    leftovers (killed: no `finally` ran) from another writer's, and removes them."""
    out = out.absolute()
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    with _held(_lock_path(tmp)):
        tmp.mkdir()
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _remove_stale(out: Path) -> None:
    """Remove the temporary siblings of `out` (`.NAME.tmp-*`, `.NAME.old-*`) that no writer
    holds: what a killed run left. Says so on stderr."""
    for path in sorted(out.parent.glob(f".{out.name}.tmp-*")) + sorted(out.parent.glob(f".{out.name}.old-*")):
        if path.suffix == ".lock" or not path.is_dir():
            continue
        lock = _lock_path(path)
        try:
            with _held(lock, wait=False):
                if not path.exists():  # its writer finished meanwhile (renamed it onto `out`)
                    continue
                size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                shutil.rmtree(path, ignore_errors=True)
        except BlockingIOError:  # another writer is filling it
            continue
        print(f"ftkit: removed {path.name}, left by an interrupted write of {out.name} ({size / 2**30:.2f} GiB)",
              file=sys.stderr)


def _lock_path(tmp: Path) -> Path:
    return tmp.with_name(tmp.name + ".lock")


@contextlib.contextmanager
def _held(lock: Path, wait: bool = True) -> Iterator[None]:
    """An exclusive lock on the file `lock` (created; removed on release). `wait=False`: a
    BlockingIOError where another process holds it."""
    import fcntl

    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)
    finally:
        os.close(fd)
