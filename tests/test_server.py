"""ft-run serve end to end: the real uvicorn server on an ephemeral loopback port, the built-in
model on CPU, driven with the official openai and anthropic SDKs.

The model has random weights, so replies that must contain something (a tool call, a stop
string) are scripted: a test-only Sampler picks the tokens of a script for one reserved seed,
while everything else (prefill, decode, detokenisation, stops, parsing, the APIs) runs for real.
The same hook records the token ids a seed produced, to compare runs exactly.
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import threading
import time
import weakref
from types import SimpleNamespace

import anthropic
import httpx2 as httpx  # the HTTP client the installed openai and anthropic SDKs use
import openai
import pytest

from ftkit.runtime.engine import generate as generate_mod
from ftkit.runtime.engine import scheduler as scheduler_mod
from ftkit.runtime.engine.sampling import Sampler as RealSampler
from ftkit.runtime.engine.sampling import SamplingParams
from ftkit.runtime.engine.scheduler import Event
from ftkit.runtime.random_model import demo_spec
from ftkit.runtime.server.core import Job
from ftkit.runtime.synthetic import EOS_TOKEN
from serving import served, write_model

KEY = "test-key"
MODEL = "demo"
SCRIPT_SEED = 4242  # requests with this seed emit SCRIPTS[...] (set by the test) instead of sampling
SCRIPT: dict[str, str] = {"text": ""}
RECORDED: dict[int, list[int]] = {}  # seed -> token ids chosen (every seeded request)


class ScriptedSampler:
    """Test-only stand-in for engine.sampling.Sampler (see the module docstring)."""

    def __init__(self, params):
        self.real = RealSampler(params)
        self.seed = params.seed
        if params.seed is not None:
            RECORDED[params.seed] = []
        self.script = None
        if params.seed == SCRIPT_SEED:
            tok = SERVER.state.rt.tokenizer
            self.script = iter([*tok.encode(SCRIPT["text"]), tok.token_id(EOS_TOKEN)])

    def __call__(self, logits):
        token = next(self.script) if self.script else self.real(logits)
        if self.seed is not None:
            RECORDED[self.seed].append(token)
        return token


SERVER = SimpleNamespace()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_model(tmp_path_factory.mktemp("serve") / "demo.ftw", demo_spec(512))
    with pytest.MonkeyPatch.context() as mp, served(model, MODEL, KEY) as srv:
        mp.setattr(generate_mod, "Sampler", ScriptedSampler)
        SERVER.__dict__.update(vars(srv))
        yield SERVER


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def ant(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def hello(text="Say hello."):
    return [{"role": "user", "content": text}]


def stats(server) -> dict:
    return httpx.get(server.url + "/v1/stats", headers={"authorization": f"Bearer {KEY}"}).json()


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TWO_CALLS = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


# ---- OpenAI ---------------------------------------------------------------------------------
def test_models_health(server, oai):
    assert [m.id for m in oai.models.list()] == [MODEL]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"  # open without a key


def test_chat_plain_and_stream_agree(oai):
    r = oai.chat.completions.create(model=MODEL, messages=hello(), max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 6 and r.usage.prompt_tokens > 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(oai.chat.completions.create(model=MODEL, messages=hello(), max_tokens=6, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_tool_calls(oai):
    SCRIPT["text"] = TWO_CALLS
    r = oai.chat.completions.create(model=MODEL, messages=hello("Weather in Paris and Rome?"), tools=[WEATHER],
                                    max_tokens=80, seed=SCRIPT_SEED)
    m = r.choices[0]
    assert m.finish_reason == "tool_calls" and m.message.content == "Let me check."
    assert [json.loads(c.function.arguments)["city"] for c in m.message.tool_calls] == ["Paris", "Rome"]
    stream = oai.chat.completions.create(model=MODEL, messages=hello("Weather?"), tools=[WEATHER], max_tokens=80,
                                         seed=SCRIPT_SEED, stream=True)
    calls, finish = {}, None
    for c in stream:
        for tc in c.choices[0].delta.tool_calls or []:
            calls[tc.index] = tc.function
        finish = c.choices[0].finish_reason or finish
    assert finish == "tool_calls" and [f.name for f in calls.values()] == ["get_weather"] * 2
    # a tool result in the history renders and runs
    follow = hello("Weather?") + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = oai.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER], max_tokens=3)
    assert r.usage.completion_tokens >= 1


def test_completions(oai):
    r = oai.completions.create(model=MODEL, prompt="The quick brown", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens <= 5 and r.choices[0].finish_reason in ("stop", "length")
    chunks = list(oai.completions.create(model=MODEL, prompt="The quick brown", max_tokens=5, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks).startswith(r.choices[0].text)
    # a chunk for each token as it comes (its text may be empty), then the one that ends it
    assert [c.choices[0].finish_reason for c in chunks] == [None] * 5 + ["length"]


def test_stats_tell_where_a_request_spent_its_time(server, oai):
    oai.completions.create(model=MODEL, prompt="Where did the time go?", max_tokens=3, temperature=0)
    last = stats(server)["requests"]["recent"][-1]
    assert last["outcome"] == "completed" and last["completion_tokens"] == 3
    parts = [last[k] for k in ("queue_seconds", "resume_seconds", "insert_seconds")]
    assert all(0 <= p <= last["prefill_seconds"] + last["queue_seconds"] for p in parts)


def test_responses(oai):
    r = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 4
    SCRIPT["text"] = TWO_CALLS
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]},
             {"type": "web_search"}]  # a kind we do not run: ignored
    kinds, final = [], None
    with oai.responses.stream(model=MODEL, input=[{"role": "user", "content": "Weather?"}], tools=tools,
                              max_output_tokens=80, extra_body={"seed": SCRIPT_SEED}) as s:
        for ev in s:
            kinds.append(ev.type)
        final = s.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    calls = [o for o in final.output if o.type == "function_call"]
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    # the tool's output goes back as input items
    items = [{"role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
             {"type": "reasoning", "id": "rs_1", "summary": []}]
    assert oai.responses.create(model=MODEL, input=items, tools=tools, max_output_tokens=2).usage.output_tokens >= 1
    probe = oai.responses.create(model=MODEL, input=[])
    assert probe.status == "completed" and probe.output == []
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oai.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")


# ---- Anthropic ------------------------------------------------------------------------------
def test_messages_plain_and_stream(ant):
    kw = dict(model=MODEL, max_tokens=6, system="Be brief.", messages=hello(), extra_body={"temperature": 0})
    r = ant.messages.create(**kw)
    assert r.stop_reason in ("end_turn", "max_tokens") and 1 <= r.usage.output_tokens <= 6
    with ant.messages.stream(**kw) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [b.text for b in final.content] == [b.text for b in r.content]
    assert final.usage.output_tokens == r.usage.output_tokens
    assert ant.messages.count_tokens(model=MODEL, system="Be brief.", messages=hello()).input_tokens \
        == r.usage.input_tokens


def test_messages_tools_and_stop_sequences(ant):
    SCRIPT["text"] = TWO_CALLS
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER["function"]["parameters"]}]
    kw = dict(model=MODEL, max_tokens=80, tools=tools, messages=hello("Weather?"), extra_body={"seed": SCRIPT_SEED})
    r = ant.messages.create(**kw)
    assert r.stop_reason == "tool_use" and r.content[0].text == "Let me check."
    assert [b.input["city"] for b in r.content[1:]] == ["Paris", "Rome"]
    with ant.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"] and final.stop_reason == "tool_use"
    history = [*hello("Weather?"), {"role": "assistant", "content": [{"type": "tool_use", "id": r.content[1].id,
                                                                     "name": "get_weather", "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r.content[1].id, "content": "sunny"}]}]
    assert ant.messages.create(model=MODEL, max_tokens=2, tools=tools, messages=history).usage.output_tokens >= 1
    SCRIPT["text"] = "hello STOP world"
    r = ant.messages.create(model=MODEL, max_tokens=20, messages=hello(), stop_sequences=["STOP"],
                            extra_body={"seed": SCRIPT_SEED})
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "STOP" and r.content[0].text == "hello "


# ---- bad input: a 4xx in the API's shape, then the server still serves ------------------------
def test_openai_bad_input(server, oai):
    url, auth = server.url + "/v1/chat/completions", {"authorization": f"Bearer {KEY}"}
    good = {"model": MODEL, "messages": hello(), "max_tokens": 2}
    long_prompt = "word " * 2100
    cases = [
        (httpx.post(url, content=b"{not json", headers=auth), 400),
        (httpx.post(url, json={**good, "messages": "hi"}, headers=auth), 400),
        (httpx.post(url, json={**good, "max_tokens": "2"}, headers=auth), 400),
        (httpx.post(url, json={**good, "model": "gpt-9"}, headers=auth), 404),
        (httpx.post(url, json={**good, "messages": []}, headers=auth), 400),
        (httpx.post(url, json={**good, "messages": hello(long_prompt)}, headers=auth), 400),
        (httpx.post(url, json={**good, "max_tokens": -1}, headers=auth), 400),
        (httpx.post(url, json={**good, "max_tokens": 10**9}, headers=auth), 400),
        (httpx.post(url, json=good), 401),
        (httpx.post(url, json=good, headers={"authorization": "Bearer wrong"}), 401),
    ]
    for resp, status in cases:
        assert resp.status_code == status, resp.text
        assert set(resp.json()) == {"error"} and resp.json()["error"]["message"]
        assert oai.chat.completions.create(**good).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_anthropic_bad_input(server, ant):
    url, auth = server.url + "/v1/messages", {"x-api-key": KEY}
    good = {"model": MODEL, "messages": hello(), "max_tokens": 2}
    cases = [
        (httpx.post(url, content=b"[1,", headers=auth), 400),
        (httpx.post(url, json={**good, "system": 3}, headers=auth), 400),
        (httpx.post(url, json={**good, "model": "claude-x"}, headers=auth), 404),
        (httpx.post(url, json={**good, "messages": []}, headers=auth), 400),
        (httpx.post(url, json={**good, "max_tokens": -5}, headers=auth), 400),
        (httpx.post(url, json={k: v for k, v in good.items() if k != "max_tokens"}, headers=auth), 400),
        (httpx.post(url, json=good), 401),
        (httpx.post(url, json=good, headers={"x-api-key": "nope"}), 401),
    ]
    for resp, status in cases:
        assert resp.status_code == status, resp.text
        body = resp.json()
        assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"]
        assert ant.messages.create(**good).usage.output_tokens >= 1
    with pytest.raises(anthropic.NotFoundError):
        ant.messages.create(**{**good, "model": "claude-x"})


def test_unknown_routes_and_methods_answer_in_the_api_shape(server, oai, ant):
    auth = {"authorization": f"Bearer {KEY}"}
    missing = httpx.get(server.url + "/v1/nope", headers=auth)
    assert missing.status_code == 404 and missing.json() == {"error": {
        "message": "no route /v1/nope: see /openapi.json for the endpoints", "type": "not_found_error",
        "param": None, "code": None}}
    method = httpx.get(server.url + "/v1/chat/completions", headers=auth)
    assert method.status_code == 405 and "POST" in method.headers["allow"]
    assert method.json()["error"]["message"] == "GET is not allowed on /v1/chat/completions"
    anthropic_side = httpx.get(server.url + "/v1/messages", headers=auth)
    assert anthropic_side.status_code == 405 and anthropic_side.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "GET is not allowed on /v1/messages"}}
    assert httpx.get(server.url + "/v1/nope").status_code == 401  # the key is checked first
    with pytest.raises(openai.NotFoundError, match="no route /v1/models/x"):
        oai.models.retrieve("x")  # the SDK reads the message out of the shape


def test_hostile_requests_get_a_4xx(server, oai):
    """Requests a fuzzer sends (objects where names go, booleans as token ids, numbers past any
    range, a lone surrogate, JSON nested past Python's recursion limit) get a 400 in the API's
    shape, never a 500, and the server goes on serving."""
    auth = {"authorization": f"Bearer {KEY}"}
    chat, comp = server.url + "/v1/chat/completions", server.url + "/v1/completions"
    resp, msgs = server.url + "/v1/responses", server.url + "/v1/messages"
    good = {"model": MODEL, "messages": hello(), "max_tokens": 2}
    raw = [
        (chat, {**good, "messages": [{"role": {"a": 1}, "content": "hi"}]}),
        (resp, {"model": MODEL, "input": [{"type": "message", "role": {"a": 1}, "content": "hi"}]}),
        (msgs, {**good, "messages": [{"role": {"a": 1}, "content": "hi"}]}),
        (msgs, {**good, "messages": [{"role": "user", "content": [{"type": {"a": 1}}]}]}),
        (comp, {"model": MODEL, "prompt": [True, False, 5], "max_tokens": 2}),
        (chat, {**good, "seed": 2**64}),
    ]
    cases = [(url, json.dumps(body).encode()) for url, body in raw]
    cases += [
        (chat, b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "temperature": 1' + b"0" * 400 + b"}"),
        (chat, b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b"0" * 5000 + b"}"),
        (chat, b'{"model": "demo", "messages": [{"role": "user", "content": "\\ud800 hi"}]}'),
        (chat, b'{"model": "demo", "messages": [{"role": "user", "content": "\\ud83d\\ude00 paired"}], "max_tokens": 1}'),
        (chat, b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ]
    for url, body in cases:
        r = httpx.post(url, content=body, headers={**auth, "content-type": "application/json"})
        ok = b"paired" in body  # a proper pair is an emoji, not an error
        assert r.status_code == (200 if ok else 400), (url, body[:80], r.text[:200])
        assert ok or r.json().get("error", {}).get("message")
    assert oai.chat.completions.create(**good).usage.completion_tokens >= 1


def test_tokenizing_runs_off_the_event_loop(server, monkeypatch):
    """A prompt being tokenized (an 8 MB one took 8.9 s) holds no other request: /health answers
    while a count_tokens request's tokenizer is held inside encode."""
    tok = server.state.rt.tokenizer
    entered, gate, real = threading.Event(), threading.Event(), tok.encode

    def held(text, *a, **kw):
        entered.set()
        assert gate.wait(60)
        return real(text, *a, **kw)

    monkeypatch.setattr(tok, "encode", held)
    out = {}
    body = {"model": MODEL, "messages": hello("count me")}
    worker = threading.Thread(target=lambda: out.setdefault("r", httpx.post(
        server.url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY}, timeout=90)))
    worker.start()
    assert entered.wait(60)
    try:
        assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"
    finally:
        gate.set()
        worker.join(90)
    assert out["r"].status_code == 200 and out["r"].json()["input_tokens"] > 0


