"""A CPU decode step's attention on the kernel (kernels/cpu/decode_attention.h) against a float64
reference: every cache dtype, grouped and plain heads, head widths, chunk edges, a sliding
window's first key, rows strided as the KV cache holds them; and the decoder's attention
choosing it, or torch's where the kernel does not take the shape."""

from __future__ import annotations

import pytest
import torch

from ftkit.kernels.cpu import Kernel, build, load
from ftkit.runtime.models.layers import attention, decode_attention

# float32 runs: to float32 rounding; 16-bit runs: the result is rounded to the dtype
ATOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _kernel():
    kernel = load()
    if kernel is None:
        pytest.skip("the CPU kernel cannot be built here (no C++ compiler)")
    return kernel


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: int) -> torch.Tensor:
    g = q.shape[1] // k.shape[1]
    k, v = (a[lo:].double().repeat_interleave(g, dim=1) for a in (k, v))
    scores = torch.einsum("hd,shd->hs", q[0].double(), k) * q.shape[2] ** -0.5
    return torch.einsum("hs,shd->hd", scores.softmax(-1), v)[None]


def _cache_rows(s: int, kv_heads: int, d: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Keys as the KV cache hands them over: the first s rows of a longer buffer."""
    return torch.randn(s + 5, kv_heads, d, generator=gen).to(dtype)[:s]


def _check(kernel: Kernel, dtype: torch.dtype, heads: int, kv_heads: int, d: int, dv: int) -> None:
    gen = torch.Generator().manual_seed(heads * d + dv)
    for s, lo in ((1, 0), (37, 0), (256, 0), (257, 0), (600, 0), (600, 345), (513, 512)):
        q = (torch.randn(1, heads, d, generator=gen) * 2).to(dtype)
        k, v = _cache_rows(s, kv_heads, d, dtype, gen), _cache_rows(s, kv_heads, dv, dtype, gen)
        out = kernel.attention(q, k, v, lo, threads=3)
        assert out is not None and out.shape == (1, heads, dv) and out.dtype == dtype
        ref = _reference(q, k, v, lo)
        err = (out.double() - ref).abs().max().item()
        assert err <= ATOL[dtype], (s, lo, err)
        # torch's own decode step lands as close (the kernel is no worse than what it replaces)
        mask = torch.arange(s) >= lo
        assert err <= (decode_attention(q, k, v, mask).double() - ref).abs().max().item() + ATOL[dtype] / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d,dv", [(32, 4, 128, 128), (16, 16, 64, 64), (12, 2, 256, 256),
                                                 (8, 2, 128, 64)])
def test_kernel_attention_matches_float64(dtype: torch.dtype, heads: int, kv_heads: int, d: int, dv: int) -> None:
    _check(_kernel(), dtype, heads, kv_heads, d, dv)


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-march=x86-64",)], ids=["avx2", "scalar"])
def test_fallback_builds_attention(flags: tuple[str, ...]) -> None:
    """The AVX2 build (W = 8, its own exponential) and the portable scalar one."""
    _kernel()
    kernel = Kernel(build(extra=flags))
    for dtype in ATOL:
        _check(kernel, dtype, 8, 2, 64, 64)
    _check_nan(kernel)


def _check_nan(kernel: Kernel) -> None:
    q, k, v = torch.randn(1, 8, 64), torch.randn(300, 2, 64), torch.randn(300, 2, 64)
    k[280, 1, 3] = float("nan")
    out = kernel.attention(q, k, v, 0, threads=2)
    assert out[0, 4:].isnan().all() and not out[0, :4].isnan().any()


def test_kernel_attention_passes_nan_on() -> None:
    """A NaN in the cache (a broken model) reaches the heads that read it, as torch's step would
    give it, and no others: not clamped away into a plausible number."""
    _check_nan(_kernel())


def test_a_float32_query_over_bf16_keys_keeps_float32_scores() -> None:
    """A 16-bit run's query is bf16 and its scores may take bf16 dot products; a query with more
    precision than bf16 keeps the float32 ones (not rounded to bf16 on the way)."""
    kernel = _kernel()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 128, generator=gen) * 3
    k, v = (_cache_rows(700, 2, 128, torch.bfloat16, gen) for _ in range(2))
    ref = _reference(q, k, v, 0)
    out = kernel.attention(q, k, v, 0, threads=2)
    assert (out.double() - ref).abs().max().item() <= ATOL[torch.float32] * 10
    rounded = (_reference(q.bfloat16(), k, v, 0) - ref).abs().max().item()
    assert rounded > ATOL[torch.float32] * 100  # what rounding q to bf16 would have cost


def test_kernel_attention_independent_of_threads() -> None:
    kernel = _kernel()
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 32, 128, generator=gen).bfloat16()
    k, v = (_cache_rows(1500, 4, 128, torch.bfloat16, gen) for _ in range(2))
    first = kernel.attention(q, k, v, 0, threads=1)
    for threads in (2, 3, 8):
        assert torch.equal(kernel.attention(q, k, v, 0, threads=threads), first)


def test_kernel_attention_declines_what_it_does_not_take() -> None:
    kernel = _kernel()
    q = torch.randn(1, 4, 16)
    k = torch.randn(10, 2, 16)
    assert kernel.attention(q, k.to(torch.float64), k.to(torch.float64), 0, 2) is None  # no float64 path
    assert kernel.attention(q, k, k.transpose(0, 1).contiguous().transpose(0, 1), 0, 2) is not None
    assert kernel.attention(q, k, k, 10, 2) is None  # no keys at or after lo
    q6, k6 = torch.randn(1, 4, 6), torch.randn(10, 2, 6)  # 6 is under every vector width but scalar
    assert (kernel.attention(q6, k6, k6, 0, 2) is None) == (kernel.isa != "scalar")


@pytest.mark.parametrize("d", [128, 6])
@pytest.mark.parametrize("window", [None, 5])
def test_decoder_attention_takes_the_kernel_or_torch(d: int, window: int | None) -> None:
    """`attention` for one CPU query: the kernel where it takes the shape, torch's decode step
    where it does not (a head width under the vector width), both close to float64, the
    sliding window's keys cut where its mask cut them."""
    _kernel()
    gen = torch.Generator().manual_seed(d)
    s = 40
    q = torch.randn(1, 8, d, generator=gen)
    k, v = torch.randn(s, 2, d, generator=gen), torch.randn(s, 2, d, generator=gen)
    out = attention(q, k, v, s - 1, window)
    lo = 0 if window is None else s - window
    assert (out.double() - _reference(q, k, v, lo)).abs().max().item() <= ATOL[torch.float32]
