"""GGUF block formats: our torch dequantizers and quantizers against the gguf package, bit for bit.

Dequantization of every format is compared with `gguf.quants.dequantize` on random valid blocks
and on blocks built to hit the edges (signed zeros, subnormal and extreme fp16 scales, every
byte value in every position, all 256 e8m0 exponents). Quantizers the gguf package also has must
write its bytes exactly; the K-quants (which it cannot write) must round-trip through its
dequantizer to what ours reads, with the error the format is known for.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from ftkit.kernels.dequant import DEQUANTIZERS, dequantize, dequantize_q8_0
from ftkit.kernels.quantize import QUANTIZERS, quantize
from ftkit.vocab import BLOCK_FORMATS, FORMATS, FormatError
from gguf_fixtures import F16_FIELDS, random_blocks

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
