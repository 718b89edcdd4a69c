"""Several prompts in one forward (`MoEDecoder.forward_many`, the scheduler's joint prefill): each
sequence's logits and cache are its own forward's, bitwise on the CPU."""

from __future__ import annotations

import threading

import pytest
import torch

from ftkit.runtime.engine import scheduler as scheduler_mod
from ftkit.runtime.engine.generate import generate
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.sampling import SamplingParams
from ftkit.runtime.engine.scheduler import Request, Scheduler
from ftkit.runtime.random_model import demo_spec, write_random_ftw
from ftkit.tools.convert.pipeline import convert, prepare

PROMPTS = [list(range(3, 40)), [40, 3, 17, 99, 5, 6, 7, 8, 1], list(range(100, 170, 2))]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_forward_many_is_each_prompts_own_forward(hf_checkpoint, tmp_path, family):
    path = tmp_path / "m.ftw"
    convert(prepare(hf_checkpoint(family)), path)
    rt = Runtime(path, RuntimeOptions(strategy="cpu", threads=2))
    cuts = [[16, 32], [], [16]]
    alone, together = [rt.new_kv(80) for _ in PROMPTS], [rt.new_kv(80) for _ in PROMPTS]
    with torch.inference_mode():
        want = [rt.decoder.forward(torch.tensor(p), kv, last_only=True, chunk=24, cuts=c)
                for p, kv, c in zip(PROMPTS, alone, cuts, strict=True)]
        got = rt.decoder.forward_many([torch.tensor(p) for p in PROMPTS], together, last_only=True,
                                      chunk=24, cuts=cuts)
    for w, g, a, t, p in zip(want, got, alone, together, PROMPTS, strict=True):
        assert g.shape == (1, rt.spec.vocab_size) and torch.equal(g, w)
        assert t.length == a.length == len(p)
        assert a.states.keys() == t.states.keys()  # recurrent layers: their states
        assert all(torch.equal(a.states[i][k], t.states[i][k]) for i in a.states for k in a.states[i])
        assert all(torch.equal(a.k[i][: len(p)], t.k[i][: len(p)]) and torch.equal(a.v[i][: len(p)], t.v[i][: len(p)])
                   for i in a.k)
    rt.close()


def test_forward_many_refuses_snapshots_of_several(hf_checkpoint, tmp_path):
    path = tmp_path / "m.ftw"
    convert(prepare(hf_checkpoint("qwen3_moe")), path)
    rt = Runtime(path, RuntimeOptions(strategy="cpu", threads=1))
    with pytest.raises(ValueError, match="one sequence"):
        rt.decoder.forward_many([torch.tensor(p) for p in PROMPTS[:2]], [rt.new_kv(64) for _ in range(2)],
                                snapshot_at=[4])
    rt.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("joint") / "m.ftw"
    write_random_ftw(path, demo_spec(300), seed=5)
    return path


def test_requests_arriving_together_prefill_in_one_forward(model):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    shared = list(range(10, 60))
    prompts = [shared + [7, 8, 9], shared + [200, 201], list(range(61, 90))]
    rt = Runtime(model, RuntimeOptions(strategy="cpu", threads=1))
    alone = [generate(rt, p, params).token_ids for p in prompts]  # one after another, the cache warm
    rt.close()

    rt = Runtime(model, RuntimeOptions(strategy="cpu", threads=1))
    sched = Scheduler(rt, rt.resolved.memory, max_running=4)
    ends: dict[int, object] = {}
    done = [threading.Event() for _ in prompts]

    def sink(ev, n):
        if ev.done:
            ends[n] = ev
            done[n].set()

    with sched.cond:  # the loop waits on this lock: all three are admitted in one pass
        for n, p in enumerate(prompts):
            sched.submit(Request(p, params, lambda ev, n=n: sink(ev, n)))
    assert all(d.wait(120) for d in done)
    stats = sched.stats()
    sched.close()
    rt.close()
    assert all(ends[n].error is None for n in range(len(prompts)))
    assert [ends[n].gen.token_ids for n in range(len(prompts))] == alone
    assert stats["prefill_forwards"] == 1 and stats["completed"] == len(prompts)


def test_a_pass_waits_for_requests_on_their_way_and_no_longer(model, monkeypatch):
    """A request submitted while another is on its way (`arrival`) waits for it and both prefill
    in one forward; a request with nothing on its way is not held."""
    monkeypatch.setattr(scheduler_mod, "ARRIVAL_WAIT_S", 600.0)  # only an arrival ends the wait
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    rt = Runtime(model, RuntimeOptions(strategy="cpu", threads=1))
    sched = Scheduler(rt, rt.resolved.memory, max_running=4)
    done = [threading.Event() for _ in range(3)]
    errors = []

    def sink(ev, n):
        if ev.done:
            errors.append(ev.error)
            done[n].set()

    try:
        sched.submit(Request(PROMPTS[0], params, lambda ev: sink(ev, 0)))  # alone: not held
        assert done[0].wait(120)
        arrived = sched.arrival()
        sched.submit(Request(PROMPTS[1], params, lambda ev: sink(ev, 1)))
        assert not done[1].wait(0.2) and sched.stats()["prefill_forwards"] == 1  # held for the other
        sched.submit(Request(PROMPTS[2], params, lambda ev: sink(ev, 2)))
        arrived()
        arrived()  # a second call does nothing
        assert done[1].wait(120) and done[2].wait(120)
        assert sched.arriving == 0 and errors == [None] * 3
        assert sched.stats()["prefill_forwards"] == 2  # the first alone, the other two together
    finally:
        sched.close()
        rt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_forward_many_on_the_gpu_agrees_with_each_forward(hf_checkpoint, tmp_path, strategy):
    path = tmp_path / "m.ftw"
    convert(prepare(hf_checkpoint("qwen3_moe")), path)
    rt = Runtime(path, RuntimeOptions(device="cuda", dtype="float32", strategy=strategy, cache_experts=6,
                                      bandwidth_ratio=0.5, threads=2))
    inputs = [torch.tensor(p, device="cuda") for p in PROMPTS]
    alone, together = [rt.new_kv(80) for _ in PROMPTS], [rt.new_kv(80) for _ in PROMPTS]
    with torch.inference_mode():
        want = [rt.step.forward(x, kv, last_only=True, chunk=24) for x, kv in zip(inputs, alone, strict=True)]
        got = rt.step.forward_many(inputs, together, last_only=True, chunk=24)
    for w, g in zip(want, got, strict=True):
        assert (g - w).abs().max() <= 1e-4 * w.abs().max() and torch.equal(g.argmax(-1), w.argmax(-1))
    rt.close()
