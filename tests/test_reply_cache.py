"""A finished reply is prefilled into the prefix cache in idle time, so the next agent turn, which
resends prompt + reply, reuses it; outputs stay bitwise equal to a run from scratch (CPU, f32)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ftkit.runtime.engine.generate import Decoding
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.sampling import SamplingParams
from ftkit.runtime.engine.scheduler import Request, Scheduler
from ftkit.runtime.random_model import demo_spec, write_random_ftw
from ftkit.runtime.synthetic import write_tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("reply") / "m.ftw"
    write_random_ftw(path, demo_spec(400), seed=9, side_files=lambda d: write_tokenizer(d, 400))
    return path


PROMPT = list(range(5, 105))


def _first_turn(model, opts: RuntimeOptions) -> tuple[Runtime, Scheduler, list[int]]:
    """A runtime, its scheduler, and the reply to PROMPT it served."""
    rt = Runtime(model, opts)
    sched = Scheduler(rt, rt.resolved.memory.with_sizes(kv_tokens=2048), max_running=2)
    done = threading.Event()
    req = Request(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True), lambda e: e.done and done.set())
    sched.submit(req)
    assert done.wait(120)
    return rt, sched, req.gen.token_ids


def test_reply_is_reused_by_the_next_turn(model):
    rt, sched, reply = _first_turn(model, RuntimeOptions(strategy="cpu", threads=1))
    prompt = PROMPT
    deadline = time.time() + 30
    while sched.stats()["replies_cached"] < 1 and time.time() < deadline:
        time.sleep(0.05)
    assert sched.stats()["replies_cached"] == 1
    sched.close()

    turn2 = prompt + reply + list(range(200, 230))
    resumed = Decoding(rt, turn2, SamplingParams(max_tokens=1))
    resumed.prefill()
    # Reuse reaches into the reply (page-granular, minus the cache's look-ahead), not just the prompt.
    assert resumed.gen.cached_tokens > len(prompt) + len(reply) - 40
    fresh_rt = Runtime(model, RuntimeOptions(strategy="cpu", threads=1, prefix_cache=False))
    fresh = Decoding(fresh_rt, turn2, SamplingParams(max_tokens=1))
    fresh.prefill()
    assert torch.equal(resumed.logits, fresh.logits)
    rt.close()
    fresh_rt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_keeps_the_decoded_reply_rows(model):
    """On a GPU (rounding, not bits) the reply's decoded K/V rows go into the prefix cache as
    the request ends: no idle-time prefill, and the next turn reuses them at once."""
    rt, sched, reply = _first_turn(model, RuntimeOptions(strategy="offload", cache_experts=16, device="cuda", threads=1))
    assert sched.stats()["replies_cached"] == 1 and not sched.replies  # kept at the end, none queued
    sched.close()
    turn2 = PROMPT + reply + list(range(200, 230))
    resumed = Decoding(rt, turn2, SamplingParams(max_tokens=1))
    resumed.prefill()
    assert resumed.gen.cached_tokens > len(PROMPT) + len(reply) - 40
    fresh = Decoding(rt, turn2, SamplingParams(max_tokens=1))
    rt.prefix_cache = None
    fresh.prefill()
    assert int(resumed.logits.argmax()) == int(fresh.logits.argmax())
    rt.close()
