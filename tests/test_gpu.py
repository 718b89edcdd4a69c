"""The same store on a CUDA device tier: every strategy matches the CPU `fused` run.

Run on a GPU machine with `pytest -m gpu tests/test_gpu.py`; skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.ftw.random_model import demo_spec, write_random_ftw

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
    out = [rt.decoder.forward(torch.tensor(c, device=rt.device), kv).float().cpu()
           for c in [PROMPT] + [[t] for t in DECODE] + [EXTEND]]
    rt.close()
    return torch.cat(out)


@pytest.mark.parametrize("cfg", [
    dict(strategy="fused"),
    dict(strategy="offload", cache_experts=5),
    dict(strategy="cpu"),
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
