"""The grouped expert GEMV against a float64 reference: on CUDA, or on CPU with
TRITON_INTERPRET=1 (set before triton is imported). Skipped where neither is available."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from ftkit.runtime.experts.pool import expert_forward
from ftkit.runtime.random_model import demo_spec
from ftkit.vocab import slot_layout

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1")


DEV = "cuda" if CUDA else "cpu"


# gpt-oss's experts: biases on gate, up and down, the clamped SwiGLU (its limit bites here: the
# random weights give pre-activations of several units)
OSS = dict(expert_bias=True, swiglu_alpha=1.702, swiglu_limit=7.0)


def _layout(dtype: str, hidden: int, inter: int, oss: bool = False):
    spec = replace(demo_spec(64), hidden_size=hidden, moe_intermediate_size=inter, moe_layers=(0, 1, 2, 3),
                   **(OSS if oss else {}))
    return slot_layout(spec, dtype)


def _random_slots(layout, cap: int, gen: torch.Generator) -> tuple[torch.Tensor, list[dict]]:
    """[cap, slot_bytes] uint8 of random experts, and each one's parts as float64."""
    slots = torch.zeros((cap, layout.slot_bytes), dtype=torch.uint8)
    parts = []
    for c in range(cap):
        p = {q.name: torch.randn(q.shape, generator=gen).to(getattr(torch, q.dtype)) for q in layout.parts}
        for q in layout.parts:
            slots[c, q.offset:q.offset + q.nbytes] = p[q.name].contiguous().view(torch.uint8).reshape(-1)
        parts.append({k: v.double() for k, v in p.items()})
    return slots, parts


