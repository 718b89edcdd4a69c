"""GGUFSource on GGUF files written the way llama.cpp's converter writes them (gguf_fixtures)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ftkit.kernels.dequant import dequantize_q8_0
from ftkit.runtime.checkpoint.base import CheckpointError
from ftkit.runtime.checkpoint.gguf import READ_CHUNK, GGUFSource
from ftkit.tools.diagnose.report import diagnose
from gguf_fixtures import header_end, random_blocks, write_gguf_from_hf

QT = gguf.GGMLQuantizationType
MODELS = ["qwen2_moe", "qwen3_moe", "olmoe", "mixtral"]  # tiny checkpoints from conftest
DTYPES = ["F32", "F16", "BF16", "Q8_0"]
STORED = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "Q8_0": "q8_0"}
READER_TYPES = {QT.F32: "float32", QT.F16: "float16", QT.BF16: "bfloat16", QT.Q8_0: "q8_0"}
PER_LAYER = {
    "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
    "ffn_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
    "ffn_down_exps.weight",
}  # fmt: skip
EXTRA = {
    "qwen2_moe": {"attn_q.bias", "attn_k.bias", "attn_v.bias", "ffn_gate_inp_shexp.weight",
                  "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"},
    "qwen3_moe": {"attn_q_norm.weight", "attn_k_norm.weight"},
    "olmoe": {"attn_q_norm.weight", "attn_k_norm.weight"},
    "mixtral": set(),
}  # fmt: skip


@pytest.fixture(scope="module")
def gguf_file(
    hf_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Path]:
    """`gguf_file(model_type, dtype) -> Path`: the conftest checkpoint converted, cached."""
    root = tmp_path_factory.mktemp("gguf")
    cache: dict[tuple[str, str], Path] = {}

    def get(model_type: str, dtype: str) -> Path:
        if (model_type, dtype) not in cache:
            out = root / f"{model_type}-{dtype}.gguf"
            write_gguf_from_hf(hf_checkpoint(model_type), out, dtype)
            cache[model_type, dtype] = out
        return cache[model_type, dtype]

    return get


def _expect_error(path: Path, match: str, **kw) -> str:
    with pytest.raises(CheckpointError, match=match) as e:
        GGUFSource(path, **kw)
    msg = str(e.value)
    assert "\n" not in msg and path.name in msg
    return msg


def _patched(src: Path, dst: Path, offset: int, fmt: str, value: int) -> Path:
    data = bytearray(src.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    dst.write_bytes(data)
    return dst


def _tensor_info_offset(path: Path, name: str) -> int:
    """Byte offset of a tensor info's n_dims field (just after its name)."""
    data = path.read_bytes()
    return data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, QT | None]], **kv: list) -> Path:
    w = gguf.GGUFWriter(path, "qwen3moe")
    for key, val in kv.items():
        w.add_array(key, val)
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_type", MODELS)
def test_index_matches_gguf_reader(gguf_file, model_type, dtype):
    path = gguf_file(model_type, dtype)
    src = GGUFSource(path)
    reader = gguf.GGUFReader(path)

    assert src.kind == "gguf" and src.config == {} and src.side_files() == []
    assert not src.header_only and src.data_offset == reader.data_offset
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert src.metadata[key] == field.contents(), key
    assert src.metadata["general.file_type"] == {"F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7}[dtype]

    assert list(src.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        ref = src.tensors[t.name]
        assert ref.shape == tuple(int(d) for d in reversed(t.shape))
        assert ref.dtype == READER_TYPES[t.tensor_type]
        assert (ref.offset, ref.nbytes) == (t.data_offset, t.n_bytes)

    n_layer = src.metadata[f"{src.metadata['general.architecture']}.block_count"]
    assert set(src.tensors) == {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}" for i in range(n_layer) for n in PER_LAYER | EXTRA[model_type]
    }
    for ref in src.tensors.values():
        # The converter keeps 1-D tensors, norms and router gates in F32, and writes F16 where a
        # row length does not split into Q8_0 blocks of 32.
        if len(ref.shape) == 1 or "_norm." in ref.name or "ffn_gate_inp" in ref.name:
            assert ref.dtype == "float32", ref.name
        elif dtype == "Q8_0" and ref.shape[-1] % 32:
            assert ref.dtype == "float16", ref.name
        else:
            assert ref.dtype == STORED[dtype], ref.name


def test_expert_and_gate_shapes(gguf_file):
    src = GGUFSource(gguf_file("qwen2_moe", "Q8_0"))
    n_expert = src.metadata["qwen2moe.expert_count"]
    assert src.tensors["blk.0.ffn_gate_exps.weight"].shape == (n_expert, 32, 64)
    assert src.tensors["blk.0.ffn_down_exps.weight"].shape == (n_expert, 64, 32)
    assert src.tensors["blk.0.ffn_gate_inp.weight"].shape == (n_expert, 64)
    assert src.tensors["blk.0.ffn_gate_inp_shexp.weight"].shape == (1, 64)  # HF's [1, hidden]
    # Shared-expert FFN is 48 wide: its down projection cannot be Q8_0, the others can.
    assert src.tensors["blk.0.ffn_down_shexp.weight"].dtype == "float16"
    assert src.tensors["blk.0.ffn_up_shexp.weight"].dtype == "q8_0"


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("model_type", MODELS)
def test_float_data_bitwise(gguf_file, model_type, dtype):
    path = gguf_file(model_type, dtype)
    src = GGUFSource(path)
    for t in gguf.GGUFReader(path).tensors:
        got = src.read(t.name)
        assert got.dtype == getattr(torch, src.tensors[t.name].dtype)
        assert got.shape == src.tensors[t.name].shape
        raw = got.contiguous().view(torch.uint8).flatten().numpy().tobytes()
        assert raw == t.data.tobytes(), t.name


@pytest.mark.parametrize("model_type", MODELS)
def test_layout_against_hf_weights(gguf_file, hf_checkpoint, model_type):
    """Merged experts stack per-expert HF weights; llama-arch Q/K rows are permuted per head."""
    hf = load_file(hf_checkpoint(model_type) / "model.safetensors")
    src = GGUFSource(gguf_file(model_type, "F32"))
    mixtral = model_type == "mixtral"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    prefix = "model.layers.1.block_sparse_moe.experts" if mixtral else "model.layers.1.mlp.experts"
    merged_names = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    for gguf_name, hf_name in zip(merged_names, names, strict=True):
        merged = src.read(f"blk.1.{gguf_name}.weight")
        for e in range(merged.shape[0]):
            assert torch.equal(merged[e], hf[f"{prefix}.{e}.{hf_name}.weight"])
    for proj, heads in (("q", 4), ("k", 2)):
        w = hf[f"model.layers.0.self_attn.{proj}_proj.weight"]
        if mixtral:
            # LlamaModel.permute: GGUF row h*d + 2i + j holds HF row h*d + j*(d/2) + i.
            d = w.shape[0] // heads
            half = range(d // 2)
            w = w[[h * d + j * (d // 2) + i for h in range(heads) for i in half for j in (0, 1)]]
        assert torch.equal(src.read(f"blk.0.attn_{proj}.weight"), w)


@pytest.mark.parametrize("model_type", MODELS)
def test_q8_0_blocks(gguf_file, model_type):
    ref = GGUFSource(gguf_file(model_type, "F32"))
    src = GGUFSource(gguf_file(model_type, "Q8_0"))
    quantized = [r for r in src.tensors.values() if r.dtype == "q8_0"]
    assert len(quantized) > 10
    for r in quantized:
        raw = src.read(r.name)
        assert raw.dtype == torch.uint8 and raw.shape == (*r.shape[:-1], r.shape[-1] // 32 * 34)
        expected = gguf.quants.quantize(ref.read(r.name).numpy(), QT.Q8_0)
        assert np.array_equal(raw.numpy(), expected), r.name
        dequantized = gguf.quants.dequantize(raw.numpy(), QT.Q8_0)
        assert np.array_equal(dequantize_q8_0(raw).numpy(), dequantized), r.name


def test_header_only_stub(gguf_file, tmp_path):
    full_path = gguf_file("qwen3_moe", "F32")
    full = GGUFSource(full_path)
    assert full.data_offset == header_end(full_path)
    assert full.bytes_read_max <= full.data_offset + READ_CHUNK < full_path.stat().st_size

    def index(src: GGUFSource) -> list[tuple]:
        return [(r.name, r.dtype, r.shape, r.offset, r.nbytes) for r in src.tensors.values()]

    for cut in (full.data_offset, full.header_size):  # with and without the alignment padding
        stub_path = tmp_path / f"stub{cut}.gguf"
        stub_path.write_bytes(full_path.read_bytes()[:cut])
        stub = GGUFSource(stub_path)
        assert stub.header_only
        assert stub.bytes_read_max <= stub.data_offset == full.data_offset
        assert stub.metadata == full.metadata and index(stub) == index(full)
        with pytest.raises(CheckpointError, match="header-only"):
            stub.read("token_embd.weight")
        _expect_error(stub_path, "header-only GGUF stub: no tensor data", allow_stub=False)


def test_truncated_data(gguf_file, tmp_path):
    path = gguf_file("olmoe", "F16")
    src = GGUFSource(path)
    cut = src.data_offset + 1000
    short = tmp_path / "short.gguf"
    short.write_bytes(path.read_bytes()[:cut])
    over = [r for r in src.tensors.values() if r.offset + r.nbytes > cut]
    first = min(over, key=lambda r: r.offset)
    msg = _expect_error(short, "truncated: tensor")
    assert f"tensor {first.name} ends at byte {first.offset + first.nbytes}, file has {cut}" in msg


def test_bad_magic_version_and_truncated_header(gguf_file, tmp_path):
    path = gguf_file("mixtral", "BF16")
    data = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    _expect_error(bad, r"not a GGUF file \(bad magic b'GGML'")
    bad.write_bytes(b"")
    _expect_error(bad, "not a GGUF file")
    _expect_error(_patched(path, bad, 4, "<I", 7), "unsupported GGUF version 7$")
    _expect_error(_patched(path, bad, 4, ">I", 3), r"version 50331648 \(big-endian")
    for cut in (6, 30, GGUFSource(path).header_size - 5):
        bad.write_bytes(data[:cut])
        _expect_error(bad, "truncated (or corrupt )?header")


def test_corrupt_header_fields(gguf_file, tmp_path):
    path = gguf_file("qwen3_moe", "F32")
    bad = tmp_path / "bad.gguf"
    _expect_error(_patched(path, bad, 8, "<Q", 1 << 40), "corrupt header: .* tensors cannot fit")
    _expect_error(_patched(path, bad, 24, "<Q", 1 << 40), "string length 1099511627776 exceeds")
    name = "blk.0.attn_q.weight"
    n_dims_at = _tensor_info_offset(path, name)
    _expect_error(_patched(path, bad, n_dims_at, "<I", 5), f"tensor {name}: 5 dimensions")
    offset_at = n_dims_at + 4 + 2 * 8 + 4  # after n_dims, two dims and the type
    real = struct.unpack_from("<Q", path.read_bytes(), offset_at)[0]
    _patched(path, bad, offset_at, "<Q", real + 4)
    _expect_error(bad, f"tensor {name} offset {real + 4} is not a multiple of the alignment 32")
    _patched(path, bad, offset_at, "<Q", real + (1 << 20))
    _expect_error(bad, f"truncated: tensor {name} ends at byte")


def test_corrupt_arrays(tmp_path):
    path = _write(tmp_path / "arr.gguf", {}, **{"t.a": [1, 2, 3]})
    count_at = path.read_bytes().index(b"t.a") + 3 + 4 + 4  # key, value type, element type
    _expect_error(_patched(path, tmp_path / "b.gguf", count_at, "<Q", 1 << 40), "t.a: array of")
    elem_type_at = count_at - 4
    _expect_error(_patched(path, tmp_path / "b.gguf", elem_type_at, "<I", 99), "element type 99")


def test_unsupported_types(tmp_path):
    tq2 = gguf.quants.quantize(np.ones((4, 256), np.float32), QT.TQ2_0)
    tensors = {
        "token_embd.weight": (np.zeros((2, 64), np.float32), None),
        "blk.0.ffn_down_exps.weight": (np.zeros((4, 66), np.uint8), QT.IQ2_XXS),  # 1 block a row
        "blk.0.ffn_up_exps.weight": (tq2, QT.TQ2_0),
    }
    path = _write(tmp_path / "quant.gguf", tensors)

    _expect_error(path, "unsupported GGUF type IQ2_XXS for tensor blk.0.ffn_down_exps.weight$")
    src = GGUFSource(path, strict_types=False)
    assert src.unsupported == {
        "blk.0.ffn_down_exps.weight": "IQ2_XXS",
        "blk.0.ffn_up_exps.weight": "TQ2_0",
    }
    assert src.unsupported_shapes["blk.0.ffn_down_exps.weight"] == (4, 256)
    assert list(src.tensors) == ["token_embd.weight"]
    with pytest.raises(CheckpointError, match="unsupported type TQ2_0"):
        src.read("blk.0.ffn_up_exps.weight")

    odd = tmp_path / "odd.gguf"
    type_at = _tensor_info_offset(path, "blk.0.ffn_down_exps.weight") + 4 + 2 * 8
    _expect_error(_patched(path, odd, type_at, "<I", 42), "unsupported GGUF type type 42 for")


BLOCK_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K,
               QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS, QT.MXFP4]  # fmt: skip


def test_every_block_type_reads_as_its_raw_rows(tmp_path):
    """Each quant type people download, in one file: indexed under our name with GGUF's byte
    sizes, read back as the stored blocks (rows of raw bytes), any mix of types."""
    rng = np.random.default_rng(0)
    raws = {t: random_blocks(t.name.lower(), (3, 512), rng) for t in BLOCK_TYPES}
    path = _write(tmp_path / "mix.gguf", {f"t.{t.name}": (raw, t) for t, raw in raws.items()})
    src = GGUFSource(path)
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for t, raw in raws.items():
        ref = src.tensors[f"t.{t.name}"]
        assert ref.dtype == t.name.lower() and ref.shape == (3, 512)
        assert (ref.offset, ref.nbytes) == (reader[ref.name].data_offset, reader[ref.name].n_bytes)
        assert np.array_equal(src.read(ref.name).numpy(), raw)


def test_row_length_must_split_into_blocks(tmp_path):
    """A K-quant tensor whose rows do not split into 256-weight blocks is named, with its type."""
    path = _write(tmp_path / "k.gguf", {"blk.0.attn_q.weight": (random_blocks("q4_k", (2, 256), np.random.default_rng(0)), QT.Q4_K)})
    dims_at = _tensor_info_offset(path, "blk.0.attn_q.weight") + 4
    bad = _patched(path, tmp_path / "bad.gguf", dims_at, "<Q", 128)  # ne[0]: the row length
    msg = "tensor blk.0.attn_q.weight is Q4_K but its row length 128 is not a multiple of 256"
    _expect_error(bad, msg + "$")
    assert diagnose(bad)["problems"] == [f"bad.gguf: {msg}"]  # ft-diagnose: one line, no traceback


def test_metadata_value_types(tmp_path):
    path = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(path, "llama")
    arrays = {"t.nested": [[1, 2], [3]], "t.strs": ["a", "bé"], "t.floats": [0.5, 1.5]}
    for key, val in arrays.items():
        w.add_array(key, val)
    w.add_bool("t.bool", True)
    w.add_int8("t.i8", -3)
    w.add_uint64("t.u64", 1 << 40)
    w.add_float64("t.f64", 0.1)
    w.add_string("t.str", "x" * 1000)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    src = GGUFSource(path)
    assert src.metadata == {
        "general.architecture": "llama",
        **arrays,
        "t.bool": True,
        "t.i8": -3,
        "t.u64": 1 << 40,
        "t.f64": 0.1,
        "t.str": "x" * 1000,
    }
    assert src.tensors == {} and not src.header_only
