"""What every checkpoint source offers: a tensor index from headers, and positional reads.

A source never reads tensor data until `read` is called, so `ft-diagnose` can work on
header-only stubs and the converter can stream one tensor at a time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol

from ftkit.errors import InputError
from ftkit.vocab import storage_dtype, stored_shape

if TYPE_CHECKING:
    import torch


class CheckpointError(InputError):
    """A checkpoint cannot be used; the message is one line a user can act on."""


def inside(name: Any) -> bool:
    """Whether a file name read from an index or a manifest stays inside its directory: a
    relative path without `..`, backslashes or NUL (an absolute one would escape it)."""
    if type(name) is not str or not name or "\\" in name or "\0" in name or name.startswith("/"):
        return False
    return ".." not in PurePosixPath(name).parts


@dataclass(frozen=True)
class TensorRef:
    """One stored tensor, located from headers alone."""

    name: str  # as stored in the checkpoint
    dtype: str  # a weight format of ftkit.vocab.FORMATS
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
    import torch

    data = pread_exact(ref.path, ref.offset, ref.nbytes)
    dt = storage_dtype(ref.dtype)
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
