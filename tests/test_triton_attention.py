"""The few-query attention kernel (an extend behind a long cache) against `layers.attention` on
the CPU: key chunks combined by log-sum-exp, causal offsets, sliding windows, GQA groups, odd
head sizes. On CUDA, or on CPU with TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

from ftkit.runtime.models.layers import attention

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("t, offset, window", [(5, 700, None), (32, 37, None), (1, 600, 100), (9, 1100, 300),
                                               (3, 0, None)])
@pytest.mark.parametrize("heads, kv_heads, d", [(8, 2, 16), (3, 3, 24)])
def test_few_query_attention_matches_sdpa(t, offset, window, heads, kv_heads, d):
    from ftkit.kernels.triton.attention import few_query_attention

    gen = torch.Generator().manual_seed(t + offset)
    s = offset + t
    q = torch.randn((t, heads, d), generator=gen)
    k, v = (torch.randn((s, kv_heads, d), generator=gen) for _ in range(2))
    ref = attention(q, k, v, offset, window)  # CPU: SDPA's math path
    got = few_query_attention(*(a.to(DEV) for a in (q, k, v)), offset, window).cpu()
    assert (got - ref).abs().max() < 1e-4
    if CUDA:  # bf16 as the runtime runs it
        bf = few_query_attention(*(a.to(DEV, torch.bfloat16) for a in (q, k, v)), offset, window).float().cpu()
        assert ((bf - ref).norm() / ref.norm()) < 2e-2


def test_few_query_attention_refuses_what_it_does_not_cover():
    from ftkit.kernels.triton.attention import MAX_QUERIES, few_query_attention

    q = torch.zeros((MAX_QUERIES + 1, 2, 16))
    kv = torch.zeros((MAX_QUERIES + 1, 2, 16))
    with pytest.raises(ValueError):
        few_query_attention(q, kv, kv, 0)


@pytest.mark.parametrize("t, offset, window, ring", [(1, 700, 100, 163), (5, 300, 100, 163), (4, 21, 4, 8),
                                                     (1, 5, 4, 8), (64, 1000, 128, 191)])
def test_kernels_address_a_sliding_ring(t, offset, window, ring):
    """A sliding layer's ring (models/kv.py: key position p at row p mod ring, only the last ring
    positions kept): rope_store writes the new keys there, and the few-query and decode kernels
    read the windows from it as they read them from every row."""
    from ftkit.kernels.triton.attention import decode_attention, few_query_attention
    from ftkit.kernels.triton.decode import rope_store

    gen = torch.Generator().manual_seed(t + offset)
    heads, kv_heads, d, s = 4, 2, 16, offset + t
    q = torch.randn((t, heads, d), generator=gen)
    k, v = (torch.randn((s, kv_heads, d), generator=gen) for _ in range(2))
    ref = attention(q, k, v, offset, window)
    rows = torch.arange(max(0, s - ring), s)  # what the ring holds once the new keys are in
    k_ring, v_ring = torch.zeros((ring, kv_heads, d)), torch.zeros((ring, kv_heads, d))
    k_ring[rows % ring], v_ring[rows % ring] = k[rows], v[rows]
    got = few_query_attention(*(a.to(DEV) for a in (q, k_ring, v_ring)), offset, window, ring=ring).cpu()
    assert (got - ref).abs().max() < 1e-4
    if t == 1:  # a graph step's: the position on the device
        pos = torch.tensor([offset], device=DEV)
        got = decode_attention(q.to(DEV), k_ring.to(DEV), v_ring.to(DEV), pos, window, ring=ring).cpu()
        assert (got - ref).abs().max() < 1e-4
    # rope_store (no rotation: cos 1, sin 0) puts keys and values at their positions' rows
    kc, vc = torch.zeros((ring, kv_heads, d), device=DEV), torch.zeros((ring, kv_heads, d), device=DEV)
    cos, sin = torch.ones((s, d), device=DEV), torch.zeros((s, d), device=DEV)
    new = k[offset:].reshape(t, -1).to(DEV), v[offset:].reshape(t, -1).to(DEV)
    rope_store(q.reshape(t, -1).to(DEV), *new, None, None, 1e-6, cos, sin, torch.tensor([offset], device=DEV),
               kc, vc, ring=ring)
    at = torch.arange(offset, s) % ring
    assert torch.equal(kc[at].cpu(), k[offset:]) and torch.equal(vc[at].cpu(), v[offset:])
