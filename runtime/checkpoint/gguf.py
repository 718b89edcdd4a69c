"""A GGUF checkpoint opened from its header alone.

We parse the header ourselves instead of using `gguf.GGUFReader`: that reader memory-maps and
walks the whole file, so it cannot open a header-only stub, and it offers no guard against a
corrupt header asking for gigabytes. Here every count and length is checked against what the
file can hold before anything is allocated, the header is read sequentially in small chunks, and
tensor data is touched only by `read`.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 KV count,
the KV pairs, the tensor infos, padding to `general.alignment`, then the data section. Tensor
offsets are relative to the data section; dims are ggml `ne` order (fastest first), so the
torch shape is the reverse.

A model split by llama.cpp's `llama-gguf-split` (large models on the hub come so, each file under
the hub's 50 GB) is opened from its first file: its metadata says `split.count`, its siblings
are named PREFIX-0000k-of-0000n.gguf, and each holds some of the tensors; the model's metadata
is the first file's.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import tempfile
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from ftkit.errors import shown
from ftkit.vocab import FORMATS, Q8_0, stored_nbytes

from .base import CheckpointError, TensorRef, read_ref

if TYPE_CHECKING:
    import torch

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# llama-gguf-split's file names (llama.cpp's llama_split_path): PREFIX-00001-of-00003.gguf
SPLIT_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")
READ_CHUNK = 64 * 1024  # header read size: bounds how far past the header end we ever read

# Caps against corrupt headers; far above anything a real model writes.
MAX_HEADER_BYTES = 256 * 1024 * 1024  # real headers are a few MB, mostly the vocabulary
MAX_KEY_LEN = 64 * 1024
MAX_STRING_LEN = 16 * 1024 * 1024  # chat templates are the longest strings, ~100 KB
MAX_ARRAY_LEN = 4 * 1024 * 1024  # vocabularies and merge lists are ~10^5 to 10^6 entries
MAX_ARRAY_DEPTH = 8
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 60

# ggml type ids (ggml.h; gguf-py/gguf/constants.py GGMLQuantizationType). Gaps are removed types.
# fmt: off
GGML_TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0",
}
# ggml types we read, by our dtype name: the plain ones, and the block formats people download
# (the legacy 32-weight quants, the K-quants, IQ4_NL/IQ4_XS and MXFP4), each our lower-case name.
SUPPORTED_TYPES: dict[int, str] = {
    0: "float32", 1: "float16", 30: "bfloat16",
    24: "int8", 25: "int16", 26: "int32", 27: "int64", 28: "float64",
    2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: Q8_0,
    10: "q2_k", 11: "q3_k", 12: "q4_k", 13: "q5_k", 14: "q6_k",
    20: "iq4_nl", 23: "iq4_xs", 39: "mxfp4",
}
# GGUF metadata value types: id -> (struct code, size) for the fixed-size ones.
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
    6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8),
}
# fmt: on
_MIN_VALUE_SIZE = {**{t: s for t, (_, s) in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}

# Metadata whose type the readers rely on, as llama.cpp's gguf constants declare it: what a
# value of the wrong type would otherwise break far from here. Model sizes are typed where a
# family reads them (runtime/models/config.py); these are the rest.
_UINT, _STR, _BOOL = "an unsigned integer", "a string", "a boolean"
_STRS, _INTS, _FLOATS = "an array of strings", "an array of integers", "an array of numbers"
_KEY_TYPES: dict[str, str] = {
    "general.architecture": _STR, "general.alignment": _UINT,
    "split.no": _UINT, "split.count": _UINT, "split.tensors.count": _UINT,
    "tokenizer.ggml.model": _STR, "tokenizer.ggml.pre": _STR, "tokenizer.chat_template": _STR,
    "tokenizer.ggml.tokens": _STRS, "tokenizer.ggml.merges": _STRS,
    "tokenizer.ggml.token_type": _INTS, "tokenizer.ggml.scores": _FLOATS,
    **{f"tokenizer.ggml.{t}_token_id": _UINT for t in ("bos", "eos", "unknown", "padding", "seperator")},
    **{f"tokenizer.ggml.{f}": _BOOL for f in ("add_bos_token", "add_eos_token", "add_space_prefix")},
}
_NAMED_TEMPLATE = "tokenizer.chat_template."  # named chat templates: strings too
_SCALAR_TYPE = {_UINT: int, _STR: str, _BOOL: bool}
_ELEMENT_TYPES = {_STRS: (str,), _INTS: (int,), _FLOATS: (int, float)}


def _has_type(value: Any, kind: str) -> bool:
    if kind in _ELEMENT_TYPES:  # an array holds one element type, so its first element tells
        return type(value) is list and (not value or type(value[0]) in _ELEMENT_TYPES[kind])
    return type(value) is _SCALAR_TYPE[kind] and not (kind == _UINT and value < 0)


def check_metadata(metadata: dict[str, Any], name: str) -> None:
    """Refuse metadata whose known keys have the wrong type (a token list of integers, a scalar
    token_type): CheckpointError naming the key."""
    for key, value in metadata.items():
        kind = _KEY_TYPES.get(key) or (_STR if key.startswith(_NAMED_TEMPLATE) else None)
        if kind is not None and not _has_type(value, kind):
            what = f"an array of {type(value[0]).__name__}" if type(value) is list and value else shown(value)
            raise CheckpointError(f"{name}: metadata {key} is {what}, not {kind}")


def ggml_type_name(type_id: int) -> str:
    return GGML_TYPE_NAMES.get(type_id, f"type {type_id}")


class _HeaderReader:
    """Sequential little-endian reads over a file, in chunks, tracking how far we read."""

    def __init__(self, f: BinaryIO, file_size: int, name: str):
        self.f = f
        self.file_size = file_size
        self.name = name
        self.buf = b""
        self.buf_start = 0  # file offset of buf[0]
        self.pos = 0  # file offset of the next byte to parse
        self.bytes_read_max = 0  # highest file offset fetched from disk

    def fail(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.name}: {msg}")

    def remaining(self) -> int:
        return self.file_size - self.pos

    def take(self, n: int, what: str) -> memoryview:
        if n > self.remaining():
            raise self.fail(
                f"truncated header: {what} needs {n} bytes at byte {self.pos}, "
                f"file has {self.file_size}"
            )
        end = self.pos + n
        if end > MAX_HEADER_BYTES:
            raise self.fail(f"header larger than {MAX_HEADER_BYTES} bytes (corrupt {what}?)")
        have = self.buf_start + len(self.buf)
        if end > have:
            # Keep the unparsed tail and fetch at least one chunk (or exactly what is missing).
            tail = self.buf[self.pos - self.buf_start :]
            self.f.seek(have)
            more = self.f.read(max(end - have, READ_CHUNK))
            if len(more) < end - have:
                raise self.fail(f"file shrank while reading its header at byte {have}")
            self.buf, self.buf_start = tail + more, self.pos
            self.bytes_read_max = max(self.bytes_read_max, have + len(more))
        start = self.pos - self.buf_start
        self.pos = end
        return memoryview(self.buf)[start : start + n]

    def scalar(self, code: str, size: int, what: str) -> Any:
        return struct.unpack("<" + code, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return self.scalar("I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("Q", 8, what)

    def string(self, what: str, limit: int = MAX_STRING_LEN) -> str:
        n = self.u64(f"{what} length")
        if n > limit:
            raise self.fail(f"{what}: string length {n} exceeds the limit of {limit} bytes")
        # surrogateescape keeps odd token bytes round-trippable instead of failing the file.
        return str(self.take(n, what), "utf-8", "surrogateescape")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(*_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise self.fail(f"{what}: unknown metadata value type {vtype}")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
        etype = self.u32(f"{what} element type")
        count = self.u64(f"{what} element count")
        if etype not in _MIN_VALUE_SIZE:
            raise self.fail(f"{what}: unknown array element type {etype}")
        if count > MAX_ARRAY_LEN or count * _MIN_VALUE_SIZE[etype] > self.remaining():
            raise self.fail(
                f"{what}: array of {count} elements cannot fit in the "
                f"{self.remaining()} bytes left in the file"
            )
        if etype in _SCALARS:
            code, size = _SCALARS[etype]
            return list(struct.unpack(f"<{count}{code}", self.take(count * size, what)))
        return [self.value(etype, what, depth + 1) for _ in range(count)]


_Info = tuple[str, list[int], int, int]  # a tensor's name, ggml dims, type id, data-relative offset


def _parse_header(r: _HeaderReader) -> tuple[int, dict[str, Any], list[_Info]]:
    """The version, metadata and tensor infos, read in order from the magic on."""
    magic = bytes(r.take(4, "magic")) if r.remaining() >= 4 else b""
    if magic != GGUF_MAGIC:
        raise r.fail(f"not a GGUF file (bad magic {shown(magic)}, expected {shown(GGUF_MAGIC)})")
    version = r.u32("version")
    if version not in SUPPORTED_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        hint = " (big-endian GGUF?)" if swapped in SUPPORTED_VERSIONS else ""
        raise r.fail(f"unsupported GGUF version {version}{hint}")
    n_tensors = r.u64("tensor count")
    n_kv = r.u64("metadata count")
    # Smallest encodings: KV = key length + value type + 1-byte value; tensor info = name
    # length + n_dims + type + offset. A count the file cannot hold is corruption.
    if n_kv * 13 > r.remaining() or n_tensors * 24 > r.remaining():
        raise r.fail(
            f"truncated or corrupt header: {n_kv} metadata entries and {n_tensors} tensors "
            f"cannot fit in the {r.remaining()} bytes left in the file"
        )
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = r.string(f"metadata key #{i}", MAX_KEY_LEN)
        if key in metadata:
            raise r.fail(f"duplicate metadata key {shown(key)}")
        metadata[key] = r.value(r.u32(f"type of {key}"), key)
    check_metadata(metadata, r.name)
    infos = []
    for i in range(n_tensors):
        tname = r.string(f"tensor name #{i}", MAX_KEY_LEN)
        n_dims = r.u32(f"n_dims of {tname}")
        if n_dims > MAX_DIMS:
            raise r.fail(f"tensor {tname}: {n_dims} dimensions, at most {MAX_DIMS} allowed")
        ne = [r.u64(f"dims of {tname}") for _ in range(n_dims)]
        infos.append((tname, ne, r.u32(f"type of {tname}"), r.u64(f"offset of {tname}")))
    return version, metadata, infos


def header_length(f: BinaryIO, file_size: int, name: str) -> int:
    """Where the header of the GGUF file `f` (`file_size` bytes) ends: its magic through its last
    tensor info, what a header-only stub keeps; read in order, as far as the header goes.
    CheckpointError for a corrupt or truncated header."""
    r = _HeaderReader(f, file_size, name)
    _parse_header(r)
    return r.pos


class GGUFSource:
    """A GGUF file's metadata and tensor index, read from its header; see the `Source` protocol."""

    kind = "gguf"

    def __init__(
        self, path: str | os.PathLike[str], allow_stub: bool = True, strict_types: bool = True,
        shard: bool = False,
    ):
        """`shard`: a later file of a split model, opened by the first (`_join_splits`)."""
        self.path = Path(path)
        self.config: dict[str, Any] = {}
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorRef] = {}
        # Tensors of types we cannot read (only filled when strict_types is False): name -> type.
        self.unsupported: dict[str, str] = {}
        self.unsupported_shapes: dict[str, tuple[int, ...]] = {}  # still tells what the model is
        name = self.path.name
        try:
            file_size = self.path.stat().st_size
            f = open(self.path, "rb")
        except OSError as e:
            raise CheckpointError(f"{name}: cannot open: {e.strerror or e}") from None
        with f:
            r = _HeaderReader(f, file_size, name)
            self.version, self.metadata, infos = _parse_header(r)
        self.header_size = r.pos  # header end, before padding to the data section
        self.bytes_read_max = r.bytes_read_max
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise CheckpointError(f"{name}: general.alignment {shown(alignment)} is not a power of two")
        self.alignment = alignment
        self.data_offset = -(-r.pos // alignment) * alignment
        self.header_only = bool(infos) and file_size <= self.data_offset
        if self.header_only and not allow_stub:
            raise CheckpointError(f"{name}: header-only GGUF stub: no tensor data")
        self._index(infos, file_size, strict_types)
        if not shard:
            self._join_splits(allow_stub, strict_types)

    def _join_splits(self, allow_stub: bool, strict_types: bool) -> None:
        """The tensors of a split model's other files (see the module's doc), each file checked
        as this one was; CheckpointError for a file that is not the first, a missing or foreign
        sibling, a tensor in two files or a count that does not add up."""
        count, no, name = self.metadata.get("split.count", 0), self.metadata.get("split.no", 0), self.path.name
        if count <= 1:
            return
        m = SPLIT_NAME.fullmatch(name)
        if m is None or int(m[3]) != count or int(m[2]) != no + 1:
            raise CheckpointError(f"{name}: file {no + 1} of a model split in {count} (split.no, split.count), "
                                  f"but not named as llama-gguf-split names them: PREFIX-{no + 1:05d}-of-{count:05d}.gguf")
        if no != 0:
            raise CheckpointError(f"{name}: file {no + 1} of a model split in {count}: open the first, "
                                  f"{m[1]}-00001-of-{m[3]}.gguf")
        for k in range(2, count + 1):
            path = self.path.with_name(f"{m[1]}-{k:05d}-of-{m[3]}.gguf")
            if not path.is_file():
                raise CheckpointError(f"{name}: file {k} of this split model is missing: {path.name}")
            part = GGUFSource(path, allow_stub, strict_types, shard=True)
            if (part.metadata.get("split.count"), part.metadata.get("split.no")) != (count, k - 1):
                raise CheckpointError(f"{path.name}: split.no {shown(part.metadata.get('split.no'))} of "
                                      f"{shown(part.metadata.get('split.count'))}, expected {k - 1} of {count}")
            for tname in (*part.tensors, *part.unsupported):
                if tname in self.tensors or tname in self.unsupported:
                    raise CheckpointError(f"{path.name}: tensor {tname} is in two files of this split model")
            self.tensors.update(part.tensors)
            self.unsupported.update(part.unsupported)
            self.unsupported_shapes.update(part.unsupported_shapes)
            self.header_only = self.header_only or part.header_only
            self.bytes_read_max += part.bytes_read_max
        total = self.metadata.get("split.tensors.count")
        if total is not None and total != len(self.tensors) + len(self.unsupported):
            raise CheckpointError(f"{name}: split.tensors.count is {total}, but the {count} files hold "
                                  f"{len(self.tensors) + len(self.unsupported)} tensors")

    def _index(
        self, infos: list[_Info], file_size: int, strict_types: bool
    ) -> None:
        name = self.path.name
        for tname, ne, type_id, rel in infos:
            if tname in self.tensors or tname in self.unsupported:
                raise CheckpointError(f"{name}: duplicate tensor {tname}")
            n = 1
            for d in ne:
                n *= d
            if n > MAX_ELEMENTS:
                raise CheckpointError(f"{name}: tensor {tname} has an absurd shape {ne}")
            if rel % self.alignment:
                raise CheckpointError(
                    f"{name}: tensor {tname} offset {rel} is not a multiple of the alignment {self.alignment}"
                )
            dtype = SUPPORTED_TYPES.get(type_id)
            if dtype is None:
                if strict_types:
                    raise CheckpointError(
                        f"{name}: unsupported GGUF type {ggml_type_name(type_id)} for tensor {tname}"
                    )
                self.unsupported[tname] = ggml_type_name(type_id)
                self.unsupported_shapes[tname] = tuple(reversed(ne))
                continue
            block = FORMATS[dtype].block
            if block > 1 and (not ne or ne[0] % block):
                raise CheckpointError(
                    f"{name}: tensor {tname} is {ggml_type_name(type_id)} but its row length "
                    f"{ne[0] if ne else 0} is not a multiple of {block}"
                )
            shape = tuple(reversed(ne))
            ref = TensorRef(
                tname, dtype, shape, self.path, self.data_offset + rel, stored_nbytes(dtype, shape)
            )
            self.tensors[tname] = ref
        if self.header_only:
            return  # a stub has no data to check offsets against
        over = [ref for ref in self.tensors.values() if ref.offset + ref.nbytes > file_size]
        if over:
            first = min(over, key=lambda ref: ref.offset)
            raise CheckpointError(
                f"{name}: truncated: tensor {first.name} ends at byte {first.offset + first.nbytes}, "
                f"file has {file_size}"
            )

    def read(self, name: str) -> torch.Tensor:
        """Stored bytes of one tensor: its dtype and shape, or raw block rows (see `stored_shape`)."""
        ref = self.tensors.get(name)
        if name in self.unsupported:
            raise CheckpointError(
                f"{self.path.name}: tensor {name} has unsupported type {self.unsupported[name]}"
            )
        if ref is None:
            raise CheckpointError(f"{self.path.name}: tensor {name} is not in the file")
        if self.header_only:
            raise CheckpointError(
                f"{self.path.name}: header-only GGUF stub: no data for tensor {name}"
            )
        return read_ref(ref)

    def side_files(self) -> list[tuple[Path, str]]:
        """tokenizer.json + tokenizer_config.json rebuilt from the metadata, in a temporary
        directory that lives as long as this source (or [] with a warning; see gguf_tokenizer)."""
        if getattr(self, "_side_files", None) is None:
            from .gguf_tokenizer import write_tokenizer_from_gguf

            out = Path(tempfile.mkdtemp(prefix="ftkit-gguf-tokenizer-"))
            weakref.finalize(self, shutil.rmtree, out, ignore_errors=True)
            names = write_tokenizer_from_gguf(self.metadata, out)
            self._side_files = [(out / name, name) for name in names]
        return list(self._side_files)
