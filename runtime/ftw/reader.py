"""Reading FTW: manifest checks, dense tensors, and expert banks into host buffers.

Banks are read with parallel positional reads straight into one page-aligned anonymous buffer
per bank, through O_DIRECT where the filesystem takes it (probed once) and a read-only mmap
where it does not (tmpfs, overlayfs). Buffers are pinned only after they are filled: pinning a
lazily-mapped buffer first would fault and zero every page, only to overwrite it.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from ftkit.kernels.dequant import dequantize
from ftkit.vocab import BLOCK_FORMATS, SLOT_ALIGN, ExpertLayout, stored_shape

from ..checkpoint.base import CheckpointError, TensorRef, read_ref
from ..checkpoint.jsonfile import read_object
from ..checkpoint.safetensors import parse_file
from .manifest import MANIFEST, Bank, FTWError, Manifest
from .writer import sha256_file

CHUNK = 16 << 20  # bytes per positional read
def _dense(ref: TensorRef, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A dense tensor as the runtime takes it: GGUF blocks (FTW v3 keeps a GGUF's as stored)
    dequantized exactly to float32 and cast to `dtype` a slice at a time (what the loader would
    make of the float32 tensor, without it); other tensors as stored."""
    t = read_ref(ref)
    return dequantize(t, ref.dtype, dtype) if ref.dtype in BLOCK_FORMATS else t


def probe_odirect(path: Path) -> bool:
    """Whether this file's filesystem accepts O_DIRECT reads into an aligned buffer."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, SLOT_ALIGN)
        os.preadv(fd, [buf], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@dataclass
class HostBanks:
    """The host expert pool's bytes: one uint8 buffer per bank, in row order."""

    layout: ExpertLayout
    banks: list[Bank]
    buffers: list[torch.Tensor]
    pinned: bool = False
    seconds: float = 0.0
    method: str = ""
    _keep: list[object] = field(default_factory=list, repr=False)  # mmaps backing the buffers

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def slot(self, row: int) -> torch.Tensor:
        """The uint8 bytes of expert row `row` (a view: what a fill copies). Every bank but the
        last holds the same number of rows, so the bank is one division away."""
        per_bank = self.banks[0].rows
        b, i = divmod(row, per_bank)
        if row < 0 or b >= len(self.banks) or i >= self.banks[b].rows:
            raise IndexError(f"expert row {row} is not in any bank")
        s = self.layout.slot_bytes
        return self.buffers[b][i * s : (i + 1) * s]

    def parts(self, row: int) -> dict[str, torch.Tensor]:
        slot = self.slot(row)
        return {p.name: p.view(slot) for p in self.layout.for_row(row).parts}


