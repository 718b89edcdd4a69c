"""GGUF block formats: our torch dequantizers and quantizers against the gguf package, bit for bit.

Dequantization of every format is compared with `gguf.quants.dequantize` on random valid blocks
and on blocks built to hit the edges (signed zeros, subnormal and extreme fp16 scales, every
byte value in every position, all 256 e8m0 exponents). Quantizers the gguf package also has must
write its bytes exactly; the K-quants (which it cannot write) must round-trip through its
dequantizer to what ours reads, with the error the format is known for.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_fidelity import ftw_decoder, greedy
from typer.testing import CliRunner

from ftkit.kernels.dequant import DEQUANTIZERS, dequantize, dequantize_q8_0
from ftkit.kernels.quantize import QUANTIZERS, quantize
from ftkit.runtime.checkpoint.gguf import GGUFSource
from ftkit.runtime.checkpoint.quant_presets import preset_formats
from ftkit.runtime.engine.generate import generate
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.memory import CPU_PRODUCTS, dense_device_bytes
from ftkit.runtime.engine.resolve import Machine, resolve
from ftkit.runtime.engine.sampling import SamplingParams
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.models import FAMILIES
from ftkit.runtime.models.block_table import BlockLinear, BlockTable, PlaneLinear
from ftkit.tools.convert.pipeline import convert, prepare
from ftkit.tools.diagnose.cli import app as diagnose_app
from ftkit.tools.diagnose.report import diagnose
from ftkit.vocab import (
    BLOCK_FORMATS,
    FORMATS,
    PLANE_FORMATS,
    FormatError,
    expert_layout,
    slot_layout,
    stored_nbytes,
)
from gguf_fixtures import (
    F16_FIELDS,
    dequantized_gguf,
    random_blocks,
    requantize_gguf,
    write_gguf_from_hf,
)

QT = gguf.GGMLQuantizationType
GGUF_QUANTIZES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4")  # gguf.quants.quantize has these
K_QUANTS = ("q4_k", "q5_k", "q6_k")
# fp16 scales at the edges: +0, -0, the smallest and largest subnormals of both signs, the
# smallest normal, 1, and the largest finite values.
EDGE_F16 = (0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF)


def gguf_dequantize(raw: np.ndarray, fmt: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, QT[fmt.upper()])


def ours(raw: np.ndarray, fmt: str) -> np.ndarray:
    return dequantize(torch.from_numpy(raw), fmt).numpy()


def test_every_gguf_block_format_is_registered():
    assert set(BLOCK_FORMATS) == set(DEQUANTIZERS) == set(F16_FIELDS)
    for fmt in BLOCK_FORMATS:
        f = FORMATS[fmt]
        assert (f.block, f.block_bytes) == gguf.GGML_QUANT_SIZES[QT[fmt.upper()]], fmt


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_dequantize_random_blocks_bitwise(fmt):
    rng = np.random.default_rng(0)
    for scale in (1e-3, 1.0, 300.0):
        raw = random_blocks(fmt, (3, 5, 4 * FORMATS[fmt].block), rng, scale)
        got, want = ours(raw, fmt), gguf_dequantize(raw, fmt)
        assert got.shape == want.shape == (3, 5, 4 * FORMATS[fmt].block)
        assert np.isfinite(want).all() and np.array_equal(got, want)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_dequantize_edge_blocks_bitwise(fmt):
    """Every byte value at every position of the block, under each edge scale (or each of the
    256 e8m0 exponents for mxfp4), so every nibble, bit field and packed scale is decoded."""
    nbytes = FORMATS[fmt].block_bytes
    raw = ((np.arange(256)[:, None] + 37 * np.arange(nbytes)[None, :]) % 256).astype(np.uint8)
    if fmt == "mxfp4":
        raw = np.repeat(raw[None], 256, axis=0)  # [exponent, pattern, byte]
        raw[..., 0] = np.arange(256, dtype=np.uint8)[:, None]
    else:
        raw = np.repeat(raw[None], len(EDGE_F16), axis=0)
        for off in F16_FIELDS[fmt]:
            raw[..., off : off + 2] = np.array(EDGE_F16, np.uint16)[:, None, None].view(np.uint8)
    with np.errstate(over="ignore"):  # mxfp4's top exponents times 6 overflow to inf, in both
        got, want = ours(raw, fmt), gguf_dequantize(raw, fmt)
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(want))  # -0.0 where gguf has -0.0
    if fmt == "mxfp4":
        assert np.isinf(want).any() and (want[1] != 0).any()  # overflow at the top, subnormals at 1


def test_dequantize_q8_0_keeps_its_contract():
    raw = random_blocks("q8_0", (2, 64), np.random.default_rng(1))
    assert np.array_equal(dequantize_q8_0(torch.from_numpy(raw)).numpy(), gguf_dequantize(raw, "q8_0"))


def test_bad_rows_are_one_clear_error():
    with pytest.raises(FormatError, match=r"q4_k rows must be uint8 with a last dimension divisible by 144"):
        dequantize(torch.zeros(2, 100, dtype=torch.uint8), "q4_k")
    with pytest.raises(FormatError, match="no dequantizer for weight format 'iq2_xxs'"):
        dequantize(torch.zeros(2, 66, dtype=torch.uint8), "iq2_xxs")
    with pytest.raises(FormatError, match=r"q6_k needs float rows with a last dimension divisible by 256"):
        quantize(torch.zeros(2, 64), "q6_k")
    with pytest.raises(FormatError, match="no quantizer for weight format 'iq4_xs'"):
        quantize(torch.zeros(2, 256), "iq4_xs")


def weights(rng: np.random.Generator, rows: int = 48, cols: int = 1024) -> np.ndarray:
    """Gaussian rows at scales from 1e-4 to 10, with the rows quantizers must not trip on: all
    zeros (of both signs), constant, all positive, all negative, one outlier."""
    x = (rng.standard_normal((rows, cols)) * np.logspace(-4, 1, rows)[:, None]).astype(np.float32)
    x[0], x[1] = 0.0, -0.0
    x[2] = 0.25
    x[3] = np.abs(x[3])
    x[4] = -np.abs(x[4])
    x[5, 7] = 50.0
    return x


@pytest.mark.parametrize("fmt", GGUF_QUANTIZES)
def test_quantize_matches_gguf_bitwise(fmt):
    rng = np.random.default_rng(2)
    x = weights(rng)
    # values on rounding boundaries: multiples of half a q8_0/q4_0 step
    x[6] = np.round(rng.uniform(-127, 127, x.shape[1])) / 2 * np.float32(0.01)
    got = quantize(torch.from_numpy(x), fmt).numpy()
    assert np.array_equal(got, gguf.quants.quantize(x, QT[fmt.upper()]))
    assert np.array_equal(ours(got, fmt), gguf_dequantize(got, fmt))


def test_mxfp4_exponent_at_powers_of_two():
    """The e8m0 exponent is floor(log2(amax)): exact at and next to every power of two."""
    k = np.arange(-100, 100, dtype=np.float32)
    amax = np.concatenate([2.0**k, np.nextafter(2.0**k, 0), np.nextafter(2.0**k, np.inf)]).astype(np.float32)
    x = np.zeros((len(amax), 32), np.float32)
    x[:, 0] = amax
    got = quantize(torch.from_numpy(x), "mxfp4").numpy()
    assert np.array_equal(got, gguf.quants.quantize(x, QT.MXFP4))


# Relative RMS error (||dequant(quant(x)) - x|| / ||x||) on Gaussian rows, as measured: q8_0
# 0.0054, q4_0 0.086, q4_1 0.078, q5_0 0.043, q5_1 0.038, mxfp4 0.115, q4_k 0.071, q5_k 0.036,
# q6_k 0.018. The bounds leave about 10% either way.
RMS_BOUNDS = {
    "q8_0": (0.0048, 0.0060), "q4_0": (0.078, 0.095), "q4_1": (0.070, 0.086), "q5_0": (0.038, 0.047),
    "q5_1": (0.034, 0.042), "mxfp4": (0.104, 0.127), "q4_k": (0.064, 0.079), "q5_k": (0.032, 0.040),
    "q6_k": (0.016, 0.020),
}  # fmt: skip


@pytest.mark.parametrize("fmt", list(RMS_BOUNDS))
def test_quantizer_error_is_the_formats(fmt):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((32, 1024)) * np.logspace(-3, 1, 32)[:, None]).astype(np.float32)
    back = ours(quantize(torch.from_numpy(x), fmt).numpy(), fmt)
    rel = np.sqrt(((back - x) ** 2).mean(axis=1) / (x**2).mean(axis=1))
    lo, hi = RMS_BOUNDS[fmt]
    assert lo < float(np.median(rel)) < hi and rel.max() < 1.1 * hi, (np.median(rel), rel.max())


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quant_round_trip(fmt):
    """Our K-quant blocks read back by gguf's dequantizer equal what ours reads, bit for bit;
    zero rows stay exactly zero, a constant row and an outlier come back close."""
    x = weights(np.random.default_rng(4))
    raw = quantize(torch.from_numpy(x), fmt).numpy()
    assert raw.shape == (x.shape[0], x.shape[1] // 256 * FORMATS[fmt].block_bytes)
    back = gguf_dequantize(raw, fmt)
    assert np.array_equal(ours(raw, fmt), back)
    assert not back[:2].any()
    assert np.abs(back[2] - 0.25).max() < 0.25 * 0.02
    assert abs(back[5, 7] - 50.0) < 50.0 * 0.02


def test_quantize_keeps_leading_dimensions_and_dtypes():
    x = torch.randn(2, 3, 512, dtype=torch.bfloat16)
    raw = quantize(x, "q4_k")
    assert raw.dtype == torch.uint8 and raw.shape == (2, 3, 2 * 144)
    assert torch.equal(quantize(x.float(), "q4_k"), raw)
    assert dequantize(raw, "q4_k").shape == (2, 3, 512)
    assert set(QUANTIZERS) == {*GGUF_QUANTIZES, *K_QUANTS}


# ---- quantized GGUF models: ft-diagnose, ftw-convert, and the same tokens as float32 ---------
def test_q4_k_m_layout():
    """llama-quantize's Q4_K_M, as runtime/checkpoint/quant_presets.py lays it out for an MoE model."""
    shapes = {"token_embd.weight": (320, 256), "output_norm.weight": (256,), "output.weight": (320, 256)}
    for i in range(8):
        shapes |= {f"blk.{i}.attn_norm.weight": (256,), f"blk.{i}.attn_v.weight": (128, 256),
                   f"blk.{i}.attn_k.weight": (128, 256), f"blk.{i}.attn_output.weight": (256, 256),
                   f"blk.{i}.ffn_gate_inp.weight": (4, 256), f"blk.{i}.ffn_gate_exps.weight": (4, 256, 256),
                   f"blk.{i}.ffn_down_exps.weight": (4, 256, 256), f"blk.{i}.ffn_down_shexp.weight": (256, 256),
                   f"blk.{i}.ffn_gate_inp_shexp.weight": (1, 256)}
    got = preset_formats("q4_k_m", shapes, n_layer=8, n_expert=4)
    more = [0, 3, 6, 7]  # use_more_bits over 8 layers: the first and last eighth, every third between
    for i in range(8):
        bits = "q6_k" if i in more else "q4_k"
        assert [got[f"blk.{i}.{n}.weight"] for n in ("attn_v", "ffn_down_exps", "ffn_down_shexp")] == [bits] * 3
        assert [got[f"blk.{i}.{n}.weight"] for n in ("attn_k", "attn_output", "ffn_gate_exps")] == ["q4_k"] * 3
        assert got[f"blk.{i}.ffn_gate_inp.weight"] is got[f"blk.{i}.ffn_gate_inp_shexp.weight"] is None
    assert (got["token_embd.weight"], got["output.weight"], got["output_norm.weight"]) == ("q4_k", "q6_k", None)
    # eight experts: Mixtral's bumps; rows of 64 fall back to 32-weight blocks, rows of 48 to F16
    narrow = {"output.weight": (320, 64), "blk.0.attn_v.weight": (32, 64), "blk.0.attn_output.weight": (64, 64),
              "blk.0.ffn_down_exps.weight": (8, 64, 32), "blk.0.ffn_up_exps.weight": (8, 32, 64),
              "blk.0.ffn_down_shexp.weight": (64, 48)}
    assert preset_formats("q4_k_m", narrow, n_layer=2, n_expert=8) == {
        "output.weight": "q8_0", "blk.0.attn_v.weight": "q8_0", "blk.0.attn_output.weight": "q5_1",
        "blk.0.ffn_down_exps.weight": "q5_0", "blk.0.ffn_up_exps.weight": "q5_0",
        "blk.0.ffn_down_shexp.weight": "float16"}
    narrow.pop("blk.0.ffn_down_shexp.weight")  # Q8_0 has no fallback: llama-quantize refuses such rows
    assert preset_formats("mxfp4_moe", narrow, n_layer=2, n_expert=8)["blk.0.ffn_up_exps.weight"] == "mxfp4"
    with pytest.raises(FormatError, match="row length 48 does not split into q8_0 blocks of 32"):
        preset_formats("q8_0", {"blk.0.ffn_down_shexp.weight": (64, 48)}, n_layer=2, n_expert=8)