def _expert(p: dict, x: torch.Tensor, w: float, act=None) -> torch.Tensor:
    """The float64 reference: the parts in layout order, the layout's activation."""
    return w * expert_forward(x.double()[None], tuple(p.values()), act)[0]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return float((got.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("hidden, inter, oss", [(128, 64, False), (96, 40, False), (96, 40, True)])  # odd: masked tails
def test_grouped_gemv_matches_reference(dtype, hidden, inter, oss):
    from ftkit.kernels.triton.experts import grouped_expert_gemv

    layout = _layout(dtype, hidden, inter, oss)
    gen = torch.Generator().manual_seed(0)
    cap, tokens, items = 5, 3, 7
    slots, parts = _random_slots(layout, cap, gen)
    x = torch.randn((tokens, hidden), generator=gen).to(getattr(torch, dtype))
    sid = torch.randint(0, cap, (items,), generator=gen, dtype=torch.int32)
    tid = torch.randint(0, tokens, (items,), generator=gen, dtype=torch.int32)
    wt = torch.rand(items, generator=gen)
    count = torch.tensor([items - 2], dtype=torch.int32)  # the last two items are padding
    out = grouped_expert_gemv(*(t.to(DEV) for t in (x, slots)), layout,
                              *(t.to(DEV) for t in (sid, tid, wt, count))).cpu()
    ref = torch.stack([_expert(parts[sid[i]], x[tid[i]], float(wt[i]), layout.activation) for i in range(items - 2)])
    assert _rel(out[: items - 2], ref) < (2e-2 if dtype == "bfloat16" else 1e-5)


@pytest.mark.parametrize("oss", [False, True])
def test_gemv_fills_slots_as_it_reads(oss):
    """Items flagged as fills read their expert from (mapped, pinned) host memory by address
    and leave it in their slot (biases too); the others read their slot. Same results as all
    resident."""
    from ftkit.kernels.triton import zero_copy
    from ftkit.kernels.triton.experts import grouped_expert_gemv

    layout = _layout("bfloat16", 96, 40, oss)
    gen = torch.Generator().manual_seed(4)
    host, parts = _random_slots(layout, 6, gen)
    host = host.pin_memory() if CUDA else host
    addr = torch.tensor([zero_copy.device_pointer(r.data_ptr()) if CUDA else r.data_ptr() for r in host])
    slots = torch.zeros((4, layout.slot_bytes), dtype=torch.uint8)
    slots[1], slots[3] = host[5], host[0]  # resident: row 5 in slot 1, row 0 in slot 3
    x = torch.randn((1, 96), generator=gen).to(torch.bfloat16)
    sid = torch.tensor([1, 0, 3, 2], dtype=torch.int32)  # items 1 and 3 fill slots 0 and 2 from rows 2 and 4
    rows = torch.tensor([5, 2, 0, 4])
    flags = torch.tensor([0, 1, 0, 1], dtype=torch.int32)
    wt = torch.tensor([0.1, 0.2, 0.3, 0.4])
    dev = [t.to(DEV) for t in (x, slots, sid, torch.zeros(4, dtype=torch.int32), wt, torch.tensor([4], dtype=torch.int32))]
    out = grouped_expert_gemv(*dev[:2], layout, *dev[2:], (flags.to(DEV), rows.to(DEV), addr.to(DEV))).cpu()
    assert torch.equal(dev[1].cpu()[0], host[2]) and torch.equal(dev[1].cpu()[2], host[4])
    assert torch.equal(dev[1].cpu()[1], host[5]) and not dev[1].cpu()[[1, 3]].ne(slots[[1, 3]]).any()
    ref = torch.stack([_expert(parts[r], x[0], float(w), layout.activation) for r, w in zip(rows.tolist(), wt, strict=True)])
    assert _rel(out, ref) < 2e-2


@pytest.mark.parametrize("dtype, x_dtype", [("bfloat16", "bfloat16"), ("float32", "float32"),
                                            ("bfloat16", "float32")])  # a float32 runtime over bf16 slots
@pytest.mark.parametrize("hidden, inter, oss", [(128, 64, False), (96, 40, False), (96, 40, True)])
def test_grouped_gemm_matches_reference(dtype, x_dtype, hidden, inter, oss):
    """Prefill's grouped GEMM: items sorted by expert, several tiles per expert (one has more
    than a tile's worth of tokens), results scattered to their rows of y."""
    from ftkit.kernels.triton.experts import GEMM_M, gemm_tiles, grouped_expert_gemm

    layout = _layout(dtype, hidden, inter, oss)
    gen = torch.Generator().manual_seed(2)
    cap, t, k = 3, 200, 2
    slots, parts = _random_slots(layout, cap, gen)
    x = torch.randn((t, hidden), generator=gen).to(getattr(torch, x_dtype))
    ids = torch.stack([torch.randperm(cap, generator=gen)[:k] for _ in range(t)])  # [t, k] distinct per token
    wt = torch.rand(t * k, generator=gen)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=cap).tolist()
    assert max(counts) > GEMM_M
    tiles = torch.tensor(gemm_tiles([(s, n) for s, n in enumerate(counts)]), dtype=torch.int32)
    y = torch.zeros((t * k, hidden), dtype=x.dtype).to(DEV)
    grouped_expert_gemm(x.to(DEV), slots.to(DEV), layout, tiles.to(DEV), (order // k).to(torch.int32).to(DEV),
                        order.to(torch.int32).to(DEV), wt[order].to(DEV), y)
    ref = torch.stack([_expert(parts[int(flat[i])], x[i // k], float(wt[i]), layout.activation) for i in range(t * k)])
    assert _rel(y.cpu(), ref) < (2e-2 if x_dtype == "bfloat16" else 1e-5)


def _host_pool(host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Host rows as fills read them (pinned and mapped on CUDA), and each row's address for the device."""
    from ftkit.kernels.triton import zero_copy

    host = host.pin_memory() if CUDA else host
    return host, torch.tensor([zero_copy.device_pointer(r.data_ptr()) if CUDA else r.data_ptr() for r in host])


def _gemm_case(layout, host_rows: list[int], segments: list[tuple[int, int]], gen: torch.Generator, t: int = 6):
    """A GEMM work list over `segments` (slot, items) whose tile j runs host row host_rows[j]:
    x, tiles, tokens, dst (a permutation), weights and each item's row."""
    from ftkit.kernels.triton.experts import gemm_tiles

    n = sum(c for _, c in segments)
    x = torch.randn((t, layout.parts[0].shape[1]), generator=gen).to(torch.bfloat16)
    tiles = torch.tensor(gemm_tiles(segments), dtype=torch.int32)
    assert tiles.numel() == 3 * len(host_rows)  # one tile per segment
    tok = torch.randint(0, t, (n,), generator=gen, dtype=torch.int32)
    dst = torch.randperm(n, generator=gen).to(torch.int32)
    row = torch.tensor([r for r, (_, c) in zip(host_rows, segments, strict=True) for _ in range(c)])
    return x, tiles, tok, dst, torch.rand(n, generator=gen), row


@pytest.mark.parametrize("oss", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])  # float32: the upcast path on CUDA too
def test_gemm_fills_slots_as_it_reads(x_dtype, oss):
    """Flagged GEMM tiles read their expert from (mapped, pinned) host memory by address and
    leave it in their slot (two tiles of one expert may both be flagged); the others read their
    slot. Same results as all resident."""
    from ftkit.kernels.triton.experts import grouped_expert_gemm

    layout = _layout("bfloat16", 96, 40, oss)
    gen = torch.Generator().manual_seed(5)
    host, parts = _random_slots(layout, 5, gen)
    host, addr = _host_pool(host)
    slots = torch.randint(0, 256, (4, layout.slot_bytes), generator=gen, dtype=torch.uint8)  # garbage
    slots[1], slots[3] = host[3], host[0]  # resident: row 3 in slot 1, row 0 in slot 3
    rows = torch.tensor([3, 2, 2, 0, 4])  # tiles 1, 2 fill slot 0 from row 2, tile 4 slot 2 from row 4
    flags = torch.tensor([0, 1, 1, 0, 1], dtype=torch.int32)
    x, tiles, tok, dst, wt, row = _gemm_case(layout, rows.tolist(), [(1, 3), (0, 4), (0, 2), (3, 5), (2, 3)], gen)
    x = x.to(x_dtype)
    dev = [t.to(DEV) for t in (x, slots, tiles, tok, dst, wt)]
    y = torch.zeros((len(row), 96), dtype=x_dtype, device=DEV)
    grouped_expert_gemm(*dev[:2], layout, *dev[2:], y, fills=(flags.to(DEV), rows.to(DEV), addr.to(DEV)))
    got = dev[1].cpu()
    for s, r in ((0, 2), (2, 4)):  # every part of a filled slot holds exactly the host bytes
        for q in layout.parts:
            assert torch.equal(got[s, q.offset:q.offset + q.nbytes], host[r, q.offset:q.offset + q.nbytes]), (s, q.name)
    assert torch.equal(got[[1, 3]], slots[[1, 3]])
    ref = torch.stack([_expert(parts[int(row[i])], x[tok[i]], float(wt[i]), layout.activation) for i in range(len(row))])
    assert _rel(y.cpu()[dst.long()], ref) < (2e-2 if x_dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("fill", [False, True])
def test_gemm_skips_tiles_past_the_device_count(fill):
    """With a device count, tiles past it do nothing (y's rows of their items keep a sentinel,
    a flagged one leaves its slot alone); the valid ones are computed as usual."""
    from ftkit.kernels.triton.experts import grouped_expert_gemm

    layout = _layout("bfloat16", 96, 40)
    gen = torch.Generator().manual_seed(6)
    slots, parts = _random_slots(layout, 4, gen)
    rows = [2, 0, 3, 1]
    x, tiles, tok, dst, wt, row = _gemm_case(layout, rows, [(2, 4), (0, 3), (3, 2), (1, 5)], gen)
    valid = 7  # the items of the first two tiles
    fills = None
    if fill:  # tiles 1 (valid) and 3 (past the count) fill slots 0 and 1 from a host copy of the pool
        host, addr = _host_pool(slots.clone())
        slots[[0, 1]] = 0
        fills = tuple(t.to(DEV) for t in (torch.tensor([0, 1, 0, 1], dtype=torch.int32), torch.tensor(rows), addr))
    d_slots = slots.to(DEV)
    y = torch.full((len(row), 96), 7.0, dtype=torch.bfloat16, device=DEV)
    grouped_expert_gemm(x.to(DEV), d_slots, layout, *(t.to(DEV) for t in (tiles, tok, dst, wt)), y,
                        count=torch.tensor([2], dtype=torch.int32, device=DEV), fills=fills)
    out = y.cpu()[dst.long()]
    assert (out[valid:] == 7.0).all()
    ref = torch.stack([_expert(parts[int(row[i])], x[tok[i]], float(wt[i]), layout.activation) for i in range(valid)])
    assert _rel(out[:valid], ref) < 2e-2
    if fill:
        assert torch.equal(d_slots.cpu()[0], host[0]) and not d_slots.cpu()[1].any()


@pytest.mark.parametrize("n", [1, 1023, 1024, 2500])
def test_pull_reads_a_page_locked_list_into_device_memory(n):
    """`zero_copy.pull` (prefill's GEMM work list read by the SMs, not a copy engine) copies every
    value across its blocks' edges and nothing past the end."""
    from ftkit.kernels.triton import zero_copy

    host = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
    if CUDA:
        host = host.pin_memory()
    out = torch.full((n + 5,), 7, dtype=torch.int32, device=DEV)
    zero_copy.pull(host, out[:n])
    assert torch.equal(out.cpu()[:n], host) and (out.cpu()[n:] == 7).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_rms_norm_matches_torch(dtype):
    from ftkit.kernels.triton.norm import rms_norm as triton_rms_norm
    from ftkit.runtime.models.layers import rms_norm

    dev = DEV
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((3, 4, 96), generator=gen).to(dtype).to(dev)
    for w in (torch.randn(96, generator=gen).to(dtype), torch.randn(96, generator=gen)):  # same or float32 weight
        w = w.to(dev)
        got = triton_rms_norm(x, w, 1e-6)
        ref = rms_norm(x.cpu(), w.cpu(), 1e-6)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.allclose(got.cpu().float(), ref.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)  # bf16: 2 ulps
