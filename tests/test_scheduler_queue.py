"""The scheduler's queue never waits forever: a request that a rebuild left too big for the KV
budget fails with a 400-class error, and the requests behind it run."""

from __future__ import annotations

import threading

import pytest

from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.sampling import SamplingParams
from ftkit.runtime.engine.scheduler import RebuildError, Request, Scheduler
from ftkit.runtime.random_model import demo_spec, write_random_ftw


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("queue") / "m.ftw"
    write_random_ftw(path, demo_spec(300), seed=4)
    return path


def test_a_request_a_rebuild_outgrew_fails_and_the_queue_moves_on(model):
    opts = RuntimeOptions(strategy="cpu", threads=1)
    rt = Runtime(model, opts)
    sched = Scheduler(rt, rt.resolved.memory.with_sizes(kv_tokens=2048), max_running=1)
    ends: dict[str, object] = {}
    done = {name: threading.Event() for name in "abcd"}

    def request(name: str, prompt: int, tokens: int) -> Request:
        def sink(ev, name=name):
            if ev.done:
                ends[name] = ev
                done[name].set()
        return Request(list(range(5, 5 + prompt)), SamplingParams(max_tokens=tokens, ignore_eos=True), sink)

    running = request("a", 8, 40)
    sched.submit(running)
    for name in "bc":  # wait behind the running one: 414 KV tokens each
        sched.submit(request(name, 14, 400))
    sched.rebuild(None, 300).result(60)  # now they can never fit
    sched.submit(request("d", 4, 4))  # a small one behind them
    assert all(done[n].wait(120) for n in "abcd")
    sched.close()
    rt.close()
    assert ends["a"].error is None and ends["d"].error is None and len(ends["d"].gen.token_ids) == 4
    for name in "bc":
        assert ends[name].status == 400 and "KV budget of 300" in ends[name].error


def test_a_rebuild_past_the_model_is_refused_not_clamped(model):
    opts = RuntimeOptions(strategy="offload", cache_experts=8, threads=1)
    rt = Runtime(model, opts)
    sched = Scheduler(rt, rt.resolved.memory.with_sizes(kv_tokens=256), max_running=1)
    with pytest.raises(RebuildError, match="expert rows"):
        sched.rebuild(10**30, None).result(60)
    assert rt.store.cache.capacity == 8
    sched.close()
    rt.close()
