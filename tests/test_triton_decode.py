"""The decode kernels against the torch ops they replace: per-head
RMSNorm + RoPE + cache writes, masked attention over the cache (full and sliding window,
GQA, partial rotary, odd head sizes), RMSNorm with and without the residual add before it, and
the router's softmax top-k. On CUDA, or on CPU with TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

from ftkit.runtime.models.layers import apply_rope, decode_attention, rms_norm

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, d, r, norm", [(4, 2, 32, 32, True), (6, 2, 24, 12, False)])
@pytest.mark.parametrize("tokens", [1, 5])
def test_rope_store_matches_torch(dtype, heads, kv_heads, d, r, norm, tokens):
    """One token (a decode step) or several (an extend), read as the column views of one Q/K/V
    product: rows pos..pos+tokens of the caches written, nothing else."""
    from ftkit.kernels.triton.decode import rope_store

    gen = torch.Generator().manual_seed(0)
    positions, pos = 40, 29
    qkv = torch.randn((tokens, (heads + 2 * kv_heads) * d), generator=gen).to(dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)  # strided rows
    qw, kw = (torch.randn(d, generator=gen).to(dtype) for _ in range(2))
    angles = torch.rand((positions, r // 2), generator=gen) * 6
    cos, sin = (torch.cat((f(angles), f(angles)), -1).to(dtype) for f in (torch.cos, torch.sin))
    kc, vc = (torch.zeros((positions, kv_heads, d), dtype=dtype) for _ in range(2))
    dev = [t.to(DEV) for t in (qkv, qw, kw, cos, sin, torch.tensor([pos]), kc, vc)]
    dq, dk, dv = dev[0].split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    got = rope_store(dq, dk, dv, dev[1] if norm else None, dev[2] if norm else None, 1e-6, *dev[3:])
    qh, kh = q.reshape(tokens, heads, d), k.reshape(tokens, kv_heads, d)
    if norm:
        qh, kh = rms_norm(qh, qw, 1e-6), rms_norm(kh, kw, 1e-6)
    end = pos + tokens
    ref_q, ref_k = (apply_rope(a, cos[pos:end], sin[pos:end]) for a in (qh, kh))
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    assert got.shape == (tokens, heads, d)
    assert torch.allclose(got.cpu().float(), ref_q.float(), **tol)
    kc, vc = dev[6].cpu(), dev[7].cpu()
    assert torch.allclose(kc[pos:end].float(), ref_k.float(), **tol)
    assert torch.equal(vc[pos:end], v.reshape(tokens, kv_heads, d))
    assert not kc[:pos].any() and not vc[end:].any()  # only rows pos..end are written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, d, r, norm", [(4, 2, 32, 32, True), (6, 2, 24, 12, False)])
def test_rope_store_batch_form_writes_each_sequence_at_its_position(dtype, heads, kv_heads, d, r, norm):
    """One token of each of three sequences (a batched step): token t rotated at its own
    position pos[t], its K/V written into row pos[t] of its own sequence's caches (found by
    address), nothing else written, the shape-giving caches untouched."""
    from ftkit.kernels.triton.decode import rope_store

    gen = torch.Generator().manual_seed(4)
    positions, pos = 40, [29, 0, 17]
    t = len(pos)
    qkv = torch.randn((t, (heads + 2 * kv_heads) * d), generator=gen).to(dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    qw, kw = (torch.randn(d, generator=gen).to(dtype) for _ in range(2))
    angles = torch.rand((positions, r // 2), generator=gen) * 6
    cos, sin = (torch.cat((f(angles), f(angles)), -1).to(dtype) for f in (torch.cos, torch.sin))
    # each sequence's caches as long as it is (the longest: `positions`), the shape-giving pair apart
    kcs, vcs = ([torch.zeros((n, kv_heads, d), dtype=dtype, device=DEV) for n in (30, positions, 18)] for _ in range(2))
    shape_k, shape_v = (torch.zeros((positions, kv_heads, d), dtype=dtype, device=DEV) for _ in range(2))
    caches = torch.tensor([[c.data_ptr() for c in kcs], [c.data_ptr() for c in vcs]], device=DEV)
    dev = [a.to(DEV) for a in (qkv, qw, kw, cos, sin, torch.tensor(pos))]
    dq, dk, dv = dev[0].split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    got = rope_store(dq, dk, dv, dev[1] if norm else None, dev[2] if norm else None, 1e-6, *dev[3:],
                     shape_k, shape_v, caches=caches).cpu()
    qh, kh = q.reshape(t, heads, d), k.reshape(t, kv_heads, d)
    if norm:
        qh, kh = rms_norm(qh, qw, 1e-6), rms_norm(kh, kw, 1e-6)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for b, p in enumerate(pos):
        ref_q, ref_k = (apply_rope(a[b : b + 1], cos[p : p + 1], sin[p : p + 1]) for a in (qh, kh))
        assert torch.allclose(got[b : b + 1].float(), ref_q.float(), **tol)
        kc, vc = kcs[b].cpu(), vcs[b].cpu()
        assert torch.allclose(kc[p : p + 1].float(), ref_k.float(), **tol)
        assert torch.equal(vc[p], v[b].reshape(kv_heads, d))
        others = torch.arange(kc.shape[0]) != p
        assert not kc[others].any() and not vc[others].any()  # only row pos[b] of its own caches
    assert not shape_k.any() and not shape_v.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pos, window", [(0, None), (150, None), (150, 37), (63, 64), (700, None), (700, 300),
                                         (1023, 100)])
def test_attention_matches_torch(dtype, pos, window):
    """Graph decode's attention: one chunk near the start; past DECODE_CHUNK keys several, each
    sized from the position on the device, the window's keys only."""
    from ftkit.kernels.triton.attention import decode_attention as triton_decode_attention

    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, d, positions = 8, 2, 40, 1024
    q = torch.randn((1, heads, d), generator=gen).to(dtype)
    kc, vc = (torch.randn((positions, kv_heads, d), generator=gen).to(dtype) for _ in range(2))
    got = triton_decode_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), torch.tensor([pos]).to(DEV), window).cpu()
    keys = torch.arange(positions)
    mask = (keys <= pos) & ((keys > pos - window) if window else True)
    ref = decode_attention(q, kc, vc, mask)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    assert torch.allclose(got.float(), ref.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 37, 300])
