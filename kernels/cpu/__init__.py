"""CPU expert kernels: SwiGLU experts (with biases and the clamped form where the slot layout
says) computed straight from host-pool slots at DRAM speed.

`experts.cpp` is compiled at first use with the system C++ compiler (`$CXX`, default g++) and
`-O3 -march=native -fopenmp`, cached under `$XDG_CACHE_HOME/ftkit/kernels/` keyed by source,
flags, compiler and CPU, and loaded with ctypes: a plain C ABI with raw pointers needs neither
ninja nor pybind, and ctypes releases the GIL for the call. OpenMP keeps its worker threads alive
between calls, so the pool is persistent; graph decode's doorbell worker runs on a team of its own
(`Team` in experts.cpp), which torch's libgomp cannot put to sleep between layers.

`load()` returns None when no compiler is available or the build fails (warned once), or when
`FTKIT_CPU_KERNEL=torch`; callers then use the pure-torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ftkit.vocab import BIAS_DTYPE, BIAS_PARTS, EXPERT_PARTS

if TYPE_CHECKING:
    from ftkit.vocab import ExpertLayout, SlotLayout


def format_code(layout: SlotLayout, int8: bool = False) -> int:
    """The format codes of gate, up and down as a call passes them: gate | up << 8 | down << 16
    (the bias parts are always float32: `_expert_fn`), with INT8 for the int8 path."""
    if any(f not in FORMAT_CODES for f in layout.formats):
        raise ValueError(f"the CPU kernel does not support expert dtype {layout.dtype}")
    return sum(FORMAT_CODES[f] << (8 * i) for i, f in enumerate(layout.formats)) | (INT8 if int8 else 0)


def int8_activations(dtype: torch.dtype) -> bool:
    """Whether a run computing in `dtype` takes the kernel's int8 path (int8_dots.h): activations
    quantized to int8 per 256 values where the part's format has it, as ggml's CPU backend
    multiplies. Only float32 runs keep exact products: they are the reference every other path
    is checked against."""
    return dtype != torch.float32

SOURCE = Path(__file__).with_name("experts.cpp")
HEADERS = ("int8_dots.h", "decode_attention.h")  # included by experts.cpp: part of the build's key
INT8 = 1 << 24  # experts.cpp's `INT8`
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC")
# experts.cpp's `Dtype` codes: every expert format has a kernel (GGUF blocks decoded as they are multiplied)
FORMAT_CODES = {name: i for i, name in enumerate((
    "float32", "float16", "bfloat16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k",
    "q6_k", "iq4_nl", "iq4_xs", "mxfp4"))}

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
Indices = torch.Tensor | np.ndarray  # int64 index arrays, CPU


def worker_payload(tokens: int, k: int, hidden: int) -> int:
    """Floats in a doorbell worker's payload: x [tokens, H]; per item (tokens * k) its weight,
    expert row, CPU flag and token; the valid item count."""
    return tokens * hidden + 4 * tokens * k + 1


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


def build(cxx: str | None = None, extra: tuple[str, ...] = (), source: Path = SOURCE) -> Path:
    """Compile `source` (experts.cpp; once per source, flags, compiler and CPU); returns the
    shared library. `extra`: flags after FLAGS (`-mno-avx512f` builds the AVX2 path on an
    AVX-512 machine)."""
    cxx = cxx or os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not found; set CXX)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        source.read_bytes() + b"".join(source.with_name(h).read_bytes() for h in HEADERS)
        + " ".join(FLAGS + extra).encode() + version.encode() + _cpu_signature().encode()
    ).hexdigest()[:16]
    lib = cache_dir() / f"{source.stem}-{key}.so"
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)  # concurrent builds: last rename wins
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, *extra, str(source), "-o", tmp], capture_output=True, text=True)
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
                                         _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int, _ptr]
        self.lib.ftk_read.restype = ctypes.c_double
        self.lib.ftk_worker_start.restype = _ptr
        self.lib.ftk_worker_start.argtypes = [ctypes.c_int, _ptr, ctypes.c_int, ctypes.c_int, _ptr, _i64, _ptr,
                                              ctypes.c_int, ctypes.c_int, ctypes.c_int, _ptr, _ptr, _ptr, _ptr, _ptr,
                                              ctypes.c_int, _ptr]
        self.lib.ftk_worker_stop.argtypes = [_ptr]
        self.lib.ftk_runner_start.restype = _ptr
        self.lib.ftk_runner_submit.argtypes = [_ptr, *self.lib.ftk_experts.argtypes, _ptr, _ptr, ctypes.c_int32]
        self.lib.ftk_take_front.restype = ctypes.c_int
        self.lib.ftk_take_front.argtypes = [_ptr]
        self.lib.ftk_runner_wait.restype = ctypes.c_int
        self.lib.ftk_runner_wait.argtypes = [_ptr, ctypes.POINTER(ctypes.c_int64)]
        self.lib.ftk_runner_stop.argtypes = [_ptr]
        self.lib.ftk_read.argtypes = [_ptr, _i64, ctypes.c_int]
        self.lib.ftk_linear.restype = ctypes.c_int
        self.lib.ftk_linear.argtypes = [ctypes.c_int, _ptr, ctypes.c_int, ctypes.c_int, _ptr, ctypes.c_int, _ptr,
                                        ctypes.c_int]
        self.lib.ftk_attention.restype = ctypes.c_int
        self.lib.ftk_attention.argtypes = [ctypes.c_int, _ptr, _ptr, _ptr, *[ctypes.c_int] * 6, *[_i64] * 4,
                                           ctypes.c_float, _ptr, ctypes.c_int]
        self.lib.ftk_peak.restype = ctypes.c_double
        self.lib.ftk_peak.argtypes = [ctypes.c_int, _i64, ctypes.c_int]
        self.isa: str = self.lib.ftk_isa().decode()

    def experts(self, layout: SlotLayout, slots: Sequence[torch.Tensor], assignments: Sequence[Indices],
                x: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, k: int, threads: int,
                out_rows: Indices | None = None, int8: bool = False) -> None:
        """For each expert (its uint8 slot) and its flat assignments `a` (token * k + j):
        out[a] = weights[a] * expert(x[a // k]). float32 `x` [T, H], `weights` [T * k] and
        `out` [T * k, H]; rows of `out` no assignment names are left untouched. `out_rows`: the
        row of `out` for each assignment in order instead (a compact `out` of just these rows).
        `int8`: the int8 path (`int8_activations`)."""
        self.run(self.prepare(layout, slots, assignments, x, weights, out, k, threads, out_rows, int8))

    def linear(self, raw: torch.Tensor, fmt: str, shape: tuple[int, int], x: torch.Tensor, threads: int,
               int8: bool = False) -> torch.Tensor:
        """x @ W.T, float32 [T, N], for x float32 [T, K] and W [N, K] stored as `fmt` rows (`raw`:
        uint8 [N, bytes a row], GGUF blocks as stored or a float's bytes), decoded where they
        are multiplied; `int8`: on int8 activations where the format has them (`int8_activations`)."""
        n, k = shape
        x = x.to(torch.float32).contiguous()
        if fmt not in FORMAT_CODES or x.dim() != 2 or x.shape[1] != k or not raw.is_contiguous():
            raise ValueError(f"the CPU kernel's linear takes float32 [T, {k}] and {fmt} rows, got {tuple(x.shape)}")
        out = torch.empty((x.shape[0], n), dtype=torch.float32)
        rc = self.lib.ftk_linear(FORMAT_CODES[fmt] | (INT8 if int8 else 0), raw.data_ptr(), n, k, x.data_ptr(),
                                 x.shape[0], out.data_ptr(), threads)
        if rc:
            raise ValueError(f"the CPU kernel cannot multiply {fmt} rows of {k} weights")
        return out

    def run(self, call: _Call | None) -> None:
        """One `experts` call from its `prepare`d arguments."""
        if call is not None and self.lib.ftk_experts(*call.args):
            raise ValueError(f"the CPU kernel does not support expert formats {call.formats}")

    def start_experts(self, runner: Runner, layout: SlotLayout, slots: Sequence[torch.Tensor],
                      assignments: Sequence[Indices], x: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                      k: int, threads: int, out_rows: Indices | None = None,
                      split: np.ndarray | None = None, done: tuple[int, int] | None = None,
                      int8: bool = False) -> None:
        """As `experts`, on the runner's native thread: returns at once; `runner.wait()` ends it.
        The caller keeps x, out and the slots alive until then. `split` (from `new_split`): the
        call shares its experts with the caller, who takes them from the front (`take_front`)
        while the call takes them from the back; it runs only those it takes. `done`: (address
        of an int32 word, value): the call writes the value there when its rows are written."""
        call = self.prepare(layout, slots, assignments, x, weights, out, k, threads, out_rows, int8)
        if call is not None:
            call.args += (None if split is None else split.ctypes.data, *(done or (None, 0)))
            if split is not None:
                call.keep += (split,)
        runner.submit(call)

    @staticmethod
    def new_split(n: int) -> np.ndarray:
        """A split of n experts shared by the caller and a runner call: front 0, back n (one
        int64 word, see `take` in experts.cpp)."""
        return np.array([n << 32], dtype=np.int64)

    def take_front(self, split: np.ndarray) -> int | None:
        """The caller's next expert of a shared split, or None once the runner has the rest.
        After the call ends, experts front.. (`split_front`) were the runner's."""
        i = self.lib.ftk_take_front(split.ctypes.data)
        return None if i < 0 else i

    @staticmethod
    def split_front(split: np.ndarray) -> int:
        """How many experts the caller took (read once the runner's call has ended)."""
        return int(split[0]) & 0xFFFFFFFF

    @staticmethod
    def split_left(split: np.ndarray) -> int:
        """Experts neither side has taken yet (a snapshot: the runner may take one meanwhile)."""
        v = int(split[0])
        return (v >> 32) - (v & 0xFFFFFFFF)

    def runner(self) -> Runner:
        return Runner(self.lib)

    @staticmethod
    def prepare(layout: SlotLayout, slots: Sequence[torch.Tensor], assignments: Sequence[Indices],
                x: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, k: int, threads: int,
                out_rows: Indices | None = None, int8: bool = False) -> _Call | None:
        """`experts`' checked arguments (None: nothing to do), which `run` may call as often as
        wanted on the tensors as they are then: a benchmark times the kernel alone, as the
        graph-decode worker runs it, without these checks (~70 us a call of 8 experts on the dev
        box). The index arithmetic is numpy: the store makes one call per layer, and torch's
        per-call overhead on arrays of a few hundred elements added up to a tenth of a
        millisecond there."""
        inter, hidden = layout.parts[0].shape  # gate [I, H]
        if x.dtype != torch.float32 or out.dtype != torch.float32 or x.shape[-1] != hidden:
            raise ValueError(f"the CPU kernel takes float32 x [T, {hidden}] and out, got {x.dtype} {tuple(x.shape)}")
        for t in (x, out, *slots):
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("the CPU kernel needs contiguous CPU tensors")
        code = format_code(layout, int8)
        if not slots:
            return None
        sizes = [len(s) for s in assignments]
        a = np.concatenate([np.asarray(s, dtype=np.int64) for s in assignments])
        if a.size and (a.min() < 0 or a.max() // k >= x.shape[0] or a.max() >= weights.numel()):
            raise ValueError("an assignment index is out of range")
        rows = a if out_rows is None else np.ascontiguousarray(out_rows, dtype=np.int64)
        if rows.shape != a.shape or (rows.size and (rows.min() < 0 or rows.max() >= out.shape[0])):
            raise ValueError("an output row is out of range")
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        tok = a // k
        flat = weights.reshape(-1)
        w = np.ascontiguousarray((flat if flat.dtype == torch.float32 else flat.float()).numpy()[a])
        ptrs = np.array([s.data_ptr() for s in slots], dtype=np.int64)
        offsets, clamp = _expert_fn(layout)
        keep = (rows, starts, tok, w, ptrs, offsets, clamp, x, out, *slots)
        return _Call("/".join(layout.formats), (code, hidden, inter, offsets.ctypes.data, len(slots), ptrs.ctypes.data,
                      starts.ctypes.data, tok.ctypes.data, w.ctypes.data, rows.ctypes.data, x.data_ptr(),
                      out.data_ptr(), threads, None if clamp is None else clamp.ctypes.data), keep)

    def start_worker(self, layouts: ExpertLayout, row_ptrs: torch.Tensor, tokens: int, k: int, ctrl: torch.Tensor,
                     payload: torch.Tensor, out: torch.Tensor, busy_ns: torch.Tensor, threads: int,
                     int8: bool = False) -> Worker:
        """Start the doorbell worker of device-planned layers (see `Worker` in experts.cpp), for
        up to `tokens` tokens of `k` routed items each (n = tokens * k items), each MoE layer in
        its own slot layout. row_ptrs: int64 host address of every expert row; ctrl: int32 control block (bell at
        word 0, done at word 16); payload: float32 [tokens * H + 4n + 1] (`worker_payload`);
        out: float32 [n, H]; busy_ns: int64 [4] (compute time and count of the layers that had
        CPU items: one-token layers, then multi-token ones). All are host tensors that must
        outlive the worker. `int8`: the int8 path (`int8_activations`)."""
        layout = layouts.layers[0]
        inter, hidden = layout.parts[0].shape
        n = tokens * k
        if (payload.numel() != worker_payload(tokens, k, hidden) or out.shape != (n, hidden) or ctrl.numel() < 32
                or busy_ns.numel() < 4):
            raise ValueError("worker buffers do not match the layout")
        codes = np.array([format_code(lay, int8) for lay in layouts.layers], dtype=np.int32)  # all copied by the worker
        offsets = np.concatenate([_expert_fn(lay)[0] for lay in layouts.layers])
        clamp = _expert_fn(layout)[1]
        handle = self.lib.ftk_worker_start(
            len(codes), codes.ctypes.data, hidden, inter, offsets.ctypes.data, row_ptrs.numel(), row_ptrs.data_ptr(),
            n, tokens, k, ctrl.data_ptr(), ctrl.data_ptr() + 16 * 4, payload.data_ptr(), out.data_ptr(),
            busy_ns.data_ptr(), threads, None if clamp is None else clamp.ctypes.data)
        return Worker(self.lib, handle, (row_ptrs, ctrl, payload, out, busy_ns))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: int, threads: int,
                  ) -> torch.Tensor | None:
        """One query's attention (a decode step): q [1, heads, D] over keys lo.. of k [S, kv_heads,
        D] and v [S, kv_heads, Dv] (float32, float16 or bfloat16 rows, each contiguous; query head
        h reads KV head h // (heads / kv_heads)), scores scaled by D ** -0.5, softmax in float32.
        Returns [1, heads, Dv] in q's dtype, or None for shapes the kernel does not take."""
        name = str(k.dtype).removeprefix("torch.")
        if (name not in ("float32", "float16", "bfloat16") or v.dtype != k.dtype or k.dim() != 3 or v.dim() != 3
                or k.stride(2) != 1 or v.stride(2) != 1 or k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]):
            return None
        heads, d = q.shape[1], q.shape[2]
        qf = q[0].to(torch.float32).contiguous()
        out = torch.empty((heads, v.shape[2]), dtype=torch.float32)
        rc = self.lib.ftk_attention(FORMAT_CODES[name], qf.data_ptr(), k.data_ptr(), v.data_ptr(), k.shape[0], lo, heads,
                                    k.shape[1], d, v.shape[2], k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                    d**-0.5, out.data_ptr(), threads)
        return None if rc else out.to(q.dtype).view(1, heads, -1)

    def peak_gflops(self, threads: int, int8: bool = False, seconds: float = 0.3) -> float | None:
        """The cores' peak in GFLOP/s (2 a multiply-add) from registers only, at `threads`
        threads: float32 FMAs, or with `int8` the int8 path's byte products (None where that
        path is not built). What the expert kernel's GFLOP/s are reported against."""
        iters = 1 << 12
        while True:  # grow the run until it takes `seconds` (the first rounds also wake the cores up)
            t0 = time.perf_counter()
            ops = self.lib.ftk_peak(int(int8), iters, threads)
            dt = time.perf_counter() - t0
            if not ops:
                return None
            if dt >= seconds:
                return ops / dt / 1e9
            iters *= 2 if dt < seconds / 8 else max(2, math.ceil(seconds / max(dt, 1e-6)))

    def read(self, buf: torch.Tensor, threads: int) -> float:
        """Read all of `buf` (contiguous, nbytes a multiple of 64) with `threads` threads."""
        if buf.nbytes % 64 or not buf.is_contiguous():
            raise ValueError("read() needs a contiguous buffer of a multiple of 64 bytes")
        return self.lib.ftk_read(buf.data_ptr(), buf.nbytes, threads)


def _expert_fn(layout: SlotLayout) -> tuple[np.ndarray, np.ndarray | None]:
    """What the kernel computes from a slot: the byte offsets of gate, up, down and of the
    float32 biases (-1 for none; `Call` in experts.cpp), and the clamped SwiGLU's (alpha,
    limit) or None for SwiGLU."""
    by_name = {p.name: p.offset for p in layout.parts}
    if layout.biased and any(p.dtype != BIAS_DTYPE for p in layout.parts if p.name in BIAS_PARTS):
        raise ValueError(f"the CPU kernel reads {BIAS_DTYPE} expert biases")
    offsets = np.array([by_name.get(n, -1) for n in (*EXPERT_PARTS, *BIAS_PARTS)], dtype=np.int64)
    act = layout.activation
    return offsets, None if act is None else np.array([act.alpha, act.limit], dtype=np.float32)


class _Call:
    """ftk_experts' arguments and the tensors they point into (alive while the call runs)."""

    def __init__(self, formats: str, args: tuple, keep: tuple):
        self.formats, self.args, self.keep = formats, args, keep


class Runner:
    """A persistent native thread running one `experts` call at a time (`ftk_runner_*` in
    experts.cpp): submit, go on with other work, `wait()`. Unlike a Python thread it needs no
    GIL to start, so a busy caller does not delay the CPU branch."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib, self.handle = lib, lib.ftk_runner_start()
        self._call: _Call | None = None
        self._busy = ctypes.c_int64()

    def submit(self, call: _Call | None) -> None:
        if self._call is not None:
            raise RuntimeError("the runner is busy: wait() for the previous call first")
        if call is not None:
            self._call = call
            self.lib.ftk_runner_submit(self.handle, *call.args)

    def wait(self) -> float | None:
        """Block until the submitted call is done; its compute time in seconds (None: none)."""
        if self._call is None:
            return None
        rc = self.lib.ftk_runner_wait(self.handle, ctypes.byref(self._busy))
        self._call = None
        if rc:
            raise ValueError("the CPU kernel does not support this expert dtype")
        return self._busy.value / 1e9

    def close(self) -> None:
        if self.handle:
            self.wait()
            self.lib.ftk_runner_stop(self.handle)
            self.handle = None

    def __del__(self) -> None:
        self.close()


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
    # Where torch ships its own libgomp.so.1 (its pip wheels), that one loaded with torch and
    # ours resolves to it, so this comes too late; graph decode's worker does not use OpenMP.
    os.environ.setdefault("GOMP_SPINCOUNT", "20000000")
    try:
        return Kernel(build())
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        warnings.warn(f"ftkit: CPU expert kernel unavailable, using the torch path ({e})", RuntimeWarning,
                      stacklevel=2)
        return None
