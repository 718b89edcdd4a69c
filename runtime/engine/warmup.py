"""Start-up warm-up: each kind of forward a server runs, once, before the first request.

On a GPU the first prefill, extend, graph step, sampled step and batched step each compile
Triton kernels (kept in Triton's disk cache, so a restart only loads them), choose cuBLAS
kernels and capture the decode graphs: on the GPU machine the first request through the server
took 5.15 s to its first token and decoded at 9.5 tok/s, the next of its size 0.23 s
(docs/benchmarks.md). The warm-up pays that at start-up, on random tokens, outside the prefix
cache, and leaves the counters and the hybrid split as it found them. The batched step is
captured for every batch size up to the graphs' `max_batch`: a capture inside a served pass
would count against the batched mode's measured rate (engine/decode_mode.py), which is
measured again only every PROBE passes.
"""

from __future__ import annotations

import time

import torch

from .loader import Runtime
from .sampling import Sampler, SamplingParams

EXTEND = 16  # a short extend (an agent turn after a prefix hit)
LONG_EXTEND = 96  # past the graph extend's few tokens: the host-planned path
STEPS = 4  # decode steps of each kind


def warm_up(rt: Runtime) -> float | None:
    """Run a prompt, a short and a longer extend, greedy and sampled graph steps and batched
    steps; seconds taken (None: nothing to warm, on a CPU)."""
    if rt.device.type != "cuda":
        return None
    t0 = time.perf_counter()
    spec, step, graphs = rt.spec, rt.step, rt.step.graphs
    # enough tokens that a layer's routing reaches most experts, so the prefill streams layers
    prompt = min(max(512, 8 * spec.num_experts // spec.top_k), spec.max_position_embeddings // 2)
    batches = graphs.max_batch if graphs is not None else 2  # the largest batched step
    total = prompt + EXTEND + LONG_EXTEND + 2 * STEPS + batches
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (total,), generator=gen).to(rt.device)
    with torch.inference_mode():
        kv, others = rt.new_kv(total), [rt.new_kv(4 + batches) for _ in range(batches - 1)]
        step.forward(ids[:prompt], kv, last_only=True, chunk=rt.prefill_chunk)
        at = prompt
        for n in (EXTEND, LONG_EXTEND):
            step.forward(ids[at : at + n], kv, last_only=True)
            at += n
        for other in others:
            step.forward(ids[:4], other)
        if graphs is not None and graphs.accepts(kv):
            sampler = Sampler(SamplingParams(temperature=0.7, top_p=0.95, seed=0))
            for pick in (None, sampler):
                for _ in graphs.pipeline(int(ids[at]), kv, STEPS, pick):
                    pass
                at += STEPS
            for n in range(2, batches + 1):
                caches = [kv, *others[: n - 1]]
                captured = graphs.batched(caches)
                graphs.batch(ids[at : at + n], caches)
                if not captured:  # the eager batch: one size compiles its kernels
                    break
        torch.cuda.synchronize(rt.device)
    plan = rt.store.device_planner
    if plan is not None:
        plan.restart()  # compile time is no measure of the hybrid split
    rt.store.stats.reset()
    return time.perf_counter() - t0
