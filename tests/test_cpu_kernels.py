"""The CPU expert kernel against a float64 torch reference, for every slot dtype and odd shapes.

No pytest fixtures: `python tests/test_cpu_kernels.py` runs the same checks where pytest is absent
(the GPU machine)."""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch

from ftkit.kernels.cpu import load
from ftkit.runtime.experts.pool import expert_forward, expert_weights
from ftkit.runtime.random_model import demo_spec
from ftkit.vocab import BIAS_PARTS, SlotLayout, slot_layout

# (H, I): odd sizes leave tails after every vector width; q8_0 needs multiples of 32.
SHAPES = {"float32": [(37, 23), (128, 64), (200, 77)], "float16": [(37, 23), (160, 61)],
          "bfloat16": [(37, 23), (2048, 96), (131, 200)], "q8_0": [(96, 160), (64, 32)]}


def _kernel():
    kernel = load()
    if kernel is None:
        import pytest

        pytest.skip("the CPU kernel cannot be built here (no C++ compiler)")
    return kernel


def make_slots(dtype: str, h: int, i: int, n: int, seed: int, **spec: object) -> tuple[SlotLayout, list[torch.Tensor]]:
    """`n` random expert slots of the FTW layout for (H, I) in `dtype`; `spec`: more ModelSpec
    fields (gpt-oss's expert biases and clamped SwiGLU)."""
    layout = slot_layout(dataclasses.replace(demo_spec(64), hidden_size=h, moe_intermediate_size=i, **spec), dtype)
    gen = torch.Generator().manual_seed(seed)
    slots = []
    for _ in range(n):
        slot = torch.zeros(layout.slot_bytes, dtype=torch.uint8)
        for p in layout.parts:
            if p.name in BIAS_PARTS:
                raw = (torch.randn(p.shape, generator=gen) * 0.5).view(torch.uint8)
            elif dtype == "q8_0":  # per 32-block: an fp16 scale, then 32 int8
                rows, blocks = p.shape[0], p.shape[1] // 32
                scale = (torch.rand(rows, blocks, 1, generator=gen) * 0.02 + 0.001).half().view(torch.uint8)
                q = torch.randint(-128, 128, (rows, blocks, 32), generator=gen, dtype=torch.int8).view(torch.uint8)
                raw = torch.cat([scale, q], dim=-1).reshape(-1)
            else:
                w = torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5
                raw = w.to(getattr(torch, dtype)).reshape(-1).view(torch.uint8)
            slot[p.offset : p.offset + p.nbytes] = raw
        slots.append(slot)
    return layout, slots


