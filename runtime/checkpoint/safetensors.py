"""Hugging Face checkpoint directories: `model.safetensors` or a sharded index, from headers."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftkit.errors import shown
from ftkit.vocab import stored_nbytes

from .base import CheckpointError, TensorRef, inside, read_ref
from .jsonfile import parse_json, read_json, read_object, type_name

if TYPE_CHECKING:
    import torch

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
    "F8_E4M3": "float8_e4m3fn",
}
MAX_HEADER = 256 << 20  # a 700B model's header is a few MB; anything near this is corrupt
MAX_DIMS = 8  # tensors here have at most 3; a longer shape is corruption
MAX_DATA = 1 << 50  # bytes a header may place tensors in (a petabyte): bounds a stub's offsets
INDEX = "model.safetensors.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ftwb")
SKIP_DIRS = {".git", ".cache", "__pycache__"}


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the absolute offset where its data starts."""
    try:
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
    except OSError as e:
        raise CheckpointError(f"{path.name}: cannot read: {e.strerror or e}") from None
    header = parse_json(raw, path.name, CheckpointError, "safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: safetensors header is not a JSON object")
    return header, 8 + n


def _is_count(v: Any) -> bool:
    """A size or offset: an int no larger than a header may place data (so products of sizes
    stay numbers a message can print)."""
    return type(v) is int and 0 <= v <= MAX_DATA


def _entry(path: Path, name: str, info: Any) -> tuple[str, tuple[int, ...], int, int]:
    """(our dtype, shape, begin, end) of one header entry, every field type- and range-checked."""
    where = f"{path.name}: tensor {name}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(f"{where}: malformed header entry (needs dtype, shape and data_offsets)")
    st_dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if type(st_dtype) is not str or st_dtype not in ST_DTYPES:
        raise CheckpointError(f"{where}: unsupported safetensors dtype {shown(st_dtype)}")
    if type(shape) is not list or len(shape) > MAX_DIMS or not all(map(_is_count, shape)):
        raise CheckpointError(f"{where}: shape {shown(shape)} is not a list of at most {MAX_DIMS} sizes")
    if type(offsets) is not list or len(offsets) != 2 or not all(map(_is_count, offsets)):
        raise CheckpointError(f"{where}: data_offsets {shown(offsets)} is not a pair of byte offsets")
    begin, end = offsets
    if begin > end:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] are not an ascending byte range")
    dtype, shape = ST_DTYPES[st_dtype], tuple(shape)
    want = stored_nbytes(dtype, shape)
    if end - begin != want:
        raise CheckpointError(
            f"{where} has {end - begin} bytes, but {st_dtype}{list(shape)} needs {want}"
        )
    return dtype, shape, begin, end


def _check_coverage(path: Path, spans: list[tuple[int, int, str]], data_len: int | None) -> None:
    """The tensors tile the data region exactly, as the format requires: no gap, no overlap, and
    (`data_len`, when there is data) no byte before or after them."""
    at, last = 0, None
    for begin, end, name in sorted(spans):
        if begin != at:
            how = "overlaps" if begin < at else "leaves a gap before"
            after = f" {last}" if last is not None else " the start of the data"
            raise CheckpointError(f"{path.name}: tensor {name} {how}{after} (offset {begin}, expected {at})")
        at, last = end, name
    if data_len is not None and at != data_len:
        raise CheckpointError(
            f"{path.name}: {data_len - at} bytes after the last tensor (data ends at {at}, the file at "
            f"{data_len}): appended to or corrupt"
        )