# Quantized files: (tiny checkpoint, how its tensors are stored). "every format" stores the
# quantizable tensors of a 256-wide Mixtral in each block format in turn, dense and experts.
QUANT_MODELS = {"qwen3_moe_wide-q4_k_m": ("qwen3_moe_wide", "q4_k_m"),
                "mixtral_wide-every": ("mixtral_wide", "every"),
                "olmoe-q4_k_m": ("olmoe", "q4_k_m")}  # 64-wide rows: the 32-weight fallbacks


@pytest.fixture(scope="module")
def quant_gguf(hf_checkpoint, tmp_path_factory):
    """`quant_gguf(key) -> (quantized GGUF, the same dequantized to F32 by gguf)`, cached."""
    root = tmp_path_factory.mktemp("quant-gguf")
    built: dict[str, tuple[Path, Path]] = {}

    def get(key: str) -> tuple[Path, Path]:
        if key not in built:
            name, how = QUANT_MODELS[key]
            f32 = root / f"{key}-f32.gguf"
            write_gguf_from_hf(hf_checkpoint(name), f32, "F32")
            src = GGUFSource(f32)
            shapes = {n: r.shape for n, r in src.tensors.items()}
            if how == "every":
                quantizable = [n for n, f in preset_formats("q8_0", shapes, 2, 4).items() if f]
                formats = {n: BLOCK_FORMATS[i % len(BLOCK_FORMATS)] for i, n in enumerate(quantizable)}
            else:
                arch = src.metadata["general.architecture"]
                formats = preset_formats(how, shapes, src.metadata[f"{arch}.block_count"],
                                         src.metadata[f"{arch}.expert_count"])
            q = requantize_gguf(f32, root / f"{key}.gguf", formats)
            built[key] = q, dequantized_gguf(q, root / f"{key}-dequantized.gguf")
        return built[key]

    return get


