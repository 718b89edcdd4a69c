"""Hostile inputs for the reader fuzz targets (tests/test_fuzz_headers.py), drawn by hypothesis.

Two kinds of mutation, both starting from the project's own fixtures:
* of values: a JSON document (safetensors header, config.json, FTW manifest, tokenizer files) or
  a GGUF file's metadata and tensor infos, decoded, changed where it matters (wrong types, huge
  and negative numbers, NaN and infinities, deep nesting, long lists, removed and added keys)
  and encoded again, so the change gets past the parser to the checks behind it;
* of bytes: flips in the header, truncation anywhere, bytes inserted or appended.

`check` holds the property every target asserts.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
from hypothesis import strategies as st

from ftkit.errors import InputError

# ---- the property ------------------------------------------------------------------------------


def check_message(e: InputError) -> None:
    """The project's user errors are one printable, non-empty line."""
    msg = str(e)
    assert msg and "\n" not in msg and msg.isprintable(), repr(msg)


def answer(step: Callable[[], Any]) -> Any:
    """`step()`'s result, or the InputError it raised (checked to be one line). Any other
    exception propagates: that is the bug the fuzzing looks for."""
    try:
        return step()
    except InputError as e:
        check_message(e)
        return e


SLACK = 4096  # what a report holds whatever the input: its paths and messages


def assert_bounded(value: Any, size: int, where: str = "result") -> None:
    """No container in `value` (a report, a spec, metadata) is longer than the input's `size`
    in bytes (plus SLACK): what a reader builds stays within what the file holds."""
    limit = size + SLACK
    stack = [(value, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, (list, tuple, dict, set, frozenset, str, bytes)):
            assert len(v) <= limit, f"{at}: {len(v)} entries from {limit} bytes of input"
        if isinstance(v, dict):
            stack += [(x, f"{at}.{k}") for k, x in v.items()]
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack += [(x, f"{at}[]") for x in v]


def input_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---- JSON values -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """JSON text placed as is where a value goes: what json.dumps cannot write (deep nesting,
    NaN spelled as a literal, a number of 5,000 digits)."""

    text: str


HOSTILE_SCALARS: list[Any] = [
    None, True, False, 0, 1, -1, 2, 7, 1.5, 1e-320, -0.0, 10**6, 10**9, 2**31, 2**32 - 1, 2**63, 10**30,
    "", "x", "1", "float32", "../etc/passwd", "/abs", "\u0000\u202e", [], {}, [2], [[2]], {"a": 1}, [None],
]
RAW = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), Raw("9" * 5000),
       Raw("[" * 100_000 + "]" * 100_000), Raw("{\"a\":" * 5_000 + "1" + "}" * 5_000), Raw("[" * 60 + "]" * 60)]


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into `value` (keys and indices), the value itself first; long lists sampled."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i in sorted({0, 1, len(value) // 2, len(value) - 1} & set(range(len(value)))):
            out += _paths(value[i], (*prefix, i))
    return out


def _get(value: Any, path: tuple) -> Any:
    for k in path:
        value = value[k]
    return value


def _replacement(data: st.DataObject, old: Any) -> Any:
    """A hostile value to put where `old` was: another type, a changed number, a special one."""
    kind = data.draw(st.sampled_from(["scalar", "raw", "number", "long", "nested", "drop"]))
    if kind == "scalar":
        return data.draw(st.sampled_from(HOSTILE_SCALARS))
    if kind == "raw":
        return data.draw(st.sampled_from(RAW))
    if kind == "number" and type(old) in (int, float):
        return data.draw(st.sampled_from([old + 1, old - 1, -old, old * 1000, old * 10**6, old / 3, float(old)]))
    if kind == "long":  # a list far longer than any count the reader expects
        return [data.draw(st.sampled_from([0, 1, "a", 1.5]))] * data.draw(st.sampled_from([10**3, 10**5]))
    if kind == "nested":
        return [old] if data.draw(st.booleans()) else {"x": old}
    return DROP


DROP = object()

