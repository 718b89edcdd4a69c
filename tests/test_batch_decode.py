"""Batched decode: one forward for one new token of several sequences agrees with decoding each
alone (to float32 rounding: batched matrix products may sum in another order)."""

from __future__ import annotations

import pytest
import torch

from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.tools.convert.pipeline import convert, prepare


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "qwen3_next", "gpt_oss"])  # gpt_oss: its ring wraps
def test_forward_batch_matches_single_sequences(hf_checkpoint, tmp_path, family):
    path = tmp_path / "m.ftw"
    convert(prepare(hf_checkpoint(family)), path)
    rt = Runtime(path, RuntimeOptions(strategy="hybrid", cache_experts=6, bandwidth_ratio=0.5, threads=2))
    prompts = [[5, 9, 13, 2, 77], [40, 3], [8, 8, 8, 100, 31, 7, 19]]
    steps = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]

    def caches():
        out = []
        for p in prompts:
            kv = rt.new_kv(16)
            rt.step.forward(torch.tensor(p), kv)
            out.append(kv)
        return out

    alone, together = caches(), caches()
    with torch.inference_mode():
        for j in range(3):
            want = torch.stack([rt.step.forward(torch.tensor([s[j]]), kv)[-1] for s, kv in zip(steps, alone, strict=True)])
            got = rt.decoder.forward_batch(torch.tensor([s[j] for s in steps]), together)
            assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (family, j)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert [kv.length for kv in together] == [len(p) + 3 for p in prompts]
    rt.close()