def reference(layout, slot, x, w, idx, k):
    weights = expert_weights(layout, slot, torch.float64)
    return expert_forward(x.double()[idx // k], weights, layout.activation) * w.double()[idx, None]


def test_matches_float64_reference_and_writes_every_element():
    kernel = _kernel()
    for dtype in SHAPES:  # GGUF blocks: test_cpu_block_kernels.py
        for h, i in SHAPES[dtype]:
            for n_tok, n_exp, threads in ((1, 3, 1), (5, 2, 2), (19, 4, 2)):  # 19 tokens: several blocks
                k = 2
                layout, slots = make_slots(dtype, h, i, n_exp, seed=h * i + n_tok)
                x = torch.randn(n_tok, h)
                w = torch.rand(n_tok * k)
                # Expert e takes assignments e, e + n_exp, ...: every row of out belongs to one expert.
                groups = [torch.arange(e, n_tok * k, n_exp) for e in range(n_exp)]
                out = torch.full((n_tok * k, h), float("nan"))
                kernel.experts(layout, slots, groups, x, w, out, k, threads)
                assert not out.isnan().any(), (dtype, h, i, "unwritten output")
                for slot, idx in zip(slots, groups, strict=True):
                    if len(idx):
                        ref = reference(layout, slot, x, w, idx, k)
                        torch.testing.assert_close(out[idx].double(), ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item(),
                                                   msg=lambda m, at=f"{dtype} H={h} I={i} T={n_tok}": f"{at}: {m}")


def test_biases_and_the_clamped_swiglu_match_the_reference():
    """gpt-oss's experts: biases on gate, up and down, and the clamped SwiGLU, for every slot
    dtype (GGUF blocks with biases: test_cpu_block_kernels.py); a limit of 0.7 clamps a good share
    of the values (without it the results differ)."""
    kernel = _kernel()
    for dtype in SHAPES:
        h, i = SHAPES[dtype][0]
        layout, slots = make_slots(dtype, h, i, 3, seed=h + i, expert_bias=True, swiglu_alpha=1.702,
                                   swiglu_limit=0.7)
        assert layout.biased and layout.activation is not None
        x, w, k = torch.randn(7, h), torch.rand(14), 2
        groups = [torch.arange(e, 14, 3) for e in range(3)]
        out = torch.full((14, h), float("nan"))
        kernel.experts(layout, slots, groups, x, w, out, k, 2)
        for slot, idx in zip(slots, groups, strict=True):
            ref = reference(layout, slot, x, w, idx, k)
            torch.testing.assert_close(out[idx].double(), ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())
            plain = dataclasses.replace(layout, activation=None)
            assert (reference(plain, slot, x, w, idx, k) - ref).abs().max() > 1e-2 * ref.abs().max()


def test_untouched_rows_and_empty_experts():
    kernel = _kernel()
    layout, slots = make_slots("bfloat16", 48, 40, 2, seed=1)
    x, w = torch.randn(3, 48), torch.rand(3)
    out = torch.full((3, 48), float("nan"))
    kernel.experts(layout, slots, [torch.tensor([2]), torch.tensor([], dtype=torch.int64)], x, w, out, 1, 2)
    assert out[:2].isnan().all() and not out[2].isnan().any()
    kernel.experts(layout, [], [], x, w, out, 1, 2)  # nothing to do is not an error


def _three_experts(seed: int):
    """A call of three bf16 experts over 11 tokens (top-2), and its result in assignment rows."""
    kernel = _kernel()
    layout, slots = make_slots("bfloat16", 131, 200, 3, seed=seed)
    x, w, k = torch.randn(11, 131), torch.rand(22), 2
    groups = [torch.arange(0, 22, 2), torch.tensor([1, 5, 9]), torch.tensor([3])]
    out = torch.zeros(22, 131)
    kernel.experts(layout, slots, groups, x, w, out, k, 2)
    return kernel, layout, slots, x, w, k, groups, out


def test_runner_thread_gives_the_same_bits_into_compact_rows():
    """The store's CPU branch: the call on the runner's native thread, its rows packed in order."""
    kernel, layout, slots, x, w, k, groups, direct = _three_experts(8)
    runner = kernel.runner()
    try:
        for _ in range(3):  # the thread is reused call after call
            compact = torch.full((15, 131), float("nan"))
            kernel.start_experts(runner, layout, slots, groups, x, w, compact, k, 2, torch.arange(15))
            busy = runner.wait()
            assert busy is not None and busy >= 0
            assert torch.equal(compact, direct[torch.cat(groups)])
        assert runner.wait() is None  # nothing submitted
    finally:
        runner.close()


def test_runner_signals_its_end_through_a_done_word():
    """A call given a done word writes its value there once its rows are written: the GPU's
    stream waits on it (zero_copy.wait_word) instead of the host. With TRITON_INTERPRET=1 the
    wait runs on the CPU word itself."""
    kernel, layout, slots, x, w, k, groups, direct = _three_experts(10)
    word = torch.zeros(16, dtype=torch.int32)
    runner = kernel.runner()
    try:
        for value in (7, 8):
            compact = torch.full((15, 131), float("nan"))
            kernel.start_experts(runner, layout, slots, groups, x, w, compact, k, 2, torch.arange(15),
                                 done=(word.data_ptr(), value))
            if os.environ.get("TRITON_INTERPRET") == "1":
                from ftkit.kernels.triton.zero_copy import wait_word

                wait_word(word, value)  # returns once the runner has written the value, and clears it
                assert int(word[0]) == 0
                assert torch.equal(compact, direct[torch.cat(groups)])
            assert runner.wait() is not None
            assert int(word[0]) in (0, value)
            assert torch.equal(compact, direct[torch.cat(groups)])
            word.zero_()
    finally:
        runner.close()


def test_a_shared_split_runs_each_expert_once():
    """Hybrid's shared split: the caller takes experts from the front while the runner runs;
    the runner computes exactly the rest, with the same bits, and leaves the caller's rows."""
    kernel, layout, slots, x, w, k, groups, direct = _three_experts(9)
    ends = torch.tensor([0] + [len(g) for g in groups]).cumsum(0).tolist()
    runner = kernel.runner()
    try:
        for first in range(4):  # the caller takes 0..3 experts before the runner starts
            split = kernel.new_split(len(groups))
            mine = [kernel.take_front(split) for _ in range(first)]
            assert mine == list(range(min(first, 3))) + [None] * (first - 3)
            compact = torch.full((15, 131), float("nan"))
            kernel.start_experts(runner, layout, slots, groups, x, w, compact, k, 2, torch.arange(15), split)
            while kernel.take_front(split) is not None:  # racing the runner for the rest
                pass
            runner.wait()
            front = kernel.split_front(split)
            assert front >= min(first, 3) and kernel.take_front(split) is None and kernel.split_left(split) == 0
            assert compact[: ends[front]].isnan().all()
            assert torch.equal(compact[ends[front] :], direct[torch.cat(groups)][ends[front] :])
    finally:
        runner.close()


def test_result_does_not_depend_on_batching_or_threads():
    """The store relies on it: an assignment's bits must not depend on what shares the call."""
    kernel, layout, slots, x, w, k, groups, together = _three_experts(7)
    for slot, idx in zip(slots, groups, strict=True):
        for sub in (idx, idx[:1], idx[-3:]):
            alone = torch.zeros(22, 131)
            kernel.experts(layout, [slot], [sub], x, w, alone, k, 1)
            assert torch.equal(alone[sub], together[sub])


def test_calls_from_several_threads_at_once():
    """Each calling thread runs its own team (OpenMP's for direct calls, remade when the thread
    count changes): calls from three threads at once, at several counts, each give the bits of
    a one-thread call, also after the teams' threads have gone to sleep."""
    import threading
    import time

    kernel, layout, slots, x, w, k, groups, _ = _three_experts(9)
    ref = torch.zeros(22, 131)
    kernel.experts(layout, slots, groups, x, w, ref, k, 1)
    failures = []

    def calls(threads: int) -> None:
        for i in range(20):
            out = torch.zeros(22, 131)
            kernel.experts(layout, slots, groups, x, w, out, k, threads + i % 2)
            if not torch.equal(out, ref):
                failures.append(threads)
            if i == 10:
                time.sleep(0.01)  # past a caller's spin: the helpers sleep, the next call wakes them

    callers = [threading.Thread(target=calls, args=(t,)) for t in (2, 3, 4)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    assert not failures


def test_rejects_bad_input():
    kernel = _kernel()
    layout, slots = make_slots("float32", 32, 32, 1, seed=0)
    for x, out, idx in ((torch.randn(2, 32).half(), torch.zeros(2, 32), [torch.tensor([0])]),
                        (torch.randn(2, 31), torch.zeros(2, 32), [torch.tensor([0])]),
                        (torch.randn(2, 32), torch.zeros(2, 32), [torch.tensor([2])])):
        try:
            kernel.experts(layout, slots, idx, x, torch.ones(2), out, 1, 1)
        except ValueError:
            continue
        raise AssertionError("bad input accepted")


def test_read_sums_the_buffer():
    kernel = _kernel()
    buf = torch.ones(1 << 20)
    assert kernel.read(buf.view(torch.uint8), 2) == buf.numel()
    assert math.isclose(kernel.read(torch.arange(48.0).view(torch.uint8), 1), sum(range(48)))


def test_peak_counts_the_operations_it_runs():
    kernel = _kernel()
    lanes = {"avx512": 16, "avx2": 8, "scalar": 1}[kernel.isa]
    assert kernel.lib.ftk_peak(0, 10, 2) == 2 * 10 * 12 * lanes * 2  # threads x rounds x FMAs x lanes x 2
    assert kernel.lib.ftk_peak(1, 10, 2) in (0, 2 * 10 * 12 * 64 * 2)  # 0: no int8 path here
    assert kernel.peak_gflops(1, seconds=0.01) > 0


def test_torch_fallback_is_chosen_when_asked():
    load.cache_clear()
    os.environ["FTKIT_CPU_KERNEL"] = "torch"
    try:
        assert load() is None
    finally:
        del os.environ["FTKIT_CPU_KERNEL"]
        load.cache_clear()


if __name__ == "__main__":
    tests = [f for name, f in sorted(globals().items()) if name.startswith("test_")]
    print(f"CPU kernel: {load().isa if load() else 'unavailable'}")
    for f in tests:
        f()
        print(f"ok {f.__name__}")
    print(f"{len(tests)} passed")
    sys.exit(0)