# Keys the families and the FTW spec read, set where they are absent too, with values that are
# plausible as well as hostile: what reaches the per-family checks (rope types, layer kinds,
# windows, dense-layer lists, group routing, linear attention).
KNOWN_KEYS = [
    "sliding_window", "use_sliding_window", "layer_types", "layer_kinds", "mlp_only_layers", "decoder_sparse_step",
    "rope_scaling", "rope_parameters", "text_config", "head_dim", "tie_word_embeddings", "full_attention_interval",
    "first_k_dense_replace", "n_group", "topk_group", "n_routed_experts", "partial_rotary_factor", "clip_qkv",
    "linear_num_key_heads", "linear_conv_kernel_dim", "linear_in_proj", "extra", "moe_layers", "eos_token_id",
    "eos_token_ids", "bos_token_id", "architectures", "model_type", "num_experts_per_tok", "top_k",
]
PLAUSIBLE: list[Any] = [
    1, 2, 3, 4, 16, 4096, 32768, 0.25, 0.5, True, False, None, "qkv_z", "yarn", [0, 1], [1], [0, 0], [1, 0],
    ["full_attention", "full_attention"], ["linear_attention", "full_attention"], ["sliding_attention"] * 2,
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, {"rope_type": "llama3", "factor": 8},
    {"rope_type": "dynamic", "factor": 2.0}, {"type": "linear", "factor": 0}, {"rope_type": "longrope"},
    {"rope_type": "yarn", "mscale": -10.0, "mscale_all_dim": 1.0, "factor": 4.0},
    {"model_type": "qwen3_moe", "num_hidden_layers": 10**8}, {"n_group": 3, "topk_group": 1, "routed_scaling_factor": 0},
]


def mutate_json(data: st.DataObject, value: Any) -> str:
    """`value` with one to three hostile edits, as JSON text."""
    raws: list[Raw] = []
    for _ in range(data.draw(st.integers(1, 3))):
        objects = [p for p in _paths(value) if isinstance(_get(value, p), dict)]
        if objects and data.draw(st.integers(0, 3)) == 0:  # a key the readers know, set anywhere
            path = (*data.draw(st.sampled_from(objects)), data.draw(st.sampled_from(KNOWN_KEYS)))
            new = copy.deepcopy(data.draw(st.sampled_from(PLAUSIBLE + HOSTILE_SCALARS)))
            _get(value, path[:-1])[path[-1]] = new
            continue
        path = data.draw(st.sampled_from(_paths(value)))
        new = _replacement(data, _get(value, path))
        new = copy.deepcopy(new) if isinstance(new, (list, dict)) else new  # never the shared samples
        if isinstance(new, Raw):
            raws.append(new)
            new = f"\u0000RAW{len(raws) - 1}\u0000"
        if not path:
            value = None if new is DROP else new
            continue
        parent = _get(value, path[:-1])
        if new is DROP:
            del parent[path[-1]]
        else:
            parent[path[-1]] = new
        if isinstance(parent, dict) and data.draw(st.booleans()):  # an unknown key beside it
            parent[data.draw(st.sampled_from(["extra", "__metadata__", "", "dtype"]))] = new if new is not DROP else 1
    text = json.dumps(value)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\u0000RAW{i}\u0000"), raw.text)
    return text


# ---- bytes -----------------------------------------------------------------------------------


