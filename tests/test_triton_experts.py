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


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("hidden, inter", [(128, 64), (96, 40)])  # odd sizes: masked tails
def test_grouped_gemv_matches_reference(dtype, hidden, inter):
    from ftkit.kernels.triton.experts import grouped_expert_gemv

    dev = "cuda" if CUDA else "cpu"
    spec = demo_spec(64).__class__(**{**demo_spec(64).to_dict(), "hidden_size": hidden,
                                      "moe_intermediate_size": inter, "moe_layers": (0, 1, 2, 3)})
    layout = slot_layout(spec, dtype)
    gen = torch.Generator().manual_seed(0)
    cap, tokens, items = 5, 3, 7
    slots = torch.zeros((cap, layout.slot_bytes), dtype=torch.uint8)
    parts = []
    for c in range(cap):
        p = {q.name: torch.randn(q.shape, generator=gen).to(getattr(torch, dtype)) for q in layout.parts}
        for q in layout.parts:
            slots[c, q.offset:q.offset + q.nbytes] = p[q.name].contiguous().view(torch.uint8).reshape(-1)
        parts.append(p)
    x = torch.randn((tokens, hidden), generator=gen).to(getattr(torch, dtype))
    sid = torch.randint(0, cap, (items,), generator=gen, dtype=torch.int32)
    tid = torch.randint(0, tokens, (items,), generator=gen, dtype=torch.int32)
    wt = torch.rand(items, generator=gen)
    count = torch.tensor([items - 2], dtype=torch.int32)  # the last two items are padding
    y = torch.full((items, hidden), float("nan"))
    out = grouped_expert_gemv(*(t.to(dev) for t in (x, slots)), layout,
                              *(t.to(dev) for t in (sid, tid, wt, count))).float().cpu()
    for i in range(items - 2):
        p = {k: v.double() for k, v in parts[sid[i]].items()}
        xv = x[tid[i]].double()
        h = torch.nn.functional.silu(p["gate"] @ xv) * (p["up"] @ xv)
        y[i] = (wt[i].double() * (p["down"] @ h)).float()
    ref = y[: items - 2]
    got = out[: items - 2]
    rel = (got - ref).norm() / ref.norm()
    assert rel < (2e-2 if dtype == "bfloat16" else 1e-5), rel
    assert not torch.isnan(got).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_rms_norm_matches_torch(dtype):
    from ftkit.kernels.triton.norm import rms_norm as triton_rms_norm
    from ftkit.runtime.models.layers import rms_norm

    dev = "cuda" if CUDA else "cpu"
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((3, 4, 96), generator=gen).to(dtype).to(dev)
    for w in (torch.randn(96, generator=gen).to(dtype), torch.randn(96, generator=gen)):  # same or float32 weight
        w = w.to(dev)
        got = triton_rms_norm(x, w, 1e-6)
        ref = rms_norm(x.cpu(), w.cpu(), 1e-6)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.allclose(got.cpu().float(), ref.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)  # bf16: 2 ulps
