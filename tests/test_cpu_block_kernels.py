"""The CPU expert kernel on GGUF block slots: bit for bit what it computes from the same slots
dequantized to float32 (kernels/dequant.py, itself bit for bit gguf's), and within float32
rounding of a float64 reference, for every block format, mixed parts, one token and many (the
decoded-tile path), and for the AVX2 and scalar builds as for the native one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ftkit.kernels.cpu import Kernel, build, load
from ftkit.runtime.experts.pool import expert_forward, expert_weights
from ftkit.vocab import BLOCK_FORMATS, SlotLayout
from gguf_fixtures import block_slots

HIDDEN, INTER = 512, 256  # rows of two 256-weight super-blocks (HIDDEN) and one (INTER)
TOKENS = (1, 3, 19)  # 19 > TBMAX (8): that expert's rows go through the decoded float32 tile
GPT_OSS = dict(expert_bias=True, swiglu_alpha=1.702, swiglu_limit=0.7)  # a limit that clamps often


def _kernel() -> Kernel:
    kernel = load()
    if kernel is None:
        pytest.skip("the CPU kernel cannot be built here (no C++ compiler)")
    return kernel


def _call(kernel: Kernel, layout: SlotLayout, slots: list[torch.Tensor], tokens: int, seed: int) -> torch.Tensor:
    """Every expert on an interleaved share of `tokens` tokens (top-2): out [tokens * 2, HIDDEN]."""
    gen = torch.Generator().manual_seed(seed)
    x, w, k = torch.randn(tokens, HIDDEN, generator=gen), torch.rand(tokens * 2, generator=gen), 2
    groups = [torch.arange(e, tokens * k, len(slots)) for e in range(len(slots))]
    out = torch.full((tokens * k, HIDDEN), float("nan"))
    kernel.experts(layout, slots, groups, x, w, out, k, 2)
    return out, x, w, groups


def _check(kernel: Kernel, formats: tuple[str, str, str], **fields: object) -> None:
    layout, slots, f32, floats = block_slots(formats, 2, seed=len("".join(formats)), **fields)
    for tokens in TOKENS:
        out, x, w, groups = _call(kernel, layout, slots, tokens, tokens)
        ref_out, *_ = _call(kernel, f32, floats, tokens, tokens)
        assert not out.isnan().any(), (formats, tokens)
        assert torch.equal(out, ref_out), (formats, tokens, (out - ref_out).abs().max())
        for slot, idx in zip(slots, groups, strict=True):
            weights = expert_weights(layout, slot, torch.float64)  # dequant.py's values, in float64
            ref = expert_forward(x.double()[idx // 2], weights, layout.activation) * w.double()[idx, None]
            torch.testing.assert_close(out[idx].double(), ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_every_block_format_equals_its_float32_dequantization(fmt):
    _check(_kernel(), (fmt, fmt, fmt))


@pytest.mark.parametrize("formats", [("q4_k", "q4_k", "q6_k"), ("q8_0", "mxfp4", "q5_k"), ("bfloat16", "q4_0", "iq4_xs")])
def test_parts_in_different_formats(formats):
    """A Q4_K_M layer (gate and up q4_k, down q6_k), and gate and up that differ."""
    _check(_kernel(), formats)


@pytest.mark.parametrize("formats", [("mxfp4",) * 3, ("q4_k", "q4_k", "q6_k"), ("bfloat16", "q8_0", "q4_0")])
def test_blocks_with_biases_and_the_clamped_swiglu(formats):
    """gpt-oss's experts in blocks (a GGUF's MXFP4 kept as stored): the float32 biases and the
    clamped SwiGLU on the block path give the float32 path's bits too."""
    layout, *_ = block_slots(formats, 1, seed=0, **GPT_OSS)
    assert layout.biased and layout.activation is not None and layout.formats == formats
    _check(_kernel(), formats, **GPT_OSS)


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-march=x86-64",)], ids=["avx2", "scalar"])
def test_fallback_builds_equal_their_float32_path(flags):
    """The AVX2 build (W = 8) and the portable scalar one: each sums in its own order, and its
    block path gives its float32 path's bits."""
    _kernel()
    kernel = Kernel(build(extra=flags))
    assert kernel.isa == {"-mno-avx512f": "avx2", "-march=x86-64": "scalar"}[flags[0]]
    for formats in (("q4_k", "q4_k", "q6_k"), ("q8_0", "mxfp4", "q4_0"), ("q5_k", "q5_k", "q5_k")):
        _check(kernel, formats)


def test_a_row_that_does_not_split_into_blocks_is_refused():
    kernel = _kernel()
    layout, slots, _, _ = block_slots(("q4_k",) * 3, 1, seed=0)
    h = HIDDEN - 32  # rows of gate and up that end inside a super-block
    bad = dataclasses.replace(layout, parts=tuple(dataclasses.replace(p, shape=(INTER, h)) if p.name != "down" else p
                                                  for p in layout.parts))
    with pytest.raises(ValueError, match="does not support expert formats q4_k/q4_k/q4_k"):
        kernel.experts(bad, slots, [torch.tensor([0])], torch.randn(1, h), torch.ones(1), torch.zeros(1, h), 1, 1)