def parse_file(path: Path, allow_stub: bool) -> tuple[dict[str, TensorRef], bool]:
    """Tensor refs of one safetensors file, validated against its size; and whether it is a stub.

    The tensors must cover the data region byte for byte, as safetensors itself demands; a stub
    (the file cut right after its header) is checked the same way on its offsets alone."""
    header, data_start = read_header(path)
    size = path.stat().st_size
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(type(v) is str for v in meta.values()):
        raise CheckpointError(f"{path.name}: __metadata__ is {type_name(meta)}, not an object of strings")
    stub = size == data_start and any(k != "__metadata__" for k in header)
    if stub and not allow_stub:
        raise CheckpointError(f"{path.name}: header-only stub (no tensor data)")
    refs: dict[str, TensorRef] = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(path, name, info)
        if not stub and data_start + end > size:
            raise CheckpointError(
                f"{path.name}: tensor {name} ends at byte {data_start + end}, past the end of the "
                f"file ({size} bytes): truncated or corrupt"
            )
        spans.append((begin, end, name))
        refs[name] = TensorRef(name, dtype, shape, path, data_start + begin, end - begin)
    _check_coverage(path, spans, None if stub else size - data_start)
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
            cfg = read_json(cand, CheckpointError)
        except CheckpointError:
            continue
        if isinstance(cfg, dict) and ("architectures" in cfg or "model_type" in cfg):
            return cand
    raise CheckpointError(f"{root}: no config.json found (looked at the top and in subdirectories)")


def read_config(root: Path) -> tuple[Path, dict[str, Any]]:
    """Where a checkpoint directory's config is and what it says (a JSON object)."""
    path = find_config(root)
    return path, read_object(path, CheckpointError)


def _shard_name(index: Path, name: Any) -> str:
    if not inside(name):
        raise CheckpointError(f"{index.name}: weight_map names {shown(name)}, not a file inside the directory")
    return name


@dataclass(frozen=True)
class MXFP4Ref(TensorRef):
    """HF's MXFP4 pair `X_blocks` [..., G, 16] + `X_scales` [..., G] (uint8 both, as gpt-oss
    ships its experts) as one mxfp4 tensor [..., G * 32] named `X_blocks`: `read` gives ggml's
    mxfp4 rows (kernels/dequant.py, `mxfp4_rows_from_hf`). The fields locate the blocks."""

    scales: TensorRef | None = None


def pair_mxfp4(tensors: dict[str, TensorRef]) -> dict[str, TensorRef]:
    """`tensors` with every `X_blocks`/`X_scales` pair replaced by one MXFP4Ref (see there)."""
    out = dict(tensors)
    for name, blocks in tensors.items():
        if not name.endswith("_blocks"):
            continue
        scales = out.pop(name.removesuffix("_blocks") + "_scales", None)
        if scales is None:
            raise CheckpointError(f"MXFP4 tensor {name} has no {name.removesuffix('_blocks')}_scales")
        if (blocks.dtype, scales.dtype) != ("uint8", "uint8") or blocks.shape[-1:] != (16,) \
                or blocks.shape[:-1] != scales.shape:
            raise CheckpointError(f"MXFP4 tensor {name}: blocks {blocks.dtype}{list(blocks.shape)} and scales "
                                  f"{scales.dtype}{list(scales.shape)} are not uint8 [..., G, 16] and [..., G]")
        out[name] = MXFP4Ref(name, "mxfp4", (*scales.shape[:-1], scales.shape[-1] * 32), blocks.path, blocks.offset,
                             blocks.nbytes + scales.nbytes, scales)
    return out


@dataclass(frozen=True)
class FP8Ref(TensorRef):
    """A block-scaled FP8 weight (`X.weight` float8_e4m3fn [rows, cols] with `X.weight_scale_inv`
    float32 [ceil(rows / b0), ceil(cols / b1)], DeepSeek's checkpoints) as the bfloat16 tensor
    `read` gives: dequantized (kernels/dequant.py, `fp8_block_dequant`), since no slot or dense
    tensor keeps FP8. The fields locate the FP8 bytes; `nbytes` counts the scales too."""

    scales: TensorRef | None = None
    block: tuple[int, int] = (128, 128)


FP8_NOTE = "FP8 weights (e4m3, block-scaled) are dequantized to bfloat16 (the CPU kernel has no FP8 format)"


def fp8_block(config: dict[str, Any]) -> tuple[int, int]:
    """The [rows, cols] of one scale block (`weight_block_size`, DeepSeek's 128 x 128 when absent)."""
    size = config["quantization_config"].get("weight_block_size", [128, 128])
    if type(size) is not list or len(size) != 2 or not all(type(b) is int and 0 < b <= 1 << 16 for b in size):
        raise CheckpointError(f"quantization_config weight_block_size is {shown(size)}, not two block sizes")
    return size[0], size[1]


