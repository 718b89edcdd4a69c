"""Hugging Face checkpoint directories: `model.safetensors` or a sharded index, from headers."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from ftkit.vocab import stored_nbytes

from .base import CheckpointError, TensorRef, read_ref

ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
MAX_HEADER = 256 << 20  # a 700B model's header is a few MB; anything near this is corrupt
INDEX = "model.safetensors.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ftwb")
SKIP_DIRS = {".git", ".cache", "__pycache__"}


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the absolute offset where its data starts."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path.name}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                f"{path.name}: safetensors header length {n} points past the file ({size} bytes)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path.name}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: safetensors header is not a JSON object")
    return header, 8 + n


def parse_file(path: Path, allow_stub: bool) -> tuple[dict[str, TensorRef], bool]:
    """Tensor refs of one safetensors file, validated against its size; and whether it is a stub."""
    header, data_start = read_header(path)
    size = path.stat().st_size
    stub = size == data_start and any(k != "__metadata__" for k in header)
    if stub and not allow_stub:
        raise CheckpointError(f"{path.name}: header-only stub (no tensor data)")
    refs: dict[str, TensorRef] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            st_dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{path.name}: malformed header entry for tensor {name}") from None
        if st_dtype not in ST_DTYPES:
            raise CheckpointError(f"{path.name}: unsupported safetensors dtype {st_dtype} for tensor {name}")
        dtype = ST_DTYPES[st_dtype]
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not 0 <= begin <= end:
            raise CheckpointError(f"{path.name}: malformed shape or offsets for tensor {name}")
        if end - begin != stored_nbytes(dtype, shape):
            raise CheckpointError(
                f"{path.name}: tensor {name} has {end - begin} bytes, but {st_dtype}{list(shape)} needs "
                f"{stored_nbytes(dtype, shape)}"
            )
        if not stub and data_start + end > size:
            raise CheckpointError(
                f"{path.name}: tensor {name} ends at byte {data_start + end}, past the end of the "
                f"file ({size} bytes): truncated or corrupt"
            )
        refs[name] = TensorRef(name, dtype, shape, path, data_start + begin, end - begin)
    return refs, stub


def find_config(root: Path) -> Path:
    """`config.json` at the root, else the shallowest nested one that names a model."""
    top = root / "config.json"
    if top.is_file():
        return top
    for cand in sorted(root.rglob("config.json"), key=lambda p: (len(p.parts), str(p))):
        if SKIP_DIRS.intersection(cand.relative_to(root).parts):
            continue
        try:
            cfg = json.loads(cand.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(cfg, dict) and ("architectures" in cfg or "model_type" in cfg):
            return cand
    raise CheckpointError(f"{root}: no config.json found (looked at the top and in subdirectories)")


class SafetensorsSource:
    """An HF model directory: config plus one or several safetensors files."""

    kind = "safetensors"

    def __init__(self, root: Path, allow_stub: bool = True):
        self.path = root
        self.metadata: dict[str, Any] = {}
        self.config_path = find_config(root)
        try:
            self.config = json.loads(self.config_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{self.config_path}: not valid JSON ({e})") from None
        self.files = self._weight_files(root)
        self.tensors: dict[str, TensorRef] = {}
        stubs = []
        for f in self.files:
            refs, stub = parse_file(f, allow_stub)
            stubs.append(stub)
            for name in refs.keys() & self.tensors.keys():
                raise CheckpointError(f"tensor {name} appears in both {self.tensors[name].path.name} and {f.name}")
            self.tensors.update(refs)
        self.header_only = any(stubs)

    @staticmethod
    def _weight_files(root: Path) -> list[Path]:
        index = root / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index.name}: not a valid safetensors index") from None
            files = [root / f for f in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"missing shard(s) named in {INDEX}: {', '.join(missing)}")
            return files
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{root}: no model.safetensors, no {INDEX}, no *.safetensors files")
        return files

    def read(self, name: str) -> torch.Tensor:
        return read_ref(self.tensors[name])

    def side_files(self) -> list[tuple[Path, str]]:
        out = []
        for p in sorted(self.path.rglob("*")):
            rel = p.relative_to(self.path)
            if not p.is_file() or SKIP_DIRS.intersection(rel.parts) or p.name == INDEX:
                continue
            if p.suffix in WEIGHT_SUFFIXES:
                continue
            out.append((p, str(rel)))
        return out
