"""CPU expert kernels: SwiGLU experts computed straight from host-pool slots at DRAM speed.

`experts.cpp` is compiled at first use with the system C++ compiler (`$CXX`, default g++) and
`-O3 -march=native -fopenmp`, cached under `$XDG_CACHE_HOME/ftkit/kernels/` keyed by source,
flags, compiler and CPU, and loaded with ctypes: a plain C ABI with raw pointers needs neither
ninja nor pybind, and ctypes releases the GIL for the call. OpenMP keeps its worker threads alive
between calls, so the pool is persistent.

`load()` returns None when no compiler is available or the build fails (warned once), or when
`FTKIT_CPU_KERNEL=torch`; callers then use the pure-torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ftkit.runtime.ftw.manifest import SlotLayout

SOURCE = Path(__file__).with_name("experts.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC")
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "q8_0": 3}

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ftkit" / "kernels"


def _cpu_signature() -> str:
    """What -march=native depends on: a cache shared between machines must not mix builds."""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + flags


def build(cxx: str | None = None) -> Path:
    """Compile experts.cpp (once per source, flags, compiler and CPU); returns the shared library."""
    cxx = cxx or os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not found; set CXX)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode() + _cpu_signature().encode()
    ).hexdigest()[:16]
    lib = cache_dir() / f"experts-{key}.so"
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)  # concurrent builds: last rename wins
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{cxx} failed:\n{done.stderr.strip()}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


class Kernel:
    """The loaded library. All tensors must be contiguous CPU tensors."""

    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))  # CDLL, not PyDLL: the GIL is released during calls
        self.lib.ftk_isa.restype = ctypes.c_char_p
        self.lib.ftk_experts.restype = ctypes.c_int
        self.lib.ftk_experts.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, _ptr, ctypes.c_int, _ptr,
                                         _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int]
        self.lib.ftk_read.restype = ctypes.c_double
        self.lib.ftk_worker_start.restype = _ptr
        self.lib.ftk_worker_start.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, _ptr, _i64, _ptr, ctypes.c_int,
                                              _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int]
        self.lib.ftk_worker_stop.argtypes = [_ptr]
        self.lib.ftk_read.argtypes = [_ptr, _i64, ctypes.c_int]
        self.isa: str = self.lib.ftk_isa().decode()

    def experts(self, layout: SlotLayout, slots: Sequence[torch.Tensor], assignments: Sequence[torch.Tensor],
                x: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, k: int, threads: int) -> None:
        """For each expert (its uint8 slot) and its flat assignments `a` (token * k + j):
        out[a] = weights[a] * expert(x[a // k]). float32 `x` [T, H], `weights` [T * k] and
        `out` [T * k, H]; rows of `out` no assignment names are left untouched."""
        inter, hidden = layout.parts[0].shape  # gate [I, H]
        if x.dtype != torch.float32 or out.dtype != torch.float32 or x.shape[-1] != hidden:
            raise ValueError(f"the CPU kernel takes float32 x [T, {hidden}] and out, got {x.dtype} {tuple(x.shape)}")
        for t in (x, out, *slots):
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("the CPU kernel needs contiguous CPU tensors")
        if not slots:
            return
        a = torch.cat(list(assignments)).to(torch.int64)
        lo, hi = torch.aminmax(a) if a.numel() else (0, 0)
        if lo < 0 or hi >= out.shape[0] or hi // k >= x.shape[0]:
            raise ValueError("an assignment index is out of range")
        start = [0]
        for s in assignments:
            start.append(start[-1] + len(s))
        starts = torch.tensor(start, dtype=torch.int64)
        tok = a // k
        w = weights.reshape(-1)[a].to(torch.float32).contiguous()
        ptrs = torch.tensor([s.data_ptr() for s in slots], dtype=torch.int64)
        offsets = torch.tensor([p.offset for p in layout.parts], dtype=torch.int64)
        rc = self.lib.ftk_experts(DTYPE_CODES[layout.dtype], hidden, inter, offsets.data_ptr(), len(slots),
                                  ptrs.data_ptr(), starts.data_ptr(), tok.data_ptr(), w.data_ptr(), a.data_ptr(),
                                  x.data_ptr(), out.data_ptr(), threads)
        if rc:
            raise ValueError(f"the CPU kernel does not support expert dtype {layout.dtype}")

    def start_worker(self, layout: SlotLayout, row_ptrs: torch.Tensor, k: int, ctrl: torch.Tensor,
                     payload: torch.Tensor, out: torch.Tensor, busy_ns: torch.Tensor, threads: int) -> Worker:
        """Start the doorbell worker of device-driven decode (see `Worker` in experts.cpp).
        row_ptrs: int64 host address of every expert row; ctrl: int32 control block (bell at
        word 0, done at word 16); payload: float32 [H + 3k]; out: float32 [k, H]; busy_ns: int64
        [2] (compute time and count of the layers that had CPU items). All are host tensors that must outlive the worker."""
        inter, hidden = layout.parts[0].shape
        if payload.numel() != hidden + 3 * k or out.shape != (k, hidden) or ctrl.numel() < 32 or busy_ns.numel() < 2:
            raise ValueError("worker buffers do not match the layout")
        offsets = torch.tensor([p.offset for p in layout.parts], dtype=torch.int64)
        handle = self.lib.ftk_worker_start(
            DTYPE_CODES[layout.dtype], hidden, inter, offsets.data_ptr(), row_ptrs.numel(), row_ptrs.data_ptr(), k,
            ctrl.data_ptr(), ctrl.data_ptr() + 16 * 4, payload.data_ptr(), out.data_ptr(), busy_ns.data_ptr(), threads)
        return Worker(self.lib, handle, (row_ptrs, ctrl, payload, out, busy_ns))

    def read(self, buf: torch.Tensor, threads: int) -> float:
        """Read all of `buf` (contiguous, nbytes a multiple of 64) with `threads` threads."""
        if buf.nbytes % 64 or not buf.is_contiguous():
            raise ValueError("read() needs a contiguous buffer of a multiple of 64 bytes")
        return self.lib.ftk_read(buf.data_ptr(), buf.nbytes, threads)


class Worker:
    """A running doorbell worker; `stop()` joins its thread (idempotent)."""

    def __init__(self, lib: ctypes.CDLL, handle: int, keep: tuple):
        self.lib, self.handle, self._keep = lib, handle, keep

    def stop(self) -> None:
        if self.handle:
            self.lib.ftk_worker_stop(self.handle)
            self.handle = None

    def __del__(self) -> None:
        self.stop()


@functools.cache
def load() -> Kernel | None:
    """The compiled kernel, or None (with one warning) when it cannot be built here."""
    if os.environ.get("FTKIT_CPU_KERNEL") == "torch":
        return None
    # libgomp reads this when the library loads. Its default lets the team fall asleep within a
    # fraction of a millisecond, and decode calls the kernel once per layer, some layers apart:
    # waking 15 threads from futexes then cost more than their expert. Spin ~0.1 s, then sleep.
    os.environ.setdefault("GOMP_SPINCOUNT", "20000000")
    try:
        return Kernel(build())
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        warnings.warn(f"ftkit: CPU expert kernel unavailable, using the torch path ({e})", RuntimeWarning,
                      stacklevel=2)
        return None