def pair_fp8(tensors: dict[str, TensorRef], block: tuple[int, int]) -> dict[str, TensorRef]:
    """`tensors` with every FP8 weight and its `_scale_inv` replaced by one FP8Ref (see there)."""
    out = dict(tensors)
    for name, w in tensors.items():
        if w.dtype != "float8_e4m3fn":
            continue
        scales = out.pop(name + "_scale_inv", None)
        want = tuple(-(-d // b) for d, b in zip(w.shape, block, strict=False))
        if scales is None or len(w.shape) != 2 or scales.dtype != "float32" or scales.shape != want:
            got = f"{scales.dtype}{list(scales.shape)}" if scales else "none"
            raise CheckpointError(f"FP8 tensor {name} {list(w.shape)}: scale_inv is {got}, not float32 {list(want)} "
                                  f"(blocks of {block[0]} x {block[1]})")
        out[name] = FP8Ref(name, "bfloat16", w.shape, w.path, w.offset, w.nbytes + scales.nbytes, scales, block)
    return out


def quant_method(config: dict[str, Any]) -> Any:
    q = config.get("quantization_config")
    return q.get("quant_method") if isinstance(q, dict) else None


class SafetensorsSource:
    """An HF model directory: config plus one or several safetensors files."""

    kind = "safetensors"

    def __init__(self, root: Path, allow_stub: bool = True):
        self.path = root
        self.metadata: dict[str, Any] = {}
        self.config_path, self.config = read_config(root)
        self.files = self._weight_files(root)
        self.tensors: dict[str, TensorRef] = {}
        stubs = []
        for f in self.files:
            refs, stub = parse_file(f, allow_stub)
            stubs.append(stub)
            for name in refs.keys() & self.tensors.keys():
                raise CheckpointError(f"tensor {name} appears in both {self.tensors[name].path.name} and {f.name}")
            self.tensors.update(refs)
        # Lines to say when reading (ftw-convert prints them).
        self.notes: list[str] = []
        if quant_method(self.config) == "mxfp4":  # transformers' Mxfp4HfQuantizer checkpoints
            self.tensors = pair_mxfp4(self.tensors)
        elif quant_method(self.config) == "fp8":  # DeepSeek's block-scaled FP8
            self.tensors = pair_fp8(self.tensors, fp8_block(self.config))
            self.notes.append(FP8_NOTE)
        self.header_only = any(stubs)

    @staticmethod
    def _weight_files(root: Path) -> list[Path]:
        index = root / INDEX
        if index.is_file():
            weight_map = read_object(index, CheckpointError).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index.name}: not a valid safetensors index (weight_map is "
                                      f"{type_name(weight_map)}, not an object)")
            names: set[str] = set()
            for v in weight_map.values():  # one check per file, not per tensor
                if not (type(v) is str and v in names):
                    names.add(_shard_name(index, v))
            files = [root / f for f in sorted(names)]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"missing shard(s) named in {INDEX}: {', '.join(missing)}")
            return files
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{root}: no model.safetensors, no {INDEX}, no *.safetensors files")
        return files

    def read(self, name: str) -> torch.Tensor:
        ref = self.tensors[name]
        if isinstance(ref, MXFP4Ref):
            from ftkit.kernels.dequant import mxfp4_rows_from_hf  # torch: not on the header path

            blocks = read_ref(TensorRef(ref.name, "uint8", (*ref.scales.shape, 16), ref.path, ref.offset,
                                        ref.nbytes - ref.scales.nbytes))
            return mxfp4_rows_from_hf(blocks, read_ref(ref.scales))
        if isinstance(ref, FP8Ref):
            from ftkit.kernels.dequant import fp8_block_dequant  # torch: not on the header path

            weight = read_ref(TensorRef(ref.name, "float8_e4m3fn", ref.shape, ref.path, ref.offset,
                                        ref.nbytes - ref.scales.nbytes))
            return fp8_block_dequant(weight, read_ref(ref.scales), ref.block)
        return read_ref(ref)

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