def mutate_bytes(data: st.DataObject, blob: bytes, header: int) -> bytes:
    """Flips within the first `header` bytes, a truncation, an insertion or appended bytes."""
    out = bytearray(blob)
    kind = data.draw(st.sampled_from(["flip", "flips", "truncate", "insert", "append"]))
    if kind == "truncate":
        return bytes(out[: data.draw(st.integers(0, max(0, len(out) - 1)))])
    if kind in ("insert", "append"):
        at = len(out) if kind == "append" else data.draw(st.integers(0, min(len(out), header)))
        out[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        return bytes(out)
    for _ in range(1 if kind == "flip" else 8):
        out[data.draw(st.integers(0, max(0, min(len(out), header) - 1)))] = data.draw(st.integers(0, 255))
    return bytes(out)


# ---- GGUF ------------------------------------------------------------------------------------

VT = gguf.GGUFValueType
_PACK = {VT.UINT8: "B", VT.INT8: "b", VT.UINT16: "H", VT.INT16: "h", VT.UINT32: "I", VT.INT32: "i",
         VT.FLOAT32: "f", VT.BOOL: "?", VT.UINT64: "Q", VT.INT64: "q", VT.FLOAT64: "d"}


@dataclass
class GGUFParts:
    """A GGUF file as values: metadata (key, type, value; an array's value is (element type,
    items)), tensor infos (name, ggml dims, type id, offset), alignment and the data section."""

    kvs: list[tuple[str, int, Any]]
    tensors: list[tuple[str, list[int], int, int]]
    alignment: int
    data: bytes


def _value(field: Any) -> tuple[int, Any]:
    vtype = field.types[0]
    if vtype != VT.ARRAY:
        return vtype, field.contents()
    return vtype, (field.types[1], field.contents())


def read_gguf(path: Path) -> GGUFParts:
    """A fixture GGUF decoded with gguf-py's reader (independent of the reader under test)."""
    r = gguf.GGUFReader(path)
    kvs = [(k, *_value(f)) for k, f in r.fields.items() if not k.startswith("GGUF.")]
    tensors = [(t.name, [int(d) for d in t.field.parts[3]], int(t.tensor_type),
                int(t.field.parts[-1][0])) for t in r.tensors]
    return GGUFParts(kvs, tensors, r.alignment, path.read_bytes()[r.data_offset :])


def _enc(vtype: int, value: Any) -> bytes:
    if vtype == VT.STRING:
        raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else bytes(value)
        return struct.pack("<Q", len(raw)) + raw
    if vtype == VT.ARRAY:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(_enc(etype, x) for x in items)
    return struct.pack("<" + _PACK[vtype], value)


def encode_gguf(p: GGUFParts) -> bytes:
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(p.tensors), len(p.kvs)))
    for key, vtype, value in p.kvs:
        out += _enc(VT.STRING, key) + struct.pack("<I", vtype) + _enc(vtype, value)
    for name, dims, ttype, offset in p.tensors:
        out += _enc(VT.STRING, name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ttype, offset)
    out += b"\0" * (-len(out) % p.alignment)
    return bytes(out + p.data)


# (type, value) pairs of every metadata type, the hostile ones included
GGUF_VALUES: list[tuple[int, Any]] = [
    (VT.UINT32, 0), (VT.UINT32, 1), (VT.UINT32, 10**6), (VT.UINT32, 2**32 - 1), (VT.INT32, -1),
    (VT.UINT64, 2**63), (VT.INT64, -(2**63)), (VT.FLOAT32, float("inf")), (VT.FLOAT32, float("nan")),
    (VT.FLOAT32, 1.5), (VT.FLOAT64, 1e-320), (VT.BOOL, True), (VT.UINT8, 255), (VT.STRING, ""),
    (VT.STRING, "x"), (VT.STRING, "\udcff"), (VT.STRING, "{% if %}"), (VT.STRING, "{{" + "(" * 3000 + ")" * 3000 + "}}"),
    (VT.ARRAY, (VT.UINT32, [1, 2, 3])), (VT.ARRAY, (VT.STRING, ["a", "b"])), (VT.ARRAY, (VT.FLOAT32, [0.5])),
    (VT.ARRAY, (VT.ARRAY, [(VT.UINT32, [1])])), (VT.ARRAY, (VT.UINT32, [])), (VT.ARRAY, (VT.STRING, ["ab" * 40000])),
]
GGUF_KEYS = ["general.alignment", "general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre",
             "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores", "tokenizer.ggml.merges",
             "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token",
             "tokenizer.chat_template", "tokenizer.chat_template.tool_use"]
GGUF_ARCH_KEYS = ["block_count", "context_length", "embedding_length", "feed_forward_length",
                  "attention.head_count", "attention.head_count_kv", "attention.key_length",
                  "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.type", "rope.scaling.factor",
                  "expert_count", "expert_used_count", "expert_feed_forward_length", "nextn_predict_layers"]