def test_attention_batch_form_attends_each_query_over_its_own_cache(dtype, window):
    """A batched step's attention: query t over rows 0..pos[t] (the window's, for a sliding
    layer) of its own sequence's caches, found by address; the grid sized by the longest, so a
    short sequence's chunks past its keys end at once, and one past DECODE_CHUNK keys is split."""
    from ftkit.kernels.triton.attention import decode_attention as triton_decode_attention

    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, d, positions = 8, 2, 40, 1024
    pos, lengths = [700, 0, 150], [800, 1, positions]
    q = torch.randn((len(pos), heads, d), generator=gen).to(dtype)
    kcs, vcs = ([torch.randn((n, kv_heads, d), generator=gen).to(dtype) for n in lengths] for _ in range(2))
    shape = torch.zeros((positions, kv_heads, d), dtype=dtype, device=DEV)  # gives the layout and the grid
    on_dev = [[c.to(DEV) for c in cs] for cs in (kcs, vcs)]
    caches = torch.tensor([[c.data_ptr() for c in cs] for cs in on_dev], device=DEV)
    got = triton_decode_attention(q.to(DEV), shape, shape, torch.tensor(pos).to(DEV), window, caches).cpu()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for b, p in enumerate(pos):
        keys = torch.arange(lengths[b])
        mask = (keys <= p) & ((keys > p - window) if window else True)
        ref = decode_attention(q[b : b + 1], kcs[b], vcs[b], mask)
        assert torch.allclose(got[b : b + 1].float(), ref.float(), **tol)


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_topk_matches_torch(renorm, dtype):
    from ftkit.kernels.triton.router import softmax_topk as triton_softmax_topk
    from ftkit.runtime.models.layers import softmax_topk

    gen = torch.Generator().manual_seed(2)
    # 60 experts (a masked tail); distinct even in bf16: the order of ties is not specified
    logits = torch.stack([torch.randperm(60, generator=gen) * 0.1 - 3 for _ in range(5)]).to(dtype)
    ids, w = triton_softmax_topk(logits.to(DEV), 6, renorm, dtype)
    ref_ids, ref_w = softmax_topk(logits, 6, renorm, dtype)  # torch on CPU
    assert torch.equal(ids.cpu(), ref_ids)
    assert w.dtype == dtype and torch.allclose(w.cpu().float(), ref_w.float(), rtol=1e-2 if dtype != torch.float32 else 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True], ids=["weight", "one-plus-weight"])
