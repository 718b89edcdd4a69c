"""The same store on a CUDA device tier: every strategy matches the CPU `fused` run.

Run on a GPU machine with `pytest -m gpu tests/test_gpu.py`; skipped without CUDA.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.random_model import demo_spec, write_random_ftw

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# 24 tokens x top-4: more items than the decode GEMV takes (the prefill GEMM, the device-side
# sort) and most of each layer's 16 experts (layer streaming where the cache holds two layers).
PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 120, 33, 281, 14, 77, 190, 2, 56, 203, 9, 141, 62, 230, 18]
DECODE = [33, 120, 7, 7, 201, 15, 80, 2]
# Then 20 tokens behind the prompt, as an agent turn after a prefix hit: attention under a mask,
# 80 items (the GEMM, the CPU branch's inputs staged with the routing).
EXTEND = [71, 4, 188, 26, 93, 140, 5, 61, 222, 39, 17, 250, 8, 133, 47, 99, 12, 205, 66, 31]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "m.ftw"
    write_random_ftw(path, demo_spec(300), dtype="bfloat16", seed=2)
    return path


def logits(path, **opts) -> torch.Tensor:
    rt = Runtime(path, RuntimeOptions(threads=4, **opts))
    kv = rt.new_kv(len(PROMPT) + len(DECODE) + len(EXTEND))
    out = [rt.step.forward(torch.tensor(c, device=rt.device), kv).float().cpu()
           for c in [PROMPT] + [[t] for t in DECODE] + [EXTEND]]
    rt.close()
    return torch.cat(out)


@pytest.mark.parametrize("cfg", [
    dict(strategy="fused"),
    dict(strategy="offload", cache_experts=5),
    dict(strategy="cpu"),  # two layers of staging slots on a GPU (resolve.prefill_staging)
    dict(strategy="cpu", stream_prefill=False),  # none
    dict(strategy="hybrid", cache_experts=9, bandwidth_ratio=0.5),
    dict(strategy="offload", cache_experts=40, stream_prefill=True),
    dict(strategy="hybrid", cache_experts=40, bandwidth_ratio=0.5, stream_prefill=True),
])
def test_cuda_tier_matches_cpu_fused(model, cfg):
    ref = logits(model, strategy="fused", dtype="float32")
    got = logits(model, device="cuda", dtype="float32", **cfg)
    rel = (got - ref).norm() / ref.norm()
    assert rel < 1e-3, (cfg, rel)  # tf32/cuBLAS reduction order, not bitwise
    bf = logits(model, device="cuda", **cfg)  # the weights' own dtype: bf16
    assert ((bf - ref).norm() / ref.norm()) < 3e-2, cfg


@pytest.mark.parametrize("t,s,heads,kv_heads,d", [(300, 4096, 16, 4, 128), (100, 124, 8, 2, 16)],
                         ids=["long-cache", "short-cache"])
def test_a_chunk_behind_cached_keys_runs_flash_with_gqa(monkeypatch, t, s, heads, kv_heads, d):
    """A chunk behind cached keys (longer than the few-query kernel takes) runs flash attention
    with the causal diagonal at the last key: as close to a float32 reference with an explicit
    mask as the masked kernel gets; behind a long cache without materialising the K/V heads
    repeated to the query heads; behind a short one (where a key more or less per row shows)
    far from a reference whose diagonal is one key off."""
    from ftkit.runtime.models import layers

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for n, h in ((t, heads), (s, kv_heads), (s, kv_heads)))
    assert layers._flash_lower_right(q, k, v)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = layers.attention(q, k, v, offset=s - t).float()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    if s > 1000:  # small tensors: the allocator's rounding, not the kernel, sets the peak
        assert peak < 2 * s * heads * d * 2  # less than K and V repeated to the query heads would take

    def reference(shift: int) -> torch.Tensor:
        kr, vr = (x.float().repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        scores = torch.einsum("thd,shd->hts", q.float(), kr) * d**-0.5
        visible = torch.arange(s, device="cuda")[None] <= torch.arange(s - t, s, device="cuda")[:, None] + shift
        return torch.einsum("hts,shd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), vr)

    def err(x: torch.Tensor, ref: torch.Tensor) -> float:
        return ((x - ref).norm() / ref.norm()).item()

    ref = reference(0)
    monkeypatch.setattr(layers, "_flash_lower_right", lambda *a: False)
    masked = layers.attention(q, k, v, offset=s - t).float()
    assert err(out, ref) < 2 * err(masked, ref) + 1e-3 < 1e-2
    if s < 1000:
        assert err(out, reference(-1)) > 10 * err(out, ref)


def test_a_long_second_chunk_matches_cpu_fused(model, monkeypatch):
    """A second prefill chunk past the few-query kernel's size (flash behind the cache in bf16,
    the masked kernel in float32) gives the CPU reference's logits; in bf16 as closely as the
    masked kernel does."""
    from ftkit.runtime.models import layers

    more = [(7 * i + 3) % 300 for i in range(100)]

    def run(**opts) -> torch.Tensor:
        rt = Runtime(model, RuntimeOptions(threads=4, strategy="fused", **opts))
        kv = rt.new_kv(len(PROMPT) + len(more))
        out = [rt.step.forward(torch.tensor(c, device=rt.device), kv).float().cpu() for c in (PROMPT, more)]
        rt.close()
        return torch.cat(out)

    ref = run(dtype="float32")
    assert ((run(device="cuda", dtype="float32") - ref).norm() / ref.norm()) < 1e-3
    flash = ((run(device="cuda") - ref).norm() / ref.norm()).item()
    monkeypatch.setattr(layers, "_flash_lower_right", lambda *a: False)
    masked = ((run(device="cuda") - ref).norm() / ref.norm()).item()
    print(f"bf16 against float32: flash {flash:.4f}, masked {masked:.4f}")  # -s
    assert flash < 1.5 * masked and flash < 0.1  # bf16 roundings, amplified by random layers


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_layer_by_layer_prefill_reads_each_layers_routing_once(model, monkeypatch, strategy):
    """A prompt run layer by layer in pieces routes every piece of a layer before their experts
    run, and the store reads that routing back in one copy a layer (`ExpertStore.expect`), not
    once a piece: no piece sorts its own, and the logits are one forward's."""
    from ftkit.runtime.experts.store import ExpertStore

    ids = torch.randint(0, 300, (240,), generator=torch.Generator().manual_seed(4))  # 3 x 80 tokens x top-4
    sorted_calls = []
    real = ExpertStore._sorted
    monkeypatch.setattr(ExpertStore, "_sorted", lambda self, flat: sorted_calls.append(flat.numel()) or real(self, flat))
    out = {}
    for chunk in (None, 80):
        rt = Runtime(model, RuntimeOptions(threads=4, device="cuda", dtype="float32", strategy=strategy,
                                           cache_experts=40, bandwidth_ratio=0.5))
        with torch.inference_mode():
            out[chunk] = rt.step.forward(ids.to(rt.device), rt.new_kv(240), chunk=chunk).float().cpu()
        calls, sorted_calls[:] = list(sorted_calls), []
        assert not rt.store.ahead
        rt.close()
        assert len(calls) == (rt.spec.num_moe_layers if chunk is None else 0), calls
    torch.testing.assert_close(out[80], out[None], rtol=1e-4, atol=1e-4)


