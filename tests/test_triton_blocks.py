"""The grouped expert kernels on GGUF block slots (issue 38): every block format decoded in
registers equal to kernels/dequant.py (itself bit for bit gguf's), and the GEMV and GEMM on block
slots, fills included, equal to the same kernels on the slots dequantized to float32: bit for bit
in Triton's interpreter (CPU) where the operations are the same, else (on CUDA, where Triton may
fuse a product and a sum; the GEMV's own order of sums) within float32 rounding."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ftkit.kernels.dequant import dequantize
from ftkit.kernels.quantize import QUANTIZERS, quantize
from ftkit.vocab import BLOCK_FORMATS
from gguf_fixtures import block_slots, random_blocks

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from ftkit.kernels.triton.blocks import CODES, lut, tile, weights  # noqa: E402 (after the skip)

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if CUDA else "cpu"
HIDDEN, INTER = 256, 256  # one 256-weight super-block per row: the interpreter is slow
Q4_K_M = ("q4_k", "q4_k", "q6_k")  # llama-quantize's Q4_K_M layers: down in Q6_K
OSS = dict(expert_bias=True, swiglu_alpha=1.702, swiglu_limit=0.7)


def _same(got: torch.Tensor, want: torch.Tensor, exact: bool = True) -> None:
    """Bit for bit in the interpreter where the operations are the same (`exact`), else within
    float32 rounding (the GEMV sums a block row as [rows, 8, 32] tiles, the float path in 128s)."""
    assert not got.isnan().any()
    if CUDA or not exact:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
    else:
        assert torch.equal(got, want), (got - want).abs().max()


@triton.jit
def _decode(src, out, N, K, FMT: tl.constexpr, lut_ptr, BN: tl.constexpr, BK: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    m = (n[:, None] < N) & (k[None, :] < K)
    tl.store(out + n[:, None] * K + k[None, :], weights(src, n[:, None], k[None, :], m, K, FMT, lut_ptr), mask=m)


@pytest.mark.parametrize("gather", [True, False], ids=["levels-gathered", "levels-in-registers"])
def test_every_block_format_decodes_as_dequant_does(gather):
    """Each format as the GEMV decodes it (IQ4 and e2m1 levels gathered from a table) and as the
    GEMM does (picked in registers)."""
    rng = np.random.default_rng(0)
    for fmt in BLOCK_FORMATS:
        n, k = 5, 512  # 5 rows: a masked tail of programs
        raw = (quantize(torch.randn(n, k), fmt) if fmt in QUANTIZERS
               else torch.from_numpy(random_blocks(fmt, (n, k), rng, scale=0.01)))
        out = torch.zeros(n, k, device=DEV)
        _decode[(triton.cdiv(n, 4), triton.cdiv(k, 128))](raw.to(DEV), out, n, k, CODES[fmt],
                                                         lut(torch.device(DEV)) if gather else None, BN=4, BK=128)
        _same(out.cpu(), dequantize(raw, fmt))


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q8_0"])
def test_dense_block_gemv_equals_the_product_with_the_dequantized_weight(fmt, monkeypatch):
    """A dense weight kept in its blocks (an lm_head, an attention projection), split into planes
    holding exactly its stored bytes (`unpack` gives them back), times one and three tokens:
    F.linear with the dequantized weight, within float32 rounding; rows past a program's tile
    masked, a reduction of three super-blocks (a step's tail masked), the bias added."""
    from ftkit.kernels.triton.block_gemv import (
        MAX_TOKENS,
        Planes,
        block_gemv,
        dequantized,
        pack,
        unpack,
    )
    from ftkit.runtime.models.block_table import PlaneLinear

    gen = torch.Generator().manual_seed(3)
    n, k = 37, 768
    raw = quantize(torch.randn(n, k, generator=gen), fmt)
    planes = pack(raw.to(DEV), fmt, n, k)
    assert torch.equal(unpack(planes).cpu(), raw) and planes.nbytes == raw.numel()
    assert torch.equal(dequantized(planes, torch.float32).cpu(), dequantize(raw, fmt))
    monkeypatch.setattr(PlaneLinear, "ROWS", 16)  # rows 0-15, 16-31, 32-36 dequantized in turn
    halves = Planes.cat([planes.rows(0, 20), planes.rows(20, n)])
    assert torch.equal(unpack(halves).cpu(), raw)
    bias = torch.randn(n, generator=gen)
    for tokens in (1, 3):
        x = torch.randn(tokens, k, generator=gen)
        got = block_gemv(x.to(DEV), halves, bias.to(DEV), bn=8, chunks=8)
        _same(got.cpu(), torch.nn.functional.linear(x, dequantize(raw, fmt), bias), exact=False)
    with pytest.raises(ValueError, match="tokens"):
        block_gemv(torch.zeros(MAX_TOKENS + 1, k, device=DEV), planes)
    # as the runtime holds it (lm_head on a GPU): a batched step's tokens through the kernel, a
    # prompt's every position against the weight dequantized a few rows at a time
    head = PlaneLinear(planes, torch.float32)
    assert head.shape == (n, k) and head.nbytes == raw.numel()
    for tokens in (MAX_TOKENS, MAX_TOKENS + 1):
        x = torch.randn(1, tokens, k, generator=gen)
        got = head.product(x.to(DEV))
        assert got.shape == (1, tokens, n)
        _same(got.cpu(), torch.nn.functional.linear(x, dequantize(raw, fmt)), exact=False)
    with pytest.raises(ValueError, match="uint8"):
        pack(raw[:, 1:].to(DEV), fmt, n, k)


@triton.jit
def _decode_tiles(src, out, N, K, FMT: tl.constexpr, lut_ptr, BN: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    kb = tl.program_id(1)
    k = kb * 256 + tl.arange(0, 8)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    m = (n[:, None, None] < N) & (k < K)
    tl.store(out + n[:, None, None] * K + k, tile(src, n, kb, n < N, K, FMT, lut_ptr), mask=m)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q8_0", "iq4_xs"])
def test_decode_gemv_tiles_equal_dequant(fmt):
    """`tile` (the decode GEMV's [rows, 8, 32] weights; Q4_K, Q6_K and Q8_0 on their own paths)
    decodes every weight as kernels/dequant.py does."""
    rng = np.random.default_rng(5)
    n, k = 5, 512
    raw = (quantize(torch.randn(n, k), fmt) if fmt in QUANTIZERS
           else torch.from_numpy(random_blocks(fmt, (n, k), rng, scale=0.01)))
    out = torch.zeros(n, k, device=DEV)
    _decode_tiles[(triton.cdiv(n, 4), k // 256)](raw.to(DEV), out, n, k, CODES[fmt], lut(torch.device(DEV)), BN=4)
    _same(out.cpu(), dequantize(raw, fmt))


def _stack(slots: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(slots).to(DEV)


@pytest.mark.parametrize("formats", [(f,) * 3 for f in BLOCK_FORMATS] + [Q4_K_M, ("q8_0", "q8_0", "bfloat16")],
                         ids="-".join)
def test_gemv_on_blocks_equals_the_gemv_on_their_values(formats):
    """The decode GEMV over block slots (several items per slot, a padded tail past the count)
    gives what it gives over the same experts as float32 slots."""
    from ftkit.kernels.triton.experts import grouped_expert_gemv

    layout, slots, f32, floats = block_slots(formats, 3, seed=1, hidden=HIDDEN, inter=INTER)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((2, HIDDEN), generator=gen).to(DEV)
    sid, tid = (torch.tensor(v, dtype=torch.int32, device=DEV) for v in ([2, 0, 1, 2, 0], [0, 1, 1, 0, 0]))
    wt, count = torch.rand(5, generator=gen).to(DEV), torch.tensor([4], dtype=torch.int32, device=DEV)
    got = grouped_expert_gemv(x, _stack(slots), layout, sid, tid, wt, count)[:4]
    want = grouped_expert_gemv(x, _stack(floats), f32, sid, tid, wt, count)[:4]
    _same(got.cpu(), want.cpu(), exact=False)


def _host(slots: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Host rows as fills read them (pinned and mapped on CUDA), and each row's device address."""
    from ftkit.kernels.triton import zero_copy

    host = torch.stack(slots)
    host = host.pin_memory() if CUDA else host
    return host, torch.tensor([zero_copy.device_pointer(r.data_ptr()) if CUDA else r.data_ptr() for r in host],
                              device=DEV)


@pytest.mark.parametrize("oss,block_n", [(False, 32), (True, 32), (False, 8)])
def test_gemv_fills_block_slots_from_the_host(oss, block_n):
    """Flagged items copy their expert's bytes (biases too) from the host into their slot and
    compute from them: the same results as with every expert resident (at any rows a program)."""
    from ftkit.kernels.triton.experts import grouped_expert_gemv

    layout, slots, f32, floats = block_slots(Q4_K_M, 3, seed=2, hidden=HIDDEN, inter=INTER, **(OSS if oss else {}))
    host, addr = _host(slots)
    dev = torch.zeros((3, layout.slot_bytes), dtype=torch.uint8, device=DEV)
    dev[1] = host[0].to(DEV)  # row 0 resident in slot 1; rows 1 and 2 fill slots 0 and 2
    gen = torch.Generator().manual_seed(2)
    x = torch.randn((1, HIDDEN), generator=gen).to(DEV)
    tid = torch.zeros(3, dtype=torch.int32, device=DEV)
    wt, count = torch.rand(3, generator=gen).to(DEV), torch.tensor([3], dtype=torch.int32, device=DEV)
    fills = tuple(torch.tensor(v, device=DEV) for v in ([0, 1, 1], [0, 1, 2]))
    got = grouped_expert_gemv(x, dev, layout, torch.tensor([1, 0, 2], dtype=torch.int32, device=DEV), tid, wt, count,
                              (fills[0].to(torch.int32), fills[1], addr), block_n=block_n)
    assert torch.equal(dev.cpu()[[1, 0, 2]], host)
    want = grouped_expert_gemv(x, _stack(floats), f32, torch.arange(3, dtype=torch.int32, device=DEV), tid, wt, count)
    _same(got.cpu(), want.cpu(), exact=False)


def _gemm_case(cap: int, t: int, k: int, gen: torch.Generator):
    """Items of t tokens routed to k distinct of `cap` experts, sorted by expert: the tiles,
    tokens, destination rows and weights of the GEMM."""
    from ftkit.kernels.triton.experts import gemm_tiles

    ids = torch.stack([torch.randperm(cap, generator=gen)[:k] for _ in range(t)]).reshape(-1)
    order = torch.argsort(ids, stable=True)
    tiles = gemm_tiles(list(enumerate(torch.bincount(ids, minlength=cap).tolist())))
    i32 = dict(dtype=torch.int32, device=DEV)
    return (torch.tensor(tiles, **i32), (order // k).to(**i32), order.to(**i32),
            torch.rand(t * k, generator=gen)[order].to(DEV))


@pytest.mark.parametrize("formats", [Q4_K_M, ("q8_0",) * 3, ("mxfp4",) * 3, ("iq4_xs",) * 3], ids="-".join)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_gemm_on_blocks_equals_the_gemm_on_their_values(formats, x_dtype):
    """Prefill's GEMM over block slots: float32 activations give what the float32 slots give
    (bit for bit where both launches take the same tile: another tile may sum in another order,
    the interpreter's matmul at another width included); bf16 ones (the weights decoded into bf16 for the
    tensor cores) stay within bf16 rounding."""
    from ftkit.kernels.triton.experts import gemm_tile, grouped_expert_gemm

    layout, slots, f32, floats = block_slots(formats, 3, seed=3, hidden=HIDDEN, inter=INTER)
    gen = torch.Generator().manual_seed(3)
    t, k = 200, 2  # one expert gets more than a tile of items
    x = torch.randn((t, HIDDEN), generator=gen).to(DEV)
    case = _gemm_case(3, t, k, gen)
    got = torch.zeros((t * k, HIDDEN), dtype=x_dtype, device=DEV)
    want = torch.zeros((t * k, HIDDEN), device=DEV)
    grouped_expert_gemm(x.to(x_dtype), _stack(slots), layout, *case, got)
    grouped_expert_gemm(x, _stack(floats), f32, *case, want)
    if x_dtype == torch.float32:
        tiles = {tuple(gemm_tile(code).values()) for code in (0, *(CODES[f] for f in formats))}
        _same(got.cpu(), want.cpu(), exact=len(tiles) == 1)
    else:
        assert float((got.float() - want).norm() / want.norm()) < 2e-2


def test_gemm_fills_block_slots_from_the_host():
    """Flagged tiles copy their expert from the host into their slot before multiplying."""
    from ftkit.kernels.triton.experts import grouped_expert_gemm

    layout, slots, f32, floats = block_slots(Q4_K_M, 3, seed=4, hidden=HIDDEN, inter=INTER, **OSS)
    host, addr = _host(slots)
    gen = torch.Generator().manual_seed(4)
    t, k = 20, 2
    x = torch.randn((t, HIDDEN), generator=gen).to(DEV)
    tiles, tok, dst, wt = _gemm_case(3, t, k, gen)
    dev = torch.zeros((3, layout.slot_bytes), dtype=torch.uint8, device=DEV)
    dev[0] = host[0].to(DEV)  # expert 0 resident in its slot; 1 and 2 fill theirs
    n = tiles.numel() // 3
    flags = (tiles.view(n, 3)[:, 0] != 0).to(torch.int32)
    got = torch.zeros((t * k, HIDDEN), device=DEV)
    grouped_expert_gemm(x, dev, layout, tiles, tok, dst, wt, got, fills=(flags, tiles.view(n, 3)[:, 0].long(), addr))
    assert torch.equal(dev.cpu(), host)
    want = torch.zeros((t * k, HIDDEN), device=DEV)
    grouped_expert_gemm(x, _stack(floats), f32, tiles, tok, dst, wt, want)
    _same(got.cpu(), want.cpu(), exact=False)  # other tiles (fills', the blocks'): another summation order


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    """A model whose layers differ in format as llama-quantize's Q4_K_M makes them: down in
    Q6_K on one layer, Q4_K on the other (two layers: the interpreter is slow)."""
    import dataclasses

    from ftkit.runtime.random_model import demo_spec, write_random_ftw

    path = tmp_path_factory.mktemp("q4km") / "m.ftw"
    demo = demo_spec(300)
    spec = dataclasses.replace(demo, hidden_size=256, moe_intermediate_size=256, num_layers=2, moe_layers=(0, 1),
                               layer_kinds=demo.layer_kinds[:2])
    formats = [Q4_K_M, ("q4_k",) * 3]
    write_random_ftw(path, spec, seed=5, expert_formats=formats, distinct_experts=4)
    return path


def _logits(path, graphs: bool, **opts) -> torch.Tensor:
    """Logits of a prompt, then of three decode steps (fed the same tokens) and a short
    extend, on CUDA or, without it, on the CPU (the graph step run eagerly in the interpreter)."""
    from ftkit.runtime.engine.graphs import GraphDecode
    from ftkit.runtime.engine.loader import Runtime, RuntimeOptions

    device = DEV if graphs else "cpu"
    rt = Runtime(path, RuntimeOptions(threads=2, device=device, graphs=graphs, dtype="float32", **opts))
    if graphs and not CUDA:
        rt.step.graphs = GraphDecode(rt.decoder, rt.store, capacity=64, capture=False)
    chunks = [[5, 17, 42, 7], [33], [120], [7], [12, 13, 14]]
    kv = rt.new_kv(sum(map(len, chunks)))
    with torch.inference_mode():
        out = [rt.step.forward(torch.tensor(c, device=rt.device), kv).float().cpu() for c in chunks]
    if graphs:
        assert rt.store.device_planner is not None, "the device-planned path did not run"
    rt.close()
    return torch.cat(out)


def test_device_planned_decode_of_mixed_block_layers_matches_the_cpu(q4_k_m):
    """Graph decode and a device-planned extend over layers in different block formats (each
    layer's own layout reaching the GEMV, the GEMM, the fills and the CPU worker) give the cpu
    strategy's logits."""
    ref = _logits(q4_k_m, False, strategy="cpu")
    got = _logits(q4_k_m, True, strategy="hybrid", cache_experts=8, bandwidth_ratio=0.5)
    assert float((got - ref).norm() / ref.norm()) < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
