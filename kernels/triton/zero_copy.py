"""Device-driven fills and doorbells over mapped pinned host memory (Triton).

Decode and short extends decide hits, fills and the CPU set on the GPU, so nothing on the host
can issue the copies or start the CPU branch. Instead:
- fills are zero-copy reads of the host pool: its buffers are page-locked and mapped, a device
  table holds each row's address (`device_pointer`), and the grouped GEMV or GEMM (experts.py)
  reads a missed expert from there and writes it into its victim slot on the way. (Copies issued
  by the CPU worker to a copy engine, with the GEMV spinning until they land, were tried: a
  copy can queue behind host-to-device copies issued before it, as `pull` says, or behind the
  compute stream's own queue, and so behind the spinning kernel itself; one hung on an H100
  host. The GPU only ever spins on words the CPU writes.)
- `ring` writes a doorbell word the CPU worker polls, `wait_done` spins until the worker writes
  the matching word back; both do nothing in a layer that gives the CPU no items. Kernel
  boundaries order these against the payload written before (and read after) them. Between the
  two the GPU runs the layer's device work; on CUDA both read the GPU clock, so `wait_done` can
  add that time to a mapped counter the host reads without a sync: with the worker's own busy
  time it says which side of the split finished last.
Every launch has a fixed shape and reads its work from device memory, so a decode step that
uses them can be captured in a CUDA graph.

With TRITON_INTERPRET=1 the same kernels run on CPU tensors, where a "device pointer" is a host
address: the tests exercise the whole device-side path without a GPU.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import triton
import triton.language as tl

from ftkit.kernels.triton import interpreting

BELL, DONE = 0, 16  # int32 words of the control block, on separate 64-byte lines
@triton.jit
def _now(TIMER: tl.constexpr):
    t = tl.zeros([], tl.int64)
    if TIMER:  # the interpreter has no GPU clock
        t = tl.extra.cuda.globaltimer()
    return t


@triton.jit
def _ring(ctrl_ptr, value, stamp_ptr, count_ptr, TIMER: tl.constexpr):
    if tl.load(count_ptr + 1) > 0:  # a layer that gives the CPU nothing does not wake it
        tl.store(stamp_ptr, _now(TIMER))
        tl.store(ctrl_ptr, value)


@triton.jit
def _spin(ctrl_ptr, value):
    while tl.load(ctrl_ptr, volatile=True) != value:
        pass
    tl.store(ctrl_ptr, 0)


@triton.jit
def _wait(ctrl_ptr, value, stamp_ptr, count_ptr, total_ptr, gpu_ns_ptr, TIMER: tl.constexpr):
    if tl.load(count_ptr + 1) > 0:  # rung (see `_ring`): wait, and time the device side against the CPU
        gpu = _now(TIMER) - tl.load(stamp_ptr)
        _spin(ctrl_ptr, value)
        # the totals are kept in device memory and only written to the mapped copy: a read of
        # mapped memory is a PCIe round trip (~1.5 us), a write is posted
        ns, layers = tl.load(total_ptr) + gpu, tl.load(total_ptr + 1) + 1
        tl.store(total_ptr, ns)
        tl.store(total_ptr + 1, layers)
        tl.store(gpu_ns_ptr, ns)
        tl.store(gpu_ns_ptr + 1, layers)


def ring(ctrl, value: int, stamp: torch.Tensor, count: torch.Tensor) -> None:
    """If count[1] (the layer's CPU items, int32 on the device) > 0, write `value` into the
    doorbell word (ctrl: the mapped int32 control block) and note the GPU clock in stamp (int64
    [1], device). Otherwise nothing: the worker's round trip (~20 us) is not paid for no work."""
    _ring[(1,)](ctrl, value, stamp, count, TIMER=not interpreting())


def wait_done(ctrl, value: int, stamp: torch.Tensor, count: torch.Tensor, total: torch.Tensor, gpu_ns) -> None:
    """If count[1] > 0 (`ring` rang): spin until the done word equals `value` and clear it, add
    the GPU time since `ring` to total[0] and 1 to total[1] (int64 [2], device) and copy both
    into gpu_ns (mapped int64 [2], read by the host without a sync)."""
    _wait[(1,)](ctrl, value, stamp, count, total, gpu_ns, TIMER=not interpreting())


@triton.jit
def _wait_word(ctrl_ptr, value):
    _spin(ctrl_ptr, value)


def wait_word(ctrl, value: int) -> None:
    """Spin until the mapped int32 word equals `value` and clear it: the stream's next work runs
    after whoever writes it (the host-planned CPU branch, `Runner` with a done word)."""
    _wait_word[(1,)](ctrl, value)


@triton.jit
def _pull(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


PULL_BLOCK = 1024


def pull(host: torch.Tensor, out: torch.Tensor) -> None:
    """Copy the page-locked host tensor into `out` (a device tensor of its dtype and size) by the
    SMs' own reads over PCIe, not by a copy engine. A copy-engine upload queues behind every
    host-to-device copy issued before it, on any stream: a layer-streamed prefill keeps the next
    layer's experts queued on its copy stream, and each layer's GEMM work list (260 KB at 4096
    tokens) waited ~5.7 ms for them (a q4km trace on an H100 host: the compute stream idle from
    the routing read-back to the end of the other stream's copies, every layer)."""
    n = host.numel()
    if n:
        src = Mapped(host) if out.is_cuda else host
        _pull[(triton.cdiv(n, PULL_BLOCK),)](src, out, n, BLOCK=PULL_BLOCK)


class Mapped:
    """A page-locked host tensor as Triton sees it on CUDA: its device address (the same bytes,
    reached over PCIe) and dtype."""

    def __init__(self, t: torch.Tensor, offset: int = 0):
        self.dtype, self._ptr = t.dtype, device_pointer(t.data_ptr()) + offset * t.element_size()

    def data_ptr(self) -> int:
        return self._ptr


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def device_pointer(host_ptr: int) -> int:
    """The device address of mapped page-locked host memory (raises if it is not mapped)."""
    out = ctypes.c_uint64()
    rc = _libcuda().cuPointerGetAttribute(ctypes.byref(out), 3, ctypes.c_uint64(host_ptr))  # ..._DEVICE_POINTER
    if rc:
        raise RuntimeError(f"host address {host_ptr:#x} is not mapped for the GPU (CUDA error {rc})")
    return out.value