def test_gpu_budget_holds_a_long_prefill(tmp_path):
    """Everything the runtime allocates on the device (dense weights, slots, graph K/V, a request's
    KV, a prompt run layer by layer in two 8192-token pieces, decode steps) stays within
    --gpu-budget: the plan counts the prefill workspace (the whole prompt's residual stream
    included), the prefix cache and the graph K/V, not only dense weights and KV."""
    from ftkit.runtime.engine.resolve import resolve
    from ftkit.runtime.ftw.reader import FTWModel
    from ftkit.runtime.prefix_cache.prefill import prefill

    spec = dataclasses.replace(demo_spec(4096), hidden_size=1024, moe_intermediate_size=512, num_experts=32,
                               top_k=8, num_heads=16, num_kv_heads=4, head_dim=64, num_layers=2,
                               moe_layers=(0, 1), layer_kinds=demo_spec(8).layer_kinds[:2],
                               max_position_embeddings=16384)
    path = tmp_path / "long.ftw"
    write_random_ftw(path, spec, dtype="bfloat16")
    tokens = 16384
    sized = RuntimeOptions(device="cuda", strategy="offload", cache_experts=24, kv_tokens=tokens)
    budget = resolve(FTWModel(path), sized).memory.total_bytes
    opts = dataclasses.replace(sized, cache_experts=None, gpu_budget=budget)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    rt = Runtime(path, opts)
    try:
        assert rt.store.cache.capacity == 24
        assert rt.step.graphs is not None and rt.step.graphs.capacity == tokens  # decode below: graphs
        kv = rt.new_kv(tokens)
        ids = torch.randint(0, spec.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
        prompt, steps = ids[:-4], ids[-4:]  # layer by layer, the second piece behind 8192 keys, then decode
        prefill(rt.step, prompt.tolist(), kv, (), max_chunk=rt.prefill_chunk)
        for t in steps:
            rt.step.forward(t.view(1).to(rt.device), kv)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        print(f"peak {peak / 2**20:.1f} MiB of a {budget / 2**20:.1f} MiB budget")  # -s: the plan's margin
        assert peak <= budget, (peak, budget)
    finally:
        rt.close()