def _scaled(data: st.DataObject, vtype: int, value: Any) -> tuple[int, Any]:
    """A numeric value made huge, zero, negative or fractional, within its type when it can be."""
    if vtype == VT.ARRAY:
        etype, items = value
        if items and data.draw(st.booleans()):  # the list's element type swapped for another
            other = data.draw(st.sampled_from([VT.UINT32, VT.INT32, VT.FLOAT32, VT.STRING]))
            fill = {VT.STRING: "t", VT.FLOAT32: 0.5}.get(other, 7)
            return VT.ARRAY, (other, [fill] * len(items))
        return VT.ARRAY, (etype, items[: data.draw(st.integers(0, len(items)))])
    if vtype in (VT.UINT32, VT.UINT64, VT.INT32):
        return data.draw(st.sampled_from([(VT.UINT32, 0), (VT.UINT32, 10**6), (VT.UINT32, 2**32 - 1),
                                          (VT.UINT64, value * 1000 % 2**64), (VT.FLOAT32, float("inf")),
                                          (VT.FLOAT32, value + 0.5), (VT.INT32, -1)]))
    return data.draw(st.sampled_from(GGUF_VALUES))


def mutate_gguf(data: st.DataObject, p: GGUFParts) -> bytes:
    """A GGUF with one to three hostile edits of its metadata or tensor infos."""
    kvs, tensors = list(p.kvs), list(p.tensors)
    arch = next((v for k, _, v in kvs if k == "general.architecture"), "llama")
    for _ in range(data.draw(st.integers(1, 3))):
        kind = data.draw(st.sampled_from(["value", "scale", "drop", "add", "tensor", "tensors"]))
        if kind in ("value", "scale", "drop") and kvs:
            i = data.draw(st.integers(0, len(kvs) - 1))
            key, vtype, value = kvs[i]
            if kind == "drop":
                del kvs[i]
            else:
                kvs[i] = (key, *(data.draw(st.sampled_from(GGUF_VALUES)) if kind == "value" else _scaled(data, vtype, value)))
        elif kind == "add":
            key = data.draw(st.sampled_from(GGUF_KEYS + [f"{arch}.{k}" for k in GGUF_ARCH_KEYS]))
            kvs = [kv for kv in kvs if kv[0] != key] + [(key, *data.draw(st.sampled_from(GGUF_VALUES)))]
        elif kind == "tensor" and tensors:
            i = data.draw(st.integers(0, len(tensors) - 1))
            name, dims, ttype, offset = tensors[i]
            what = data.draw(st.sampled_from(["dims", "type", "offset", "name"]))
            if what == "dims":
                dims = data.draw(st.sampled_from([[], [0], dims[:-1], [*dims, 1], [2**40, *dims[1:]], [d * 2 for d in dims]]))
            elif what == "type":
                ttype = data.draw(st.sampled_from([0, 1, 8, 12, 24, 26, 28, 30, 41, 99, 2**31]))
            elif what == "offset":
                offset = data.draw(st.sampled_from([0, offset + 1, offset + p.alignment, 2**62, offset * 2]))
            else:
                name = data.draw(st.sampled_from(["", tensors[0][0], "blk.999999.ffn_down_exps.weight", "\udcff"]))
            tensors[i] = (name, dims[:8], ttype % 2**32, offset % 2**64)
        elif kind == "tensors" and tensors:
            tensors = tensors[: data.draw(st.integers(0, len(tensors) - 1))]
    return encode_gguf(GGUFParts(kvs, tensors, p.alignment, p.data))


def add_vocab(p: GGUFParts, hf_dir: Path) -> GGUFParts:
    """`p` with a byte-level BPE vocabulary and chat template from an HF fixture's tokenizer files,
    as llama.cpp's converter stores them: what the GGUF tokenizer rebuild reads."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    kvs = [kv for kv in p.kvs if not kv[0].startswith("tokenizer.")] + [
        ("tokenizer.ggml.model", VT.STRING, "gpt2"), ("tokenizer.ggml.pre", VT.STRING, "qwen2"),
        ("tokenizer.ggml.tokens", VT.ARRAY, (VT.STRING, tokens)),
        ("tokenizer.ggml.token_type", VT.ARRAY, (VT.INT32, [3 if t in special else 1 for t in tokens])),
        ("tokenizer.ggml.merges", VT.ARRAY, (VT.STRING, merges)),
        ("tokenizer.ggml.eos_token_id", VT.UINT32, vocab[cfg["eos_token"]]),
        ("tokenizer.chat_template", VT.STRING, cfg["chat_template"]),
    ]
    return GGUFParts(kvs, p.tensors, p.alignment, p.data)
