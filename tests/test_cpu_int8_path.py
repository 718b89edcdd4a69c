"""The CPU kernel's int8 path (kernels/cpu/int8_dots.h), which runs in bf16 or fp16 take: each
token's activations quantized to int8 per 256 values (per 32 where a row is not a multiple of
256), as ggml's Q8_K. Checked against a float64 model of that arithmetic (the dequantized weights
times the dequantized activations), and its error against the exact float32 path measured; the
formats without it, the AVX2 build and float32 runs keep the exact path."""

from __future__ import annotations

import pytest
import torch

from ftkit.kernels.cpu import Kernel, build, int8_activations, load
from ftkit.runtime.experts.pool import expert_weights
from ftkit.vocab import SlotLayout
from gguf_fixtures import block_slots

INT8_FORMATS = ("q4_k", "q6_k", "q8_0", "q4_0", "iq4_nl", "mxfp4")
TOKENS = (1, 3, 19)  # 19 > TBMAX: blocks of tokens over the same rows
K = 2


def _kernel() -> Kernel:
    kernel = load()
    if kernel is None:
        pytest.skip("the CPU kernel cannot be built here (no C++ compiler)")
    if kernel.isa != "avx512":
        pytest.skip("the int8 path needs AVX-512 BW (this CPU has the float path only)")
    return kernel


def _run(kernel: Kernel, layout: SlotLayout, slots: list[torch.Tensor], x: torch.Tensor, w: torch.Tensor,
         int8: bool, threads: int = 2) -> torch.Tensor:
    tokens = x.shape[0]
    groups = [torch.arange(e, tokens * K, len(slots)) for e in range(len(slots))]
    out = torch.full((tokens * K, x.shape[1]), float("nan"))
    kernel.experts(layout, slots, groups, x, w, out, K, threads, None, int8)
    return out


def _q8(v: torch.Tensor) -> torch.Tensor:
    """What the int8 path multiplies for float32 rows `v`: per group, q * d in float64."""
    n = v.shape[-1]
    g = 256 if n % 256 == 0 else 32
    grouped = v.reshape(-1, n // g, g)
    amax = grouped.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = (grouped * inv).round()  # float32 product, ties to even, as the kernel's cvtps2dq
    return (q.double() * (amax / 127.0).double()).reshape(v.shape)


def _model(layout: SlotLayout, slot: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One expert on the int8 path's values: quantized x, float64 products, quantized h."""
    wt = expert_weights(layout, slot, torch.float64)
    gate, up, down = wt[:3]
    xq = _q8(x)
    h = torch.nn.functional.silu(xq @ gate.T) * (xq @ up.T)
    return _q8(h.float()) @ down.T


def _data(hidden: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(tokens)
    return torch.randn(tokens, hidden, generator=gen), torch.rand(tokens * K, generator=gen)


@pytest.mark.parametrize("formats", [(f,) * 3 for f in INT8_FORMATS] + [("q4_k", "q4_k", "q6_k"), ("q6_k", "q4_k", "q4_k")],
                         ids=lambda f: "-".join(f))  # the last: gate and up in different formats
def test_int8_path_is_the_quantized_arithmetic_and_near_the_exact_path(formats):
    kernel = _kernel()
    shapes = [(512, 256)] + ([] if formats[0] in ("q4_k", "q6_k") else [(640, 320)])  # 256 or 32 a group
    for hidden, inter in shapes:
        layout, slots, _, _ = block_slots(formats, 2, seed=3, hidden=hidden, inter=inter)
        for tokens in TOKENS:
            x, w = _data(hidden, tokens)
            fast, exact = _run(kernel, layout, slots, x, w, True), _run(kernel, layout, slots, x, w, False)
            assert not fast.isnan().any()
            for e, slot in enumerate(slots):
                rows = torch.arange(e, tokens * K, len(slots))
                ref = _model(layout, slot, x[rows // K]) * w.double()[rows, None]
                torch.testing.assert_close(fast[rows].double(), ref, rtol=0, atol=2e-3 * ref.abs().max().item())
            # the activations' rounding: 1.2-2.2% of an expert's output on these Gaussian rows
            error = ((fast - exact).norm() / exact.norm()).item()
            assert 0 < error < 0.035, (formats, hidden, tokens, error)


def test_int8_path_is_deterministic_whatever_the_threads():
    kernel = _kernel()
    layout, slots, _, _ = block_slots(("q4_k", "q4_k", "q6_k"), 4, seed=5)
    x, w = _data(512, 19)
    first = _run(kernel, layout, slots, x, w, True, threads=1)
    for threads in (2, 3):
        assert torch.equal(_run(kernel, layout, slots, x, w, True, threads=threads), first)


@pytest.mark.parametrize("formats", [("q5_k",) * 3, ("bfloat16",) * 3, ("q2_k", "q2_k", "q3_k")],
                         ids=lambda f: "-".join(f))
def test_formats_without_the_int8_path_keep_the_exact_one(formats):
    kernel = _kernel()
    layout, slots, _, _ = block_slots(formats, 2, seed=1)
    x, w = _data(512, 3)
    assert torch.equal(_run(kernel, layout, slots, x, w, True), _run(kernel, layout, slots, x, w, False))


def test_the_avx2_build_has_no_int8_path():
    _kernel()
    kernel = Kernel(build(extra=("-mno-avx512f",)))
    layout, slots, _, _ = block_slots(("q4_k", "q4_k", "q6_k"), 2, seed=2)
    x, w = _data(512, 3)
    assert torch.equal(_run(kernel, layout, slots, x, w, True), _run(kernel, layout, slots, x, w, False))


def test_only_float32_runs_keep_exact_products():
    assert not int8_activations(torch.float32)
    assert int8_activations(torch.bfloat16) and int8_activations(torch.float16)


def test_a_gpt_oss_expert_on_the_int8_path():
    """MXFP4 with float32 biases and the clamped SwiGLU: the biases and the clamp act on the
    quantized products as on the exact ones."""
    kernel = _kernel()
    fields = dict(expert_bias=True, swiglu_alpha=1.702, swiglu_limit=7.0)
    layout, slots, _, _ = block_slots(("mxfp4",) * 3, 2, seed=4, hidden=640, inter=320, **fields)
    x, w = _data(640, 3)
    fast, exact = _run(kernel, layout, slots, x, w, True), _run(kernel, layout, slots, x, w, False)
    ref = exact.double()
    torch.testing.assert_close(fast.double(), ref, rtol=0, atol=0.05 * ref.abs().max().item())
    assert 0 < ((fast - exact).norm() / exact.norm()).item() < 0.035
