"""Checkpoint sources: HF safetensors directories (single or sharded) and GGUF files."""

from __future__ import annotations

from pathlib import Path

from .base import CheckpointError, Source, TensorRef

__all__ = ["CheckpointError", "Source", "TensorRef", "open_source"]


def open_source(path: Path, allow_stub: bool = True, strict_types: bool = True) -> Source:
    """Open a checkpoint from its headers: an HF directory or a GGUF file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_file():
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
        if magic == b"GGUF" or path.suffix == ".gguf":
            from .gguf import GGUFSource

            return GGUFSource(path, allow_stub=allow_stub, strict_types=strict_types)
        if path.suffix == ".safetensors":
            path = path.parent
        else:
            raise CheckpointError(f"{path}: not a GGUF file or a model directory")
    if (path / "manifest.json").is_file():
        raise CheckpointError(f"{path}: already an FTW directory")
    from .safetensors import SafetensorsSource

    return SafetensorsSource(path, allow_stub=allow_stub)
