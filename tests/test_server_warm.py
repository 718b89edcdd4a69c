"""The server's start-up request: it takes the whole HTTP path in-process (the key check, the
route, the streamed reply, the scheduler), then the scheduler forgets it: counters, timings and
the prefix cache are as a fresh server's."""

from __future__ import annotations

import pytest

from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.scheduler import Scheduler
from ftkit.runtime.random_model import demo_spec, write_random_ftw
from ftkit.runtime.server.app import create_app
from ftkit.runtime.server.core import ServerState
from ftkit.runtime.server.warm import warm_http


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    path = tmp_path_factory.mktemp("warm") / "m.ftw"
    write_random_ftw(path, demo_spec(300), seed=5)
    rt = Runtime(path, RuntimeOptions(strategy="cpu", threads=1))
    yield rt
    rt.close()


def test_the_start_up_request_runs_then_leaves_nothing(rt):
    sched = Scheduler(rt, rt.resolved.memory, max_running=2)
    try:
        state = ServerState(rt, sched, "m", api_key="secret")
        seen = []
        real = rt.step.forward
        rt.step.forward = lambda *a, **k: seen.append(1) or real(*a, **k)
        try:
            warm_http(create_app(state), state)
        finally:
            del rt.step.forward
        assert seen  # it ran through the model
        stats = sched.stats()
        assert stats["submitted"] == stats["completed"] == stats["generated_tokens"] == 0 and not stats["recent"]
        assert rt.prefix_cache.info()["tokens"] == 0 and rt.prefix_cache.info()["requests"] == 0
        assert not sched.replies
    finally:
        sched.close()


def test_a_failing_start_up_request_is_one_clear_error(rt):
    async def refusing(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b'{"error": "busy"}'})

    sched = Scheduler(rt, rt.resolved.memory, max_running=1)
    try:
        with pytest.raises(ValueError, match=r"start-up request failed \(503\): .*busy"):
            warm_http(refusing, ServerState(rt, sched, "m"))
    finally:
        sched.close()
