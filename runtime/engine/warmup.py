"""Start-up warm-up: each kind of forward a server runs, once, before the first request.

On a GPU the first prefill, extend, graph step, sampled step and batched step each compile
Triton kernels (kept in Triton's disk cache, so a restart only loads them), choose cuBLAS
kernels and capture the decode graphs: on the GPU machine the first request through the server
took 5.15 s to its first token and decoded at 9.5 tok/s, the next of its size 0.23 s
(docs/benchmarks.md). The warm-up pays that at start-up, on random tokens, and leaves the
counters and the prefix cache as it found them; the hybrid split restarts before its last two
requests, whose outcomes steer it as a first request's would. The batched step is
captured for every batch size up to the graphs' `max_batch`: a capture inside a served pass
would count against the batched mode's measured rate (engine/decode_mode.py), which is
measured again only every PROBE passes. Last, two requests take the request path itself
(`request_path`).
"""

from __future__ import annotations

import time

import torch

from .generate import Decoding, drive
from .loader import Runtime
from .sampling import Sampler, SamplingParams

EXTEND = 16  # a short extend (an agent turn after a prefix hit)
LONG_EXTEND = 96  # past the graph extend's few tokens: the host-planned path
# Triton compiles a kernel again for each class of an integer argument it specializes on: 1, a
# multiple of 16, or neither (a token count, or it times 2, 4 or 8, in the launches). So each
# extend runs once at each of these offsets, and a served turn of any length finds its kernels
# compiled (after this warm-up no request compiled one, CA). These were added for an agent's slow
# turn 2 through the server; its cause proved to be another (`request_path`).
CLASSES = (0, 1, 2, 4, 8)
STEPS = 4  # decode steps of each kind
HIT = 40  # new tokens of the request_path's prefix hit


def extend_lengths(room: int) -> list[int]:
    """The warm-up's extends, in order: EXTEND and LONG_EXTEND tokens plus each of CLASSES, as
    many as fit in `room` tokens (the longer ones left out first)."""
    lengths = [n + c for n in (EXTEND, LONG_EXTEND) for c in CLASSES]
    while lengths and sum(lengths) > room:
        lengths.pop()
    return lengths


def warm_up(rt: Runtime) -> float | None:
    """Run a prompt, short and longer extends (one of each token-count class), greedy and
    sampled graph steps and batched steps; seconds taken (None: nothing to warm, on a CPU)."""
    if rt.device.type != "cuda":
        return None
    t0 = time.perf_counter()
    spec, step, graphs = rt.spec, rt.step, rt.step.graphs
    # enough tokens that a layer's routing reaches most experts, so the prefill streams layers
    prompt = min(max(512, 8 * spec.num_experts // spec.top_k), spec.max_position_embeddings // 2)
    batches = graphs.max_batch if graphs is not None else 2  # the largest batched step
    # the sequence stays within what the graphs hold, so its decode steps warm them too
    room = min(spec.max_position_embeddings, graphs.capacity if graphs is not None else 1 << 62)
    extends = extend_lengths(room - prompt - 2 * STEPS - batches)
    total = prompt + sum(extends) + 2 * STEPS + batches
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (total,), generator=gen).to(rt.device)
    with torch.inference_mode():
        kv, others = rt.new_kv(total), [rt.new_kv(4 + batches) for _ in range(batches - 1)]
        step.forward(ids[:prompt], kv, last_only=True, chunk=rt.prefill_chunk)
        at = prompt
        for n in extends:
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
    # after the restart: the requests' outcomes steer the split, as a first request's would
    n = min(2 * prompt, spec.max_position_embeddings - HIT - 2 * STEPS)
    if n > 0:
        long = torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist()
        request_path(rt, long, torch.randint(0, spec.vocab_size, (HIT,), generator=gen).tolist())
    torch.cuda.synchronize(rt.device)
    rt.store.stats.reset()
    return time.perf_counter() - t0


def request_path(rt: Runtime, prompt: list[int], more: list[int]) -> None:
    """`prompt` and then `prompt + more` (a prefix hit) as a server runs requests (`Decoding`:
    resume, prefill, the first token sampled on the host, a burst, remember), sampled; then the
    prefix cache forgets them.

    Measured in-process on an H100 host (q4km, the server's request path, first of a shape
    against the next): after the forwards alone, a first 1024-token request took 131.6 ms
    against 97.9 (CUDA loads a kernel at its first launch: gone with CUDA_MODULE_LOADING=EAGER;
    which kernels, not traced), and an agent's first prefix hit 51.0 against 27.9 ms (not module
    loading; the likeliest cause, not traced: the hybrid split of few-token layers, which starts
    again at the restart). Three sampled requests after the restart (600 tokens, a 40-token hit
    on it, 520) brought both to 7 ms over the next (105.6 / 98.7, 33.2 / 26.1 ms); the same two
    requests run before the restart, the prompt 512 tokens, did not (128.1 / 92.2, 73.2 / 24.6).
    Hence these, after the restart, the prompt twice the forwards'. Not yet measured as written."""
    for ids in (prompt, prompt + more):
        d = Decoding(rt, ids, SamplingParams(max_tokens=STEPS, temperature=1.0, seed=0, ignore_eos=True))
        for _ in drive(d):
            pass
        d.remember()
    if rt.prefix_cache is not None:
        rt.prefix_cache.clear()
