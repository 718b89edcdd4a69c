"""What every checkpoint source offers: a tensor index from headers, and positional reads.

A source never reads tensor data until `read` is called, so `ft-diagnose` can work on
header-only stubs and the converter can stream one tensor at a time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch


def one_line(message: str, limit: int = 400) -> str:
    """A message as one printable line: names read from a corrupt header can hold any bytes."""
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class CheckpointError(Exception):
    """A checkpoint cannot be used; the message is one line a user can act on."""

    def __init__(self, message: str):
        super().__init__(one_line(message))


# Stored dtypes we understand, by our name. `q8_0` is GGUF's block format: blocks of 32 weights
# along the last dimension, each an fp16 scale followed by 32 int8 values (34 bytes).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
Q8_0 = "q8_0"
Q8_0_BLOCK = 32
Q8_0_BLOCK_BYTES = 34


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in TORCH_DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


def stored_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this logical shape occupies in the stored dtype."""
    if dtype == Q8_0:
        if not shape or shape[-1] % Q8_0_BLOCK:
            raise ValueError(f"q8_0 needs a last dimension divisible by {Q8_0_BLOCK}, got {shape}")
        rows = 1
        for d in shape[:-1]:
            rows *= d
        return rows * (shape[-1] // Q8_0_BLOCK) * Q8_0_BLOCK_BYTES
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()


def stored_shape(dtype: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the tensor `read` returns: the logical shape, or raw q8_0 bytes per row."""
    if dtype == Q8_0:
        return (*shape[:-1], shape[-1] // Q8_0_BLOCK * Q8_0_BLOCK_BYTES)
    return tuple(shape)


def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Raw q8_0 rows `[..., nblocks * 34]` (uint8) to float32 `[..., nblocks * 32]` (exact)."""
    lead = raw.shape[:-1]
    blocks = raw.reshape(-1, Q8_0_BLOCK_BYTES)
    scale = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return (q * scale).reshape(*lead, -1)


@dataclass(frozen=True)
class TensorRef:
    """One stored tensor, located from headers alone."""

    name: str  # as stored in the checkpoint
    dtype: str  # a key of TORCH_DTYPES, or Q8_0
    shape: tuple[int, ...]  # logical element shape, torch order
    path: Path  # file that holds the bytes
    offset: int  # absolute byte offset of the data in that file
    nbytes: int  # stored bytes


def pread_exact(path: Path, offset: int, nbytes: int) -> bytearray:
    """Read exactly `nbytes` at `offset`; a short file is a clear error, not garbage."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise CheckpointError(
                    f"{path.name}: file ends at byte {offset + done}, expected data up to byte "
                    f"{offset + nbytes} (truncated or header-only file)"
                )
            done += n
    return buf


def read_ref(ref: TensorRef) -> torch.Tensor:
    """The stored bytes of `ref` as a tensor in its stored dtype and `stored_shape`."""
    data = pread_exact(ref.path, ref.offset, ref.nbytes)
    dt = torch.uint8 if ref.dtype == Q8_0 else TORCH_DTYPES[ref.dtype]
    t = torch.frombuffer(data, dtype=dt) if ref.nbytes else torch.empty(0, dtype=dt)
    return t.reshape(stored_shape(ref.dtype, ref.shape))


class Source(Protocol):
    """A checkpoint opened from its headers."""

    kind: str  # "safetensors" | "gguf"
    path: Path  # what the user named
    config: dict[str, Any]  # HF config.json (empty for GGUF)
    metadata: dict[str, Any]  # GGUF key/values (empty for safetensors)
    tensors: dict[str, TensorRef]  # by stored name
    header_only: bool  # True when the data sections are absent (a stub)

    def read(self, name: str) -> torch.Tensor: ...

    def side_files(self) -> list[tuple[Path, str]]:
        """Non-weight files to carry into FTW: (absolute path, relative destination)."""
        ...