def expert_formats(path: Path) -> list[str]:
    return sorted({r.dtype for n, r in GGUFSource(path).tensors.items() if "_exps" in n})


def gguf_layer_formats(path: Path) -> list[tuple[str, str, str]]:
    """Each layer's expert formats in the GGUF file: (gate, up, down), by layer."""
    tensors = GGUFSource(path).tensors
    layers = sorted({int(n.split(".")[1]) for n in tensors if "_exps" in n})
    return [tuple(tensors[f"blk.{i}.ffn_{p}_exps.weight"].dtype for p in ("gate", "up", "down")) for i in layers]


@pytest.mark.parametrize("key", list(QUANT_MODELS))
def test_diagnose_passes_and_prices_the_quantized_bytes(quant_gguf, key):
    path, _ = quant_gguf(key)
    r = diagnose(path)
    stored = expert_formats(path)
    assert r["verdict"] == "PASS", r["problems"]
    assert r["expert_dtype"] == "/".join(stored)
    spec = prepare(path).spec
    layout = expert_layout(spec, gguf_layer_formats(path))
    assert r["memory"]["expert_formats"] == stored == list(layout.formats)
    assert r["memory"]["expert_slot_bytes"] == layout.slot_bytes < slot_layout(spec, "bfloat16").slot_bytes
    assert r["memory"]["expert_data_bytes"] == max(lay.data_bytes for lay in layout.layers)
    assert r["memory"]["host_expert_pool_bytes"] == spec.num_expert_rows * layout.slot_bytes
    assert r["memory"]["expert_dtype"] == layout.describe()
    assert not [n for n in r["notes"] if "cpu strategy only" in n]  # the GPU kernels read blocks too
    # the GPU keeps the embedding table (not tied to lm_head here) in its blocks, and lm_head where
    # the block GEMV takes its format: priced at those bytes
    family, tensors = FAMILIES[spec.family], GGUFSource(path).tensors
    kept = {"embed.weight": tensors["token_embd.weight"]}
    if tensors["output.weight"].dtype in PLANE_FORMATS and tensors["output.weight"].shape[-1] % 256 == 0:
        kept["lm_head.weight"] = tensors["output.weight"]
    assert "output.weight" in tensors and kept["embed.weight"].dtype in BLOCK_FORMATS
    as_bf16 = sum(2 * int(np.prod(s)) for n, s in family.dense_shapes(spec).items() if not n.endswith(family.float32_suffixes))
    as_f32 = sum(4 * int(np.prod(s)) for n, s in family.dense_shapes(spec).items() if n.endswith(family.float32_suffixes))
    saved = sum(2 * int(np.prod(t.shape)) - stored_nbytes(t.dtype, tuple(t.shape)) for t in kept.values())
    assert r["memory"]["dense_bytes"] == as_bf16 + as_f32 - saved
    assert "PASS" in " ".join(CliRunner().invoke(diagnose_app, [str(path)]).output.split())