def test_rms_norms_match_torch(dtype, offset):
    """Both forms: the weight times the cast-back value, and Qwen3-Next's float32 (1 + weight)."""
    from ftkit.kernels.triton.norm import add_rms_norm
    from ftkit.kernels.triton.norm import rms_norm as triton_rms_norm

    gen = torch.Generator().manual_seed(3)
    x, delta = (torch.randn((3, 100), generator=gen).to(dtype) for _ in range(2))  # a masked tail
    w = ((0 if offset else 1) + 0.1 * torch.randn(100, generator=gen)).to(dtype)  # (1 + w) near 1 too
    s, h = add_rms_norm(x.to(DEV), delta.to(DEV), w.to(DEV), 1e-6, offset)
    assert s.dtype == h.dtype == dtype and s.shape == h.shape == x.shape
    # bf16: the interpreter truncates where the GPU rounds to nearest, so a few ulps of slack
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    assert torch.allclose(s.cpu().float(), (x + delta).float(), **tol)
    if dtype == torch.float32 or CUDA:
        assert torch.equal(s.cpu(), x + delta)
    assert torch.allclose(h.cpu().float(), rms_norm(x + delta, w, 1e-6, offset).float(), **tol)
    got = triton_rms_norm(x.to(DEV), w.to(DEV), 1e-6, offset)
    assert got.dtype == dtype and torch.allclose(got.cpu().float(), rms_norm(x, w, 1e-6, offset).float(), **tol)


@pytest.mark.parametrize("n, k, bias, bn, bk", [(40, 96, False, None, 32), (7, 130, True, 4, 32), (128, 64, False, 1, 32),
                                                (2048, 48, True, None, None)])
def test_gemv_matches_linear(n, k, bias, bn, bk):
    """One token through the Triton GEMV as through F.linear: float32 sums, one rounding (the
    interpreter rounds toward zero, so two bf16 steps of slack). The last case takes `tiles`'
    choice for a weight of many rows (several rows a program, a K step past K)."""
    import torch.nn.functional as F

    from ftkit.kernels.triton.gemv import gemv

    gen = torch.Generator().manual_seed(n)
    w, x = torch.randn((n, k), generator=gen).bfloat16(), torch.randn((1, k), generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    ref = F.linear(x.float(), w.float(), b.float() if bias else None)
    got = gemv(*(t.to(DEV) if t is not None else None for t in (x, w, b)), bn=bn, bk=bk)
    assert got.shape == (1, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2**-6, atol=1e-2)
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x.to(DEV), w.to(DEV).t())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_delta_rule_step_matches_torch(hf_checkpoint, tmp_path, monkeypatch, dtype):
    """A decode token's DeltaNet core in the two Triton launches (kernels/triton/delta_rule.py:
    the conv and its state shift, then the delta rule and the gated norm), taken on CUDA, gives
    the torch ops' logits and recurrent states token after token (the interpreter here)."""
    if not CUDA and dtype == "bfloat16":
        pytest.skip("the interpreter truncates bf16 where the GPU rounds")
    from test_fidelity import PROMPT, _rel_err

    from ftkit.kernels.triton import delta_rule
    from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
    from ftkit.runtime.models import qwen3_next_forward
    from ftkit.tools.convert.pipeline import convert, prepare

    convert(prepare(hf_checkpoint("qwen3_next"), dtype=dtype), tmp_path / "m.ftw")
    rt = Runtime(tmp_path / "m.ftw", RuntimeOptions(threads=2, device=DEV, strategy="fused", graphs=False))
    tokens, runs = [5, 77, 300, 12, 9, 41], []
    for kernels in (None, delta_rule):
        monkeypatch.setattr(qwen3_next_forward, "_step_kernels", lambda x, k=kernels: k)
        cache = rt.new_kv(len(PROMPT) + len(tokens))
        rt.step.forward(PROMPT.to(DEV), cache)
        logits = torch.cat([rt.step.forward(torch.tensor([t], device=DEV), cache) for t in tokens]).cpu()
        runs.append((logits, {(i, n): t.float().cpu() for i, st in cache.states.items() for n, t in st.items()}))
    rt.close()
    (ref, ref_states), (got, got_states) = runs
    tol = 1e-4 if dtype == "float32" else 5e-2  # bf16: one rounding apart per step, random weights amplify
    assert _rel_err(got, ref) < tol
    assert ref_states.keys() == got_states.keys() == {(i, n) for i in range(3) for n in ("conv", "ssm")}
    for name, want in ref_states.items():
        assert torch.allclose(got_states[name], want, rtol=tol, atol=tol), name
