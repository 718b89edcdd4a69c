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