# ---- the scheduler under load ---------------------------------------------------------------
def test_eight_concurrent_streams(server, oai):
    results: dict[int, tuple] = {}
    before = stats(server)["requests"]

    def one(i: int) -> None:
        chunks = list(oai.chat.completions.create(
            model=MODEL, messages=hello(f"Request {i}"), max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        results[i] = (chunks[-1].usage, [c.choices[0].finish_reason for c in chunks if c.choices][-1])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(8))
    for i, (usage, finish) in results.items():
        want = len(server.state.encode_chat(hello(f"Request {i}"), None))
        assert (usage.prompt_tokens, usage.completion_tokens, finish) == (want, 5, "length")
    after = stats(server)["requests"]
    assert after["running"] == 0
    # Running requests decode together: fewer forwards than tokens.
    forwards = after["decode_forwards"] - before["decode_forwards"]
    assert after["decode_batched_tokens"] - before["decode_batched_tokens"] > forwards > 0


def until(cond, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_requests_sent_together_share_one_prefill(server, oai, monkeypatch):
    """Two streams the scheduler holds while a third request is on its way (its first byte read,
    not yet submitted) prefill in one forward once it arrives: each stream's own arrival ended at
    its submit, through the app's middleware. Refused requests leave the count too."""
    sched = server.state.scheduler
    monkeypatch.setattr(scheduler_mod, "ARRIVAL_WAIT_S", 600.0)  # only arrivals end the wait
    before = stats(server)["requests"]
    texts: dict[int, str] = {}

    def one(i: int) -> None:
        texts[i] = "".join(c.choices[0].text for c in oai.completions.create(
            model=MODEL, prompt=list(range(20 + i, 60 + i)), max_tokens=3, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)

    on_its_way = sched.arrival()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        until(lambda: stats(server)["requests"]["submitted"] - before["submitted"] == 2)
        assert stats(server)["requests"]["prefill_forwards"] == before["prefill_forwards"]  # held
    finally:
        on_its_way()
    for t in threads:
        t.join(60)
    assert sorted(texts) == [0, 1]
    assert stats(server)["requests"]["prefill_forwards"] - before["prefill_forwards"] == 1
    url, auth = server.url + "/v1/completions", {"authorization": f"Bearer {KEY}"}
    assert httpx.post(url, content=b"{not json", headers=auth).status_code == 400
    assert httpx.post(url, json={"model": MODEL, "prompt": [1, 2]}).status_code == 401
    until(lambda: sched.arriving == 0)


def test_disconnect_frees_the_slot(server):
    before = stats(server)["requests"]["cancelled"]
    body = {"model": MODEL, "messages": hello(), "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers={"authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.time() + 10
    while time.time() < deadline and (s := stats(server)["requests"])["running"]:
        time.sleep(0.1)
    assert s["running"] == 0 and s["cancelled"] == before + 1


def test_a_finished_job_is_freed_without_the_cycle_collector():
    """A job's request, which holds its KV cache, goes with the job by reference counting alone:
    a cycle through the request's sink kept every finished request until one of the collector's
    rare full passes (a 20-minute soak's server RSS grew 48%)."""
    scheduler = SimpleNamespace(submitted=[])
    scheduler.submit = scheduler.submitted.append
    state = SimpleNamespace(keep_special=frozenset(), context=64, scheduler=scheduler)

    async def run() -> weakref.ref:
        job = Job(state, [1, 2, 3], SamplingParams(max_tokens=4))
        job.req.sink(Event(None, done=True))  # what the scheduler sends at the end
        assert [ev.done async for ev in job.events()] == [True]
        return weakref.ref(job.req)

    gc.disable()
    try:
        request = asyncio.run(run())
        scheduler.submitted.clear()  # the scheduler lets go of a finished request
        assert request() is None
    finally:
        gc.enable()


def test_rebuild_mid_stream_keeps_tokens(server, oai):
    kw = dict(model=MODEL, messages=hello("Tell me a story."), max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True})
    oai.chat.completions.create(**kw, seed=1)
    before = stats(server)["memory"]
    stream = oai.chat.completions.create(**kw, seed=2, stream=True)
    next(stream), next(stream)
    r = httpx.post(server.url + "/v1/cache/rebuild", json={"experts": 7, "kv_tokens": 5000},
                   headers={"x-api-key": KEY})
    assert r.status_code == 200, r.text
    rest = list(stream)
    assert rest[-1].choices[0].finish_reason == "length"
    assert RECORDED[2] == RECORDED[1] and len(RECORDED[1]) == 16
    mem = stats(server)["memory"]
    assert (mem["expert_slots"], mem["kv_tokens"]) == (7, 5000)
    # a split that cannot fit is refused; the old one stays and the server keeps serving
    r = httpx.post(server.url + "/v1/cache/rebuild", json={"kv_tokens": 10**9}, headers={"x-api-key": KEY})
    assert r.status_code == 409 and "does not fit" in r.json()["error"]["message"]
    assert stats(server)["memory"] == mem
    # back to the start-up split, from the command line
    ctl = subprocess.run([sys.executable, "-m", "ftkit.runtime.cli", "ctl", "cache", "--experts",
                          str(before["expert_slots"]), "--kv", str(before["kv_tokens"]), "--url", server.url,
                          "--api-key", KEY], capture_output=True, text=True, timeout=60)
    assert ctl.returncode == 0, ctl.stderr
    assert json.loads(ctl.stdout)["memory"]["expert_slots"] == before["expert_slots"]
    assert oai.chat.completions.create(**kw, seed=3).usage.completion_tokens == 16
    assert RECORDED[3] == RECORDED[1]
    assert stats(server)["experts"]["hits"] > 0


def test_serve_refuses_a_plan_that_cannot_fit(server):
    r = subprocess.run([sys.executable, "-m", "ftkit.runtime.cli", "serve", "-m", str(server.model),
                        "--device-memory", "6M", "--strategy", "offload", "--port", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "memory plan" in r.stdout and "does not fit" in r.stderr and "--cache-experts" in r.stderr


def test_serve_refuses_a_key_no_header_can_carry(server):
    r = subprocess.run([sys.executable, "-m", "ftkit.runtime.cli", "serve", "-m", str(server.model),
                        "--api-key", "clé secrète", "--port", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "--api-key must be printable ASCII" in r.stderr


def test_store_rebuild_rolls_back(server, monkeypatch):
    from ftkit.runtime.experts import store as store_mod

    real = store_mod.SlotCache

    def failing(capacity, *a):
        if capacity == 9:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(capacity, *a)

    monkeypatch.setattr(store_mod, "SlotCache", failing)
    fut = server.state.scheduler.rebuild(9, None)
    with pytest.raises(Exception, match="cannot allocate 9 expert slots"):
        fut.result(10)
    assert server.state.rt.store.cache.capacity == stats(server)["memory"]["expert_slots"] != 9

