"""The grouped expert GEMV against a float64 reference: on CUDA, or on CPU with
TRITON_INTERPRET=1 (set before triton is imported). Skipped where neither is available."""

from __future__ import annotations

import os

import pytest
import torch

from ftkit.runtime.ftw.manifest import slot_layout
from ftkit.runtime.ftw.random_model import demo_spec

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1")


DEV = "cuda" if CUDA else "cpu"


def _layout(dtype: str, hidden: int, inter: int):
    spec = demo_spec(64).__class__(**{**demo_spec(64).to_dict(), "hidden_size": hidden,
                                      "moe_intermediate_size": inter, "moe_layers": (0, 1, 2, 3)})
    return slot_layout(spec, dtype)


def _random_slots(layout, cap: int, gen: torch.Generator) -> tuple[torch.Tensor, list[dict]]:
    """[cap, slot_bytes] uint8 of random experts, and each one's parts as float64."""
    dt = getattr(torch, layout.dtype)
    slots = torch.zeros((cap, layout.slot_bytes), dtype=torch.uint8)
    parts = []
    for c in range(cap):
        p = {q.name: torch.randn(q.shape, generator=gen).to(dt) for q in layout.parts}
        for q in layout.parts:
            slots[c, q.offset:q.offset + q.nbytes] = p[q.name].contiguous().view(torch.uint8).reshape(-1)
        parts.append({k: v.double() for k, v in p.items()})
    return slots, parts


def _expert(p: dict, x: torch.Tensor, w: float) -> torch.Tensor:
    x = x.double()
    return w * (p["down"] @ (torch.nn.functional.silu(p["gate"] @ x) * (p["up"] @ x)))


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return float((got.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("hidden, inter", [(128, 64), (96, 40)])  # odd sizes: masked tails
def test_grouped_gemv_matches_reference(dtype, hidden, inter):
    from ftkit.kernels.triton.experts import grouped_expert_gemv

    layout = _layout(dtype, hidden, inter)
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
    ref = torch.stack([_expert(parts[sid[i]], x[tid[i]], float(wt[i])) for i in range(items - 2)])
    assert _rel(out[: items - 2], ref) < (2e-2 if dtype == "bfloat16" else 1e-5)


def test_gemv_fills_slots_as_it_reads():
    """Items flagged as fills read their expert from (mapped, pinned) host memory by address
    and leave it in their slot; the others read their slot. Same results as all resident."""
    from ftkit.kernels.triton import zero_copy
    from ftkit.kernels.triton.experts import grouped_expert_gemv

    layout = _layout("bfloat16", 96, 40)
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
    ref = torch.stack([_expert(parts[r], x[0], float(w)) for r, w in zip(rows.tolist(), wt, strict=True)])
    assert _rel(out, ref) < 2e-2


@pytest.mark.parametrize("dtype, x_dtype", [("bfloat16", "bfloat16"), ("float32", "float32"),
                                            ("bfloat16", "float32")])  # a float32 runtime over bf16 slots
@pytest.mark.parametrize("hidden, inter", [(128, 64), (96, 40)])
def test_grouped_gemm_matches_reference(dtype, x_dtype, hidden, inter):
    """Prefill's grouped GEMM: items sorted by expert, several tiles per expert (one has more
    than a tile's worth of tokens), results scattered to their rows of y."""
    from ftkit.kernels.triton.experts import GEMM_M, gemm_tiles, grouped_expert_gemm

    layout = _layout(dtype, hidden, inter)
    gen = torch.Generator().manual_seed(2)
    cap, t, k = 3, 110, 2
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
    ref = torch.stack([_expert(parts[int(flat[i])], x[i // k], float(wt[i])) for i in range(t * k)])
    assert _rel(y.cpu(), ref) < (2e-2 if x_dtype == "bfloat16" else 1e-5)


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