def test_every_format_is_in_the_every_format_model(quant_gguf):
    path, _ = quant_gguf("mixtral_wide-every")
    stored = {r.dtype for r in GGUFSource(path).tensors.values()}
    assert set(BLOCK_FORMATS) <= stored
    assert len(expert_formats(path)) >= 4 and {"q2_k", "iq4_xs"} & set(expert_formats(path))


@pytest.mark.parametrize("key", ["qwen3_moe_wide-q4_k_m", "mixtral_wide-every"])
def test_ftw_convert_keeps_the_expert_blocks(quant_gguf, tmp_path, key):
    """Without --dtype every expert part keeps its GGUF bytes, layer by layer and part by part,
    and so do the dense tensors stored in blocks (FTW v3), one line says so; loaded, those are
    the gguf package's dequantization of them, bit for bit."""
    path, ref_path = quant_gguf(key)
    out = tmp_path / "m.ftw"
    r = subprocess.run([sys.executable, "-m", "ftkit.tools.convert", str(path), "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert text.count("stay in those blocks (FTW v3): a GPU keeps the embedding table in them (and lm_head") == 1
    model = FTWModel(out)
    assert [lay.formats for lay in model.layout.layers] == gguf_layer_formats(path)
    listed = model.manifest.dense["tensors"]
    assert {t["dtype"] for t in listed.values()} & set(BLOCK_FORMATS)  # the fixture quantizes dense tensors
    assert (out / "dense.safetensors").stat().st_size < sum(4 * int(np.prod(t["shape"])) for t in listed.values())
    dense, ref = model.dense_state(), FTWModel(_converted(ref_path, tmp_path / "r.ftw")).dense_state()
    assert dense.keys() == ref.keys() and all(torch.equal(dense[n], ref[n]) for n in dense)
    assert all(t.dtype == torch.float32 for n, t in dense.items() if listed[n]["dtype"] in BLOCK_FORMATS)
    source, spec = GGUFSource(path), model.spec
    banks = model.read_banks(pin=False)
    for moe, layer in enumerate(spec.moe_layers):
        for part in ("gate", "up", "down"):
            stored = source.read(f"blk.{layer}.ffn_{part}_exps.weight")  # [E, rows, row bytes] as stored
            for e in range(spec.num_experts):
                assert torch.equal(banks.parts(moe * spec.num_experts + e)[part], stored[e]), (layer, part, e)
    r = diagnose(out)  # the FTW directory: its own slots' formats and bytes
    assert r["verdict"] == "PASS", r["problems"]
    assert r["expert_dtype"] == r["memory"]["expert_dtype"] == model.layout.describe()
    assert r["memory"]["host_expert_pool_bytes"] == banks.nbytes == spec.num_expert_rows * model.layout.slot_bytes


def _converted(path: Path, out: Path, dtype: str | None = None) -> Path:
    convert(prepare(path, dtype=dtype), out)
    return out


@pytest.mark.parametrize("key", ["qwen3_moe_wide-q4_k_m", "mixtral_wide-every"])
def test_greedy_tokens_equal_the_dequantized_model(quant_gguf, tmp_path, key):
    """Converted at float32, the quantized GGUF is the gguf package's dequantization of it,
    tensor for tensor and bit for bit, so it decodes the same tokens with the same logits."""
    path, ref_path = quant_gguf(key)
    ours, ref = FTWModel(_converted(path, tmp_path / "q.ftw", "float32")), FTWModel(_converted(ref_path, tmp_path / "r.ftw"))
    a, b = ours.dense_state(), ref.dense_state()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    banks, ref_banks = ours.read_banks(pin=False), ref.read_banks(pin=False)
    for row in range(ours.spec.num_expert_rows):
        assert all(torch.equal(t, ref_banks.parts(row)[p]) for p, t in banks.parts(row).items()), row
    with torch.no_grad():
        tokens, logits = greedy(ftw_decoder(tmp_path / "q.ftw"))
        ref_tokens, ref_logits = greedy(ftw_decoder(tmp_path / "r.ftw"))
    assert tokens == ref_tokens and len(set(tokens)) > 1
    assert all(torch.equal(x, y) for x, y in zip(logits, ref_logits, strict=True))


@pytest.mark.parametrize("key", ["qwen3_moe_wide-q4_k_m", "mixtral_wide-every", "olmoe-q4_k_m"])
def test_cpu_strategy_on_the_blocks_decodes_the_dequantized_twins_tokens(quant_gguf, tmp_path, key):
    """The converted blocks run on the cpu strategy at float32 (the CPU kernel reading them as
    they are) give the greedy tokens of the gguf package's float32 dequantization of the same
    file, converted and run the same way (the kernel's products are those of the float32 slots
    bit for bit)."""
    path, ref_path = quant_gguf(key)
    q, ref = _converted(path, tmp_path / "q.ftw"), _converted(ref_path, tmp_path / "r.ftw")
    assert set(FTWModel(q).layout.formats) <= set(BLOCK_FORMATS) and FTWModel(ref).layout.dtype == "float32"
    prompt = [3, 17, 5, 42, 8, 11, 29, 2, 40, 7] * 2  # 20 tokens: experts past one pass of 8 (the tile path)
    runs = []
    for ftw in (q, ref):
        rt = Runtime(ftw, RuntimeOptions(device="cpu", strategy="cpu", dtype="float32"))
        runs.append(generate(rt, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)).token_ids)
        rt.close()
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_torch_path_runs_the_blocks_dequantized_per_expert(quant_gguf, tmp_path, monkeypatch):
    """Without the compiled kernel each expert is dequantized (kernels/dequant.py) as it runs:
    the same bits as its dequantized float32 twin on the same path."""
    from ftkit.kernels.cpu import load

    path, ref_path = quant_gguf("qwen3_moe_wide-q4_k_m")
    q, ref = _converted(path, tmp_path / "q.ftw"), _converted(ref_path, tmp_path / "r.ftw")
    monkeypatch.setenv("FTKIT_CPU_KERNEL", "torch")
    load.cache_clear()
    try:
        runs = []
        for ftw in (q, ref):
            rt = Runtime(ftw, RuntimeOptions(device="cpu", strategy="cpu", dtype="float32"))
            assert rt.store.kernels.kernel is None
            runs.append(generate(rt, [3, 17, 5, 42, 8], SamplingParams(max_tokens=6, ignore_eos=True)).token_ids)
            rt.close()
    finally:
        load.cache_clear()
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


@pytest.mark.parametrize("key", ["qwen3_moe_wide-q4_k_m", "mixtral_wide-every"])
def test_a_gpu_keeps_the_embedding_table_in_its_blocks(quant_gguf, tmp_path, key):
    """A GPU's plan keeps the embedding table in its GGUF blocks (models/block_table.py), priced
    at those bytes, and lm_head where the block GEMV takes its format (Q4_K, Q6_K, Q8_0), the rest
    dequantized at load; a CPU's plan at bfloat16 keeps the attention projections and lm_head too
    (multiplied by the CPU kernel), at float32 (the exact reference) none. Looked up row by row
    (here on the CPU), the table gives the tokens of the model loaded dequantized."""
    path, _ = quant_gguf(key)
    ftw = FTWModel(_converted(path, tmp_path / "q.ftw"))
    listed = ftw.manifest.dense["tensors"]
    want = {"embed.weight": listed["embed.weight"]["dtype"]}
    assert want["embed.weight"] in BLOCK_FORMATS and "lm_head.weight" in listed  # the fixture: untied, quantized
    opts = RuntimeOptions(strategy="offload", cache_experts=8, dtype="bfloat16")
    gpu = resolve(ftw, dataclasses.replace(opts, device="cuda"), Machine(torch.device("cuda"), free_bytes=64 << 30))
    cpu16 = resolve(ftw, dataclasses.replace(opts, strategy="cpu"), Machine(torch.device("cpu"), free_bytes=64 << 30))
    cpu = resolve(ftw, dataclasses.replace(opts, strategy="cpu", dtype="float32"),
                  Machine(torch.device("cpu"), free_bytes=64 << 30))
    products = {n: t["dtype"] for n, t in listed.items() if t["dtype"] in BLOCK_FORMATS and CPU_PRODUCTS.fullmatch(n)}
    head = listed["lm_head.weight"]
    gpu_head = {"lm_head.weight": head["dtype"]} if head["dtype"] in PLANE_FORMATS and head["shape"][-1] % 256 == 0 else {}
    assert gpu_head or key == "mixtral_wide-every"  # Q4_K_M's lm_head is Q6_K
    assert gpu.blocks == want | gpu_head and cpu.blocks == {} and cpu16.blocks == want | products
    assert "lm_head.weight" in products
    floats = dense_device_bytes({n: t["shape"] for n, t in listed.items()}, torch.bfloat16, ftw.spec.family)
    assert floats - gpu.memory.dense_bytes == sum(2 * int(np.prod(listed[n]["shape"]))
                                                  - stored_nbytes(f, tuple(listed[n]["shape"]))
                                                  for n, f in (want | gpu_head).items()) > 0
    assert cpu16.memory.dense_bytes < gpu.memory.dense_bytes
    prompt = [3, 17, 5, 42, 8, 11, 29, 2, 40, 7]
    runs = []
    for r in (cpu, dataclasses.replace(cpu, blocks=want)):
        rt = Runtime(ftw, r)
        assert isinstance(rt.decoder.w["embed.weight"], BlockTable) == bool(r.blocks)
        runs.append(generate(rt, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)).token_ids)
        rt.close()
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_the_loader_dequantizes_blocks_a_slice_at_a_time(quant_gguf, tmp_path, monkeypatch):
    """Loaded at bf16, a dense tensor stored in blocks and not kept so (`Resolved.blocks`) is
    dequantized into bf16 a few rows at a time (never whole in float32): bit for bit its float32
    dequantization cast to bf16; the float32-kept tensors stay float32."""
    path, _ = quant_gguf("qwen3_moe_wide-q4_k_m")
    ftw = FTWModel(_converted(path, tmp_path / "q.ftw"))
    monkeypatch.setattr("ftkit.kernels.dequant.CHUNK_WEIGHTS", 256 * 3)  # three rows of 256 at once
    r = resolve(ftw, RuntimeOptions(device="cpu", strategy="cpu", dtype="bfloat16"), Machine.detect("cpu"))
    rt = Runtime(ftw, dataclasses.replace(r, blocks={}, cpu_products=False))  # every dense tensor a tensor
    full, blocks = ftw.dense_state(), [n for n, r in ftw.dense_refs.items() if r.dtype in BLOCK_FORMATS]
    assert blocks and all(rt.decoder.w[n].dtype == torch.bfloat16 for n in blocks)
    assert all(torch.equal(t, full[n].to(t.dtype)) for n, t in rt.decoder.w.items())
    rt.close()


@pytest.mark.parametrize("int8", [False, True])
def test_cpu_products_on_blocks_are_the_products_with_the_dequantized_weight(int8):
    """The CPU kernel's product on a weight's GGUF rows (`Kernel.linear`, what `BlockLinear`
    runs): the float32 path is F.linear with the dequantized weight up to summation order; the
    int8 path (activations quantized per 256, as the experts' int8 path) within its error."""
    from ftkit.kernels.cpu import load

    kernel = load()
    if kernel is None:
        pytest.skip("no compiled CPU kernel")
    gen = torch.Generator().manual_seed(5)
    for fmt in ("q4_k", "q6_k", "q8_0", "q5_k", "iq4_nl", "mxfp4", "q4_0", "bfloat16"):
        w = torch.randn(130, 512, generator=gen) * 0.05
        raw = w.to(torch.bfloat16).view(torch.uint8) if fmt == "bfloat16" else quantize(w, fmt) \
            if fmt in QUANTIZERS else torch.from_numpy(random_blocks(fmt, (130, 512), np.random.default_rng(5), scale=0.01))
        deq = raw.view(torch.bfloat16).float() if fmt == "bfloat16" else dequantize(raw, fmt)
        x = torch.randn(11, 512, generator=gen)
        want = torch.nn.functional.linear(x, deq.reshape(130, 512))
        got = kernel.linear(raw.reshape(130, -1).contiguous(), fmt, (130, 512), x, 2, int8=int8)
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < (2e-2 if int8 else 1e-6), (fmt, err)
    with pytest.raises(ValueError, match="cannot multiply q4_k rows of 100 weights"):
        kernel.linear(torch.zeros(2, 100, dtype=torch.uint8), "q4_k", (2, 100), torch.zeros(1, 100), 1)


def test_a_cpu_at_bfloat16_multiplies_attention_and_lm_head_in_their_blocks(quant_gguf, tmp_path):
    """At bf16 on a CPU the attention projections and lm_head stay in their blocks (`BlockLinear`),
    the routers' bf16 rows go to the CPU kernel too, and the model's logits stay close to those
    with every dense tensor dequantized."""
    path, _ = quant_gguf("qwen3_moe_wide-q4_k_m")
    ftw = FTWModel(_converted(path, tmp_path / "q.ftw"))
    r = resolve(ftw, RuntimeOptions(device="cpu", strategy="cpu", dtype="bfloat16"), Machine.detect("cpu"))
    logits = []
    for plan in (r, dataclasses.replace(r, blocks={})):
        rt = Runtime(ftw, plan)
        kept = [n for n, t in rt.decoder.w.items() if isinstance(t, BlockLinear)]
        routers = [f"layers.{i}.router.weight" for i in rt.spec.moe_layers]
        assert sorted(kept) == sorted([n for n in plan.blocks if n != "embed.weight"] + routers)
        assert all(rt.decoder.w[n].fmt == "bfloat16" for n in routers)
        with torch.inference_mode():
            logits.append(rt.step.forward(torch.tensor([3, 17, 5, 42, 8]), rt.new_kv(8))[-1].float())
        rt.close()
    assert "lm_head.weight" in r.blocks
    assert ((logits[0] - logits[1]).abs().max() / logits[1].abs().max()).item() < 0.05


def test_block_table_rows_are_the_dequantized_rows():
    """An embedding row looked up in the blocks is the dequantized row cast to the compute dtype,
    bit for bit, whatever the shape of the ids and however many rows are decoded at once."""
    gen = torch.Generator().manual_seed(4)
    for fmt in ("q4_k", "q6_k", "q8_0", "iq4_nl", "mxfp4"):
        raw = quantize(torch.randn(300, 512, generator=gen), fmt) if fmt in QUANTIZERS else torch.from_numpy(
            random_blocks(fmt, (300, 512), np.random.default_rng(4), scale=0.01))
        table = BlockTable(raw, fmt, (300, 512), torch.bfloat16)
        ids = torch.tensor([[0, 299, 7], [7, 150, 1]])
        want = torch.nn.functional.embedding(ids, dequantize(raw, fmt).to(torch.bfloat16))
        assert torch.equal(table.rows(ids), want)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("ftkit.kernels.dequant.CHUNK_WEIGHTS", 512 * 4)  # two pieces, the last short
            assert torch.equal(table.rows(ids), want)
        assert table.nbytes == raw.numel() and table.device == raw.device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_on_a_gpu_the_table_in_blocks_decodes_as_the_dequantized_one(quant_gguf, tmp_path, graphs):
    """On CUDA the embedding table and the Q6_K lm_head stay in their blocks (the table's rows
    decoded, lm_head multiplied by the block GEMV, inside the captured step too): the greedy
    tokens of the same model with them dequantized at load."""
    path, _ = quant_gguf("qwen3_moe_wide-q4_k_m")
    ftw = FTWModel(_converted(path, tmp_path / "q.ftw"))
    opts = RuntimeOptions(device="cuda", strategy="hybrid", cache_experts=8, bandwidth_ratio=1.0, graphs=graphs)
    r = resolve(ftw, opts)
    assert r.blocks == {"embed.weight": "q4_k", "lm_head.weight": "q6_k"} and r.dtype == torch.bfloat16
    prompt, params = [3, 17, 5, 42, 8, 11, 29, 2, 40, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs = []
    for resolved in (r, dataclasses.replace(r, blocks={})):
        rt = Runtime(ftw, resolved)
        assert isinstance(rt.decoder.w["embed.weight"], BlockTable) == bool(resolved.blocks)
        assert isinstance(rt.decoder.lm_head, PlaneLinear) == bool(resolved.blocks)
        runs.append(generate(rt, prompt, params).token_ids)
        rt.close()
    assert runs[0] == runs[1] and len(set(runs[0])) > 1
