"""Float rows to GGUF block formats in torch: what `ftw-convert --quantize` and the tests write.

`quantize(x, fmt)` takes float rows `[..., nblocks * block]` and returns raw uint8 rows
`[..., nblocks * block_bytes]` in ggml's layout (kernels/dequant.py reads them back). Every step
is vectorized over all blocks, a bounded number of blocks at a time, on torch's threads.

q8_0, q4_0, q4_1, q5_0, q5_1 and mxfp4 are the gguf package's quantizers (`gguf.quants.quantize`)
operation for operation in float32, so their bytes are the same bit for bit. The K-quants follow
ggml's reference quantizers without an importance matrix (`quantize_row_q4_K_ref` and its
`make_qkx2_quants` search, `quantize_row_q6_K_ref` and `make_qx_quants`), which is what
llama-quantize runs when no imatrix is given: the same trial scales in the same order, the same
float32 formulas, rounding (`nearest_int` is round-half-to-even, as `torch.round`) and tie
rules, each sum added left to right as C's loops add. So the bytes are those of ggml's reference
compiled to strict IEEE float32 (they matched a scalar float32 transliteration of it on every
block tried; the gguf package has no K-quant quantizer to compare with). A ggml build that fuses
`a * b + c` into one rounding (GCC's default on FMA machines) can decide a search's near-tie the
other way and pick the neighbouring scale.

The K-quants and mxfp4 also have a C++ twin (kernels/cpu/quantize.cpp, the same operations in
the same order, on CPU threads), which `quantize` uses for CPU tensors where it builds: in torch
a qwen3-30b-a3b expert matrix took 3.4 s as Q4_K on two threads. Tests hold the two to the
same bytes.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ftkit.vocab import FORMATS, FormatError

from .dequant import E2M1_LEVELS_X2, e8m0_half

CHUNK_BLOCKS = 1 << 16  # blocks quantized at once: bounds the K-quant searches' temporaries
Quantizer = Callable[[torch.Tensor], torch.Tensor]
QUANTIZERS: dict[str, Quantizer] = {}


NATIVE_CODES = {"q4_k": 0, "q5_k": 1, "q6_k": 2, "mxfp4": 3}  # quantize.cpp's `ftq_quantize` codes


def quantize(x: torch.Tensor, fmt: str, threads: int | None = None) -> torch.Tensor:
    """Float rows `[..., nblocks * block]` to raw `fmt` rows `[..., nblocks * block_bytes]`
    (the C++ twin on `threads`, default torch's, where it applies)."""
    if fmt not in QUANTIZERS:
        raise FormatError(f"no quantizer for weight format {fmt!r}")
    if fmt in NATIVE_CODES and x.device.type == "cpu" and _native() is not None:
        return quantize_native(x, fmt, threads)
    return QUANTIZERS[fmt](x)


@functools.cache
def _native() -> ctypes.CDLL | None:
    """quantize.cpp built and loaded (None, warned once, without a compiler or with
    FTKIT_CPU_KERNEL=torch: the torch quantizers then run)."""
    from .cpu import build

    if os.environ.get("FTKIT_CPU_KERNEL") == "torch":
        return None
    try:
        lib = ctypes.CDLL(str(build(source=Path(__file__).with_name("cpu") / "quantize.cpp")))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        warnings.warn(f"ftkit: native quantizer unavailable, quantizing in torch ({e})", RuntimeWarning, stacklevel=2)
        return None
    lib.ftq_quantize.restype = ctypes.c_int
    lib.ftq_quantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    return lib


def quantize_native(x: torch.Tensor, fmt: str, threads: int | None = None) -> torch.Tensor:
    """`quantize` by quantize.cpp (the ctypes call releases the GIL); raises RuntimeError where
    it cannot be built."""
    lib, f = _native(), FORMATS[fmt]
    if lib is None:
        raise RuntimeError("the native quantizer is not available here")
    if not x.is_floating_point() or x.ndim == 0 or x.shape[-1] % f.block:
        raise FormatError(f"{fmt} needs float rows with a last dimension divisible by {f.block}, "
                          f"got {x.dtype} {tuple(x.shape)}")
    blocks = x.reshape(-1, f.block).to(torch.float32).contiguous()
    out = torch.empty(blocks.shape[0], f.block_bytes, dtype=torch.uint8)
    lib.ftq_quantize(NATIVE_CODES[fmt], blocks.data_ptr(), blocks.shape[0], out.data_ptr(),
                     threads or torch.get_num_threads())
    return out.reshape(*x.shape[:-1], x.shape[-1] // f.block * f.block_bytes)


def _rows(fmt: str) -> Callable[[Quantizer], Quantizer]:
    """Register a float32 blocks `[n, block]` -> uint8 `[n, block_bytes]` function as `fmt`'s."""
    f = FORMATS[fmt]

    def register(per_block: Quantizer) -> Quantizer:
        @functools.wraps(per_block)
        def rows(x: torch.Tensor) -> torch.Tensor:
            if not x.is_floating_point() or x.ndim == 0 or x.shape[-1] % f.block:
                raise FormatError(
                    f"{fmt} needs float rows with a last dimension divisible by {f.block}, "
                    f"got {x.dtype} {tuple(x.shape)}"
                )
            blocks = x.reshape(-1, f.block).to(torch.float32)
            out = torch.empty(blocks.shape[0], f.block_bytes, dtype=torch.uint8, device=x.device)
            for start in range(0, blocks.shape[0], CHUNK_BLOCKS):
                out[start : start + CHUNK_BLOCKS] = per_block(blocks[start : start + CHUNK_BLOCKS])
            return out.reshape(*x.shape[:-1], x.shape[-1] // f.block * f.block_bytes)

        QUANTIZERS[fmt] = rows
        return rows

    return register


# ---- pieces ----------------------------------------------------------------------------------
def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 `[n, 1]` to fp16 bytes `[n, 2]`, rounded to nearest even (GGML_FP32_TO_FP16)."""
    return v.to(torch.float16).contiguous().view(torch.uint8)


def _f16_round(v: torch.Tensor) -> torch.Tensor:
    """The float32 a value becomes once stored as fp16 and read back (GGML_FP16_TO_FP32)."""
    return v.to(torch.float16).to(torch.float32)


def _over(numerator: float, t: torch.Tensor) -> torch.Tensor:
    """`numerator / t` correctly rounded: torch turns `number / tensor` into `number * (1 / t)`,
    which rounds twice, so divide by a tensor of the numerator instead."""
    return torch.full_like(t, numerator) / t


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """`1 / d`, or 0 where d is 0 (ggml's `id = d ? 1.0f/d : 0.0f`)."""
    return torch.where(d == 0, 0.0, 1 / torch.where(d == 0, 1.0, d))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Values `[..., 2, k]` under 16 to bytes `[..., k]`: the first row low, the second high."""
    q = q.to(torch.uint8)
    return q[..., 0, :] | (q[..., 1, :] << 4)


def _pack_bits(q: torch.Tensor, width: int) -> torch.Tensor:
    """`width`-bit fields `[..., 8 // width, k]` to bytes `[..., k]`, the first field lowest."""
    shifts = torch.arange(0, 8, width, dtype=torch.int32, device=q.device).reshape(-1, 1)
    return (q.to(torch.int32) << shifts).sum(dim=-2).to(torch.uint8)


def _round_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (half away from zero), exactly: floor(|v| + 0.5) would round 0.49999997 up."""
    a = v.abs()
    whole = torch.floor(a)
    return torch.sign(v) * (whole + torch.floor(2 * (a - whole)))


def _abs_max_signed(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The value of largest magnitude along `dim` (kept, size 1), sign kept, the first on ties."""
    return x.gather(dim, x.abs().argmax(dim=dim, keepdim=True))


def _f32(v: float) -> float:
    """`v` rounded to float32: a constant as C computes it from float operands (`0.1f * is`)."""
    return float(np.float32(v))


def _seqsum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the first dimension `[n, ...]` -> `[1, ...]` in order, as ggml's loops add: the
    searches compare sums that differ in their last bits, so the order decides ties. (The fits
    keep a sub-block's weights along dimension 0, so each term is one contiguous slice.)"""
    acc = t[0].clone()
    for term in t[1:]:
        acc += term
    return acc.unsqueeze(0)


# ---- 32-weight blocks, as the gguf package writes them ---------------------------------------
@_rows("q8_0")
def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(dim=-1, keepdim=True) / 127
    q = _round_away(x * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat((_f16_bytes(d), q), dim=-1)


def _symmetric(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_0/q5_0: d = (largest-magnitude value) / -levels/2, q = trunc(x / d + levels/2 + 0.5)."""
    d = _abs_max_signed(x) / -(levels // 2)
    q = torch.trunc(x * _inverse(d) + (levels // 2 + 0.5)).clamp(0, levels - 1)
    return d, q


def _asymmetric(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q4_1/q5_1: m = min, d = (max - min) / (levels - 1), q = trunc((x - m) / d + 0.5)."""
    lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    d = (hi - lo) / (levels - 1)
    q = torch.trunc((x - lo) * _inverse(d) + 0.5).clamp(0, levels - 1)
    return d, lo, q


def _q5_tail(q: torch.Tensor) -> torch.Tensor:
    """5-bit values `[n, 32]` to a q5 block's tail: 4 bytes of high bits, 16 of low nibbles."""
    q = q.to(torch.uint8)
    high = _pack_bits((q >> 4).reshape(-1, 4, 8).transpose(1, 2), 1)
    return torch.cat((high, _pack_nibbles((q & 0x0F).reshape(-1, 2, 16))), dim=-1)


@_rows("q4_0")
def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    d, q = _symmetric(x, 16)
    return torch.cat((_f16_bytes(d), _pack_nibbles(q.reshape(-1, 2, 16))), dim=-1)


@_rows("q4_1")
def quantize_q4_1(x: torch.Tensor) -> torch.Tensor:
    d, m, q = _asymmetric(x, 16)
    return torch.cat((_f16_bytes(d), _f16_bytes(m), _pack_nibbles(q.reshape(-1, 2, 16))), dim=-1)


@_rows("q5_0")
def quantize_q5_0(x: torch.Tensor) -> torch.Tensor:
    d, q = _symmetric(x, 32)
    return torch.cat((_f16_bytes(d), _q5_tail(q)), dim=-1)


@_rows("q5_1")
def quantize_q5_1(x: torch.Tensor) -> torch.Tensor:
    d, m, q = _asymmetric(x, 32)
    return torch.cat((_f16_bytes(d), _f16_bytes(m), _q5_tail(q)), dim=-1)


@_rows("mxfp4")
def quantize_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """e = floor(log2(amax)) - 2 + 127, then each weight's nearest e2m1 level (the first on ties).
    log2 is taken in float64 and rounded to float32: the correctly rounded float32 log2 that
    ggml's log2f and numpy's give, where torch's float32 log2 may be an ulp off below a power
    of two. amax under 2**-125 has no e8m0 code here, as in ggml (its uint8 cast wraps)."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    log2 = torch.log2(amax.to(torch.float64)).to(torch.float32)
    e = torch.where(amax > 0, torch.floor(log2) - 2 + 127, 0.0).to(torch.uint8)
    levels = torch.tensor(E2M1_LEVELS_X2, dtype=torch.float32, device=x.device)
    err = (e8m0_half(e).unsqueeze(-1) * levels - x.unsqueeze(-1)).abs()
    q = err.argmin(dim=-1)
    return torch.cat((e, _pack_nibbles(q.reshape(-1, 2, 16))), dim=-1)


# ---- K-quants: ggml's reference searches, for every sub-block at once -------------------------
def _fit_scale_min(
    x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's make_qkx2_quants (squared error) over dimension 0 (a sub-block's weights): x ~
    scale * L - min with L in [0, nmax], weights w. Starts from the min/max fit, then tries the
    least-squares fit of each of nstep + 1 rounding grids, keeping the best. Returns scale,
    min (>= 0), L."""
    lo = x.amin(dim=0, keepdim=True).clamp(max=0)
    hi = x.amax(dim=0, keepdim=True)
    flat = hi == lo
    span = torch.where(flat, 1.0, hi - lo)
    sum_w = _seqsum(w)
    sum_x = _seqsum(w * x)

    iscale = _over(nmax, span)
    scale = 1 / iscale
    levels = torch.round(iscale * (x - lo)).clamp(0, nmax)
    best = _seqsum(w * (scale * levels + lo - x).square())
    for step in range(nstep + 1):
        # ggml moves `min` to each better fit's as it goes: later grids span max - that min
        span = torch.where(flat, 1.0, hi - lo)
        trial = torch.round(_over(_f32(_f32(rmin + _f32(_f32(rdelta) * step)) + nmax), span) * (x - lo))
        trial = trial.clamp(0, nmax)
        wl = w * trial
        sum_l = _seqsum(wl)
        sum_l2 = _seqsum(wl * trial)
        sum_xl = _seqsum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0  # a positive offset is not allowed: refit the scale alone
        this_scale = torch.where(positive, sum_xl / sum_l2, this_scale)
        this_min = torch.where(positive, 0.0, this_min)
        err = _seqsum(w * (this_scale * trial + this_min - x).square())
        better = (det > 0) & (err < best) & ~flat
        levels = torch.where(better, trial, levels)
        best = torch.where(better, err, best)
        scale = torch.where(better, this_scale, scale)
        lo = torch.where(better, this_min, lo)
    return torch.where(flat, 0.0, scale), -lo, torch.where(flat, 0.0, levels)


def _fit_symmetric(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's make_qx_quants (rmse_type 1, weights x**2, no imatrix) over dimension 0: x ~
    scale * (L - nmax) with L in [0, 2 * nmax - 1]; tries 18 scales around -nmax / max and
    keeps the one whose least-squares fit explains the most. Returns scale, L."""
    mx = _abs_max_signed(x, dim=0)
    zero = mx.abs() < 1e-15  # GROUP_MAX_EPS
    mx = torch.where(zero, 1.0, mx)
    w = x * x

    def fit(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.round(iscale * x).clamp(-nmax, nmax - 1)
        return q, _seqsum(w * x * q), _seqsum(w * q * q)

    levels, sumlx, suml2 = fit(_over(-nmax, mx))
    scale = torch.where(suml2 != 0, sumlx / suml2, 0.0)
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        q, sumlx, suml2 = fit(_over(-_f32(nmax + _f32(_f32(0.1) * step)), mx))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels = torch.where(better, q, levels)
        scale = torch.where(better, sumlx / suml2, scale)
        best = torch.where(better, scale * sumlx, best)
    return torch.where(zero, 0.0, scale), torch.where(zero, 0.0, levels + nmax)


def _q45_k(x: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_row_q4_K_ref / q5_K_ref up to the weights: the 16-byte head (fp16 d, fp16 dmin,
    12 bytes of 6-bit sub-block scales and mins) and each weight's level `[n, 8, 32]`."""
    xs = x.reshape(-1, 8, 32).permute(2, 0, 1).contiguous()  # [32, n, 8]: weight, block, sub-block
    # sqrtf is correctly rounded; torch's float32 sqrt may be an ulp off (on the dev box it was
    # for 1 sub-block in ~6,000, which moved 3 of 256 rows' scales): in float64, then rounded
    av_x = torch.sqrt((_seqsum(xs.square()) / 32).to(torch.float64)).to(torch.float32)
    scales, mins, levels = _fit_scale_min(xs, av_x + xs.abs(), nmax, rmin, 0.1, nstep)
    scales, mins = scales[0], mins[0]  # [n, 8]
    # ggml's running maxima start at +0 and take only larger values: never -0 (a min of -0, as a
    # sub-block without negative weights gets, would otherwise store dmin as fp16 -0)
    max_scale, max_min = (torch.where(m > 0, m, 0.0) for m in (scales.amax(dim=1, keepdim=True),
                                                            mins.amax(dim=1, keepdim=True)))

    def six_bits(v: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        inv = torch.where(top > 0, _over(63, torch.where(top > 0, top, 1.0)), 0.0)
        return (torch.round(inv * v).to(torch.int32) & 0xFF).clamp(max=63)  # uint8_t, then MIN(63)

    ls, lm = six_bits(scales, max_scale), six_bits(mins, max_min)  # [n, 8]
    packed = torch.cat(
        (ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
         (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)),
        dim=-1,
    ).to(torch.uint8)
    d, dmin = max_scale / 63, max_min / 63  # [n, 1]
    # Requantize against the scales as stored; a sub-block whose scale rounds to 0 keeps its fit.
    sub_d, sub_m = _f16_round(d) * ls, _f16_round(dmin) * lm  # [n, 8]
    requant = torch.round((xs + sub_m) / torch.where(sub_d == 0, 1.0, sub_d)).clamp(0, nmax)
    levels = torch.where(sub_d == 0, levels, requant).permute(1, 2, 0)
    return torch.cat((_f16_bytes(d), _f16_bytes(dmin), packed), dim=-1), levels.to(torch.uint8)


@_rows("q4_k")
def quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    head, q = _q45_k(x, 15, -1.0, 20)
    return torch.cat((head, _pack_nibbles(q.reshape(-1, 4, 2, 32)).reshape(-1, 128)), dim=-1)


@_rows("q5_k")
def quantize_q5_k(x: torch.Tensor) -> torch.Tensor:
    head, q = _q45_k(x, 31, -0.5, 15)
    low = _pack_nibbles((q & 0x0F).reshape(-1, 4, 2, 32)).reshape(-1, 128)
    return torch.cat((head, _pack_bits(q >> 4, 1), low), dim=-1)


@_rows("q6_k")
def quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q6_K_ref: a symmetric 6-bit fit per 16 weights, the 16 scales themselves
    quantized to int8 against the largest-magnitude one, then every weight requantized."""
    xs = x.reshape(-1, 16, 16).permute(2, 0, 1).contiguous()  # [16, n, 16]: weight, block, sub-block
    scales, levels = _fit_symmetric(xs, 32)
    scales = scales[0]  # [n, 16]
    top = _abs_max_signed(scales)  # [n, 1]
    empty = top.abs() < 1e-15  # the whole super-block is zero: every byte 0
    iscale = _over(-128, torch.where(empty, 1.0, top))
    d = 1 / iscale
    sc = torch.round(iscale * scales).clamp(max=127)  # [n, 16]
    sub_d = _f16_round(d) * sc
    requant = torch.round(xs / torch.where(sub_d == 0, 1.0, sub_d)).clamp(-32, 31) + 32
    q = torch.where(sub_d == 0, levels, requant).permute(1, 2, 0).to(torch.uint8).reshape(-1, 2, 4, 32)
    # per half of 128: weights 0-31 and 64-95 share bytes 0-31 of ql (low, high nibble), 32-63
    # and 96-127 bytes 32-63; qh holds the top 2 bits of weights l, l+32, l+64, l+96 in byte l
    ql = _pack_nibbles(torch.stack((q[:, :, :2], q[:, :, 2:]), dim=2).reshape(-1, 2, 2, 64) & 0x0F)
    qh = _pack_bits(q >> 4, 2)
    out = torch.cat(
        (ql.reshape(-1, 128), qh.reshape(-1, 64), sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)),
        dim=-1,
    )
    return torch.where(empty, 0, out).to(torch.uint8)