class FTWModel:
    """An opened FTW directory; checks happen here, bytes move only when asked."""

    def __init__(self, path: Path, allow_stub: bool = False):
        """`allow_stub` accepts a header-only stub: every bank file present and empty (banks have
        no header, so that is what fetching each file's header gives) and the dense file cut
        after its header; `header_only` says so. Everything loading relies on is checked here:
        the manifest, every bank's exact size, and the dense file's header, which must match the
        manifest's dense index and cover its data region byte for byte."""
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise FTWError(f"{self.path}: no {MANIFEST}; not an FTW directory (convert it with ftw-convert)")
        self.manifest = Manifest.from_dict(read_object(mpath, FTWError), str(mpath))
        self.spec = self.manifest.spec
        self.layout = self.manifest.layout
        banks = [self.path / b.file for b in self.manifest.banks]
        empty_banks = allow_stub and all(f.is_file() and f.stat().st_size == 0 for f in banks)
        for b in self.manifest.banks:
            f = self.path / b.file
            want = b.rows * self.layout.slot_bytes
            if not empty_banks and (not f.is_file() or f.stat().st_size != want):
                have = f.stat().st_size if f.is_file() else "missing"
                raise FTWError(f"{f}: expected {want} bytes, found {have}; the FTW directory is incomplete")
        self.dense_refs, dense_stub = self._dense_index(allow_stub)
        self.header_only = empty_banks or dense_stub

    def _dense_index(self, allow_stub: bool) -> tuple[dict[str, TensorRef], bool]:
        """The dense file's tensors from its header, as the manifest lists them."""
        dense = self.manifest.dense
        try:
            refs, stub = parse_file(self.path / dense["file"], allow_stub)
        except CheckpointError as e:
            raise FTWError(f"{self.path}: {e}") from None
        listed = dense["tensors"]
        for name in sorted(listed.keys() - refs.keys()):
            raise FTWError(f"{self.path}: missing tensor: {name} (in {MANIFEST}, not in {dense['file']})")
        for name in sorted(refs.keys() - listed.keys()):
            raise FTWError(f"{self.path}: tensor {name} of {dense['file']} is not in {MANIFEST}")
        for name, ref in refs.items():
            dtype, shape = listed[name]["dtype"], tuple(listed[name]["shape"])
            if dtype in BLOCK_FORMATS:  # stored as its bytes: read back as the blocks they are
                stored = ("uint8", stored_shape(dtype, shape))
                ref = refs[name] = replace(ref, dtype=dtype, shape=shape) if (ref.dtype, ref.shape) == stored else ref
            if (ref.dtype, ref.shape) != (dtype, shape):
                raise FTWError(f"{self.path}: dense tensor {name} is {ref.dtype}{list(ref.shape)} in "
                               f"{dense['file']}, {dtype}{list(shape)} in the manifest")
        return refs, stub

    # ---- dense ----------------------------------------------------------------------------
    def dense_tensors(self, blocks: Collection[str] = (),
                      dtype: Callable[[str], torch.dtype] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every dense tensor in turn, read through the index checked at open
        (the dense file is read by the same reader that checked it, so what opened loads). Those
        named in `blocks` that are GGUF blocks come as stored (uint8 rows, `dense_refs` gives the
        format), the other blocks dequantized to float32, or to `dtype(name)` where given: one at
        a time, so a loader casting each as it comes holds one tensor's values, not all of them."""
        if self.header_only:
            raise FTWError(f"{self.path}: header-only stub: no dense tensor data")
        for name, ref in self.dense_refs.items():
            raw = name in blocks and ref.dtype in BLOCK_FORMATS
            yield name, read_ref(ref) if raw else _dense(ref, dtype(name) if dtype else torch.float32)

    def dense_state(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Every dense tensor (`dense_tensors`, blocks dequantized) at once on `device`."""
        return {name: t.to(device) for name, t in self.dense_tensors()}

    # ---- experts --------------------------------------------------------------------------
    def read_banks(
        self,
        threads: int = 8,
        pin: bool | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> HostBanks:
        """All expert banks into host memory. `pin=None` pins when CUDA is available."""
        pin = torch.cuda.is_available() if pin is None else pin
        t0 = time.perf_counter()
        files = [self.path / b.file for b in self.manifest.banks]
        direct = bool(files) and probe_odirect(files[0])
        out = HostBanks(self.layout, self.manifest.banks, [], method="O_DIRECT" if direct else "mmap")
        pinner = _Pinner() if pin else None
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            for f in files:
                size = f.stat().st_size
                dst = mmap.mmap(-1, size) if size else None  # page-aligned, committed as written
                out._keep.append(dst)
                buf = torch.frombuffer(dst, dtype=torch.uint8) if dst else torch.empty(0, dtype=torch.uint8)
                jobs = [pool.submit(_read_range, f, dst, off, min(CHUNK, size - off), direct, progress)
                        for off in range(0, size, CHUNK)]
                out.buffers.append(buf)
                if pinner:
                    pinner.after(jobs, out, len(out.buffers) - 1)
                else:
                    for j in jobs:
                        j.result()
        if pinner:
            pinner.join()
            out.pinned = True
            if pinner.copied:
                out.method += f" (copied to pinned memory: cudaHostRegister returned {pinner.copied})"
            # Unregister before the mappings go away, or a later mapping at the same address
            # cannot be registered.
            weakref.finalize(out, _unregister, pinner.registered, list(out._keep))
        out.seconds = time.perf_counter() - t0
        return out

    def verify(self, progress: Callable[[str], None] | None = None) -> list[str]:
        """Check every checksum; returns the problems found (empty when all match)."""
        m = self.manifest
        todo = [(b.file, b.sha256) for b in m.banks] + [(m.dense["file"], m.dense["sha256"])]
        todo += sorted(m.files.items())
        problems = []
        for rel, want in todo:
            if progress:
                progress(rel)
            f = self.path / rel
            if not f.is_file():
                problems.append(f"{rel}: missing")
            elif sha256_file(f) != want:
                problems.append(f"{rel}: checksum mismatch (corrupt or modified)")
        return problems


def _read_range(path: Path, dst: mmap.mmap, off: int, n: int, direct: bool,
                progress: Callable[[int], None] | None) -> None:
    """Copy bytes [off, off+n) of `path` into `dst` at the same offset (positional, GIL-free)."""
    if direct:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            view = memoryview(dst)
            done = 0
            while done < n:
                got = os.preadv(fd, [view[off + done : off + n]], off + done)
                if got <= 0:
                    raise FTWError(f"{path}: unexpected end of file at byte {off + done}")
                done += got
        finally:
            os.close(fd)
    else:
        with open(path, "rb") as f:
            # Map just this chunk, pre-faulted in one call: far fewer faults than touching pages.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            src = mmap.mmap(f.fileno(), n, flags=flags, prot=mmap.PROT_READ, offset=off)
            try:
                np.copyto(np.frombuffer(dst, np.uint8, n, off), np.frombuffer(src, np.uint8, n))
            finally:
                src.close()
    if progress:
        progress(n)


class _Pinner:
    """Page-locks each bank on one background thread as soon as its reads are done, so
    registration (driver-serialised) overlaps the remaining reads. Where registering is refused
    (some sandboxes), the bank is copied into freshly allocated pinned memory instead."""

    def __init__(self):
        self.items: list[tuple[list, HostBanks, int]] = []
        self.registered: list[int] = []  # data pointers to unregister on release
        self.copied: str = ""  # the error that forced copying, if any
        self.cond = threading.Condition()
        self.closed = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def after(self, jobs: list, banks: HostBanks, index: int) -> None:
        with self.cond:
            self.items.append((jobs, banks, index))
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.items and not self.closed:
                    self.cond.wait()
                if not self.items:
                    return
                jobs, banks, index = self.items.pop(0)
            try:
                for j in jobs:
                    j.result()
                self._pin(banks, index)
            except BaseException as e:  # surfaced by join()
                self.error = self.error or e

    def _pin(self, banks: HostBanks, index: int) -> None:
        buf = banks.buffers[index]
        if not buf.numel():
            return
        if not self.copied:
            # portable | mapped: graph decode reads slots straight from here (zero-copy fills)
            err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 3)
            code = int(getattr(err, "value", err))
            if code == 0:
                self.registered.append(buf.data_ptr())
                return
            self.copied = f"error {code}"
        pinned = torch.empty(buf.numel(), dtype=torch.uint8, pin_memory=True)
        pinned.copy_(buf)
        banks.buffers[index] = pinned
        banks._keep[index] = None  # the read buffer is no longer needed

    def join(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join()
        if self.error:
            raise self.error


def _unregister(pointers: list[int], keep_alive: list[object]) -> None:
    for ptr in pointers:
        torch.cuda.cudart().cudaHostUnregister(ptr)
