"""Harmony's analysis channel as each API's reasoning, through the real server and both official
SDKs, streaming and not: OpenAI chat `reasoning_content` (and `completion_tokens_details`), a
Responses `reasoning` item, an Anthropic `thinking` block, each before the reply's text. The
served template is a harmony one that renders `reasoning_effort` as gpt-oss's does, so the
effort each API's request asks for is read back from the rendered prompt. A malformed harmony
reply is never a 5xx; other formats get no reasoning."""

from __future__ import annotations

import anthropic
import httpx2 as httpx
import openai
import pytest
import test_server as ts
from test_server import KEY, MODEL, SCRIPT_SEED, WEATHER, hello
from test_server_toolcall_formats import ANT_TOOLS, REPLIES

from ftkit.runtime.engine.tokenizer import compile_template
from ftkit.runtime.server.toolcalls.harmony import HarmonyParser
from ftkit.runtime.server.toolcalls.hermes import HermesParser

server, oai, ant = ts.server, ts.oai, ts.ant  # test_server's fixtures: its server and clients

# gpt-oss's system line and framing, abridged: the effort is the template's default when undefined.
HARMONY = ("{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif %}"
           "<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>"
           "{%- for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
           "<|message|>{{ m.content or '' }}<|end|>{%- endfor %}"
           "{%- if add_generation_prompt %}<|start|>assistant{% endif %}")
REPLY = "<|channel|>analysis<|message|>The user greets; greet back.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
THOUGHT = "The user greets; greet back."


@pytest.fixture
def harmony(server, monkeypatch):
    """The served tokenizer speaks harmony for this test; yields the prompts it rendered."""
    tok = server.state.rt.tokenizer
    monkeypatch.setattr(tok, "template_source", HARMONY)
    monkeypatch.setattr(tok, "template", compile_template(HARMONY, "test"))
    assert type(server.state.tool_parser(False)) is HarmonyParser
    rendered: list[str] = []
    chat = tok.chat

    def spy(*args, **kw):
        rendered.append(chat(*args, **kw))
        return rendered[-1]

    monkeypatch.setattr(tok, "chat", spy)
    ts.SCRIPT["text"] = REPLY
    return rendered


def test_openai_chat_reasoning_content(oai, harmony):
    kw = dict(model=MODEL, messages=hello(), max_tokens=400, seed=SCRIPT_SEED)
    r = oai.chat.completions.create(**kw)
    m = r.choices[0].message
    assert (m.content, m.model_extra["reasoning_content"], r.choices[0].finish_reason) == ("Hi!", THOUGHT, "stop")
    assert 0 < r.usage.completion_tokens_details.reasoning_tokens < r.usage.completion_tokens
    order, thought, text, usage = [], "", "", None
    for c in oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = c.usage or usage
        if not c.choices:
            continue
        d = c.choices[0].delta
        if getattr(d, "reasoning_content", None):
            thought += d.reasoning_content
            order.append("reasoning")
        if d.content:
            text += d.content
            order.append("content")
    assert (thought, text) == (THOUGHT, "Hi!") and order.index("content") > max(i for i, k in enumerate(order)
                                                                                 if k == "reasoning")
    assert usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens_details.reasoning_tokens


def test_openai_chat_reasoning_with_tool_calls(oai, harmony):
    ts.SCRIPT["text"] = REPLIES[HarmonyParser]
    m = oai.chat.completions.create(model=MODEL, messages=hello("Weather?"), tools=[WEATHER], max_tokens=400,
                                    seed=SCRIPT_SEED).choices[0]
    assert m.finish_reason == "tool_calls" and m.message.model_extra["reasoning_content"] == "Two cities."
    assert [c.function.name for c in m.message.tool_calls] == ["get_weather", "get_weather"]


def test_responses_reasoning_item(oai, harmony):
    kw = dict(model=MODEL, input="Say hello.", max_output_tokens=400, extra_body={"seed": SCRIPT_SEED})
    r = oai.responses.create(**kw)
    with oai.responses.stream(**kw) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_response()
    for resp in (r, final):
        assert [o.type for o in resp.output] == ["reasoning", "message"]
        assert [(c.type, c.text) for c in resp.output[0].content] == [("reasoning_text", THOUGHT)]
        assert resp.output[0].summary == [] and resp.output_text == "Hi!"
        assert resp.usage.output_tokens_details.reasoning_tokens > 0
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    # a reasoning item sent back is skipped, as before
    again = oai.responses.create(**{**kw, "input": [{"role": "user", "content": "Say hello."},
                                                    r.output[0].model_dump(exclude_none=True)]})
    assert again.output_text == "Hi!"


def test_anthropic_thinking_block(ant, harmony):
    kw = dict(model=MODEL, max_tokens=400, messages=hello(), extra_body={"seed": SCRIPT_SEED})
    r = ant.messages.create(**kw)
    with ant.messages.stream(**kw) as s:
        deltas = [ev.delta.type for ev in s if ev.type == "content_block_delta"]
        final = s.get_final_message()
    for msg in (r, final):
        assert [b.type for b in msg.content] == ["thinking", "text"] and msg.stop_reason == "end_turn"
        assert (msg.content[0].thinking, msg.content[0].signature, msg.content[1].text) == (THOUGHT, "", "Hi!")
    assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"
    ts.SCRIPT["text"] = REPLIES[HarmonyParser]
    r = ant.messages.create(**{**kw, "tools": ANT_TOOLS})
    assert [b.type for b in r.content] == ["thinking", "text", "tool_use", "tool_use"]
    # the thinking block sent back is skipped (not re-rendered): the history renders without it
    history = [*hello(), {"role": "assistant", "content": [b.model_dump() for b in r.content[:2]]}, *hello("More.")]
    assert ant.messages.count_tokens(model=MODEL, messages=history).input_tokens > 0
    assert THOUGHT not in harmony[-1] and "Two cities." not in harmony[-1]


@pytest.mark.parametrize("api, field, effort", [
    ("chat", {}, "medium"),
    ("chat", {"reasoning_effort": "high"}, "high"),
    ("chat", {"reasoning_effort": "minimal"}, "low"),
    ("responses", {"reasoning": {"effort": "low", "summary": "auto"}}, "low"),
    ("responses", {"reasoning": {"effort": "xhigh"}}, "high"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, "low"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 8000}}, "medium"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 32000}}, "high"),
    ("messages", {"thinking": {"type": "enabled"}}, "medium"),
    ("messages", {"thinking": {"type": "disabled"}}, "low"),
    ("messages", {"thinking": {"type": "adaptive"}}, "medium"),
    ("count_tokens", {"thinking": {"type": "enabled", "budget_tokens": 20000}}, "high"),
])
def test_effort_reaches_the_template(oai, ant, harmony, api, field, effort):
    if api == "chat":
        oai.chat.completions.create(model=MODEL, messages=hello(), max_tokens=400, seed=SCRIPT_SEED, extra_body=field)
    elif api == "responses":
        oai.responses.create(model=MODEL, input="Say hello.", max_output_tokens=400,
                             extra_body={"seed": SCRIPT_SEED, **field})
    elif api == "messages":
        ant.messages.create(model=MODEL, max_tokens=400, messages=hello(), extra_body={"seed": SCRIPT_SEED, **field})
    else:
        ant.messages.count_tokens(model=MODEL, messages=hello(), extra_body=field)
    assert harmony[-1].startswith(f"<|start|>system<|message|>Reasoning: {effort}<|end|>")


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": hello(), "max_tokens": 4, "reasoning_effort": "extreme"}),
    ("/v1/chat/completions", {"messages": hello(), "max_tokens": 4, "reasoning_effort": 2}),
    ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "huge"}}),
    ("/v1/responses", {"input": "Hi", "reasoning": "high"}),
    ("/v1/messages", {"messages": hello(), "max_tokens": 4, "thinking": {"type": "sometimes"}}),
    ("/v1/messages", {"messages": hello(), "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 0}}),
    ("/v1/messages", {"messages": hello(), "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": "1k"}}),
    ("/v1/messages/count_tokens", {"messages": hello(), "thinking": True}),
])
def test_a_bad_effort_is_a_400_in_the_apis_shape(server, harmony, path, body):
    resp = httpx.post(server.url + path, json={"model": MODEL, **body}, headers={"authorization": f"Bearer {KEY}"})
    assert resp.status_code == 400, resp.text
    err = resp.json()
    if path.startswith("/v1/messages"):
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    else:
        assert set(err) == {"error"} and err["error"]["type"] == "invalid_request_error"
    field = next(k for k in ("reasoning_effort", "reasoning", "thinking") if k in body)
    assert f"'{field}" in err["error"]["message"]  # the message names the field


MALFORMED = [
    "<|channel|>analysis<|message|>cut off mid-thought",  # the reply ends inside its reasoning
    "<|channel|>analysis",  # a header that never opens a body
    "<|message|><|message|><|end|><|end|><|return|>",
    "<|channel|><|message|>no channel name<|call|>",
    "<|start|>assistant<|channel|>commentary to=functions.<|message|>{}<|call|>",
    '<|channel|>commentary to=functions.f <|constrain|>json<|message|>[1, 2]<|call|>trailing',
    "<|start|><|start|><|channel|>final<|message|><|channel|>analysis<|message|>x",
]


@pytest.mark.parametrize("text", MALFORMED)
def test_a_malformed_harmony_reply_is_never_a_5xx(oai, ant, harmony, text):
    ts.SCRIPT["text"] = text
    seed = {"seed": SCRIPT_SEED}
    r = oai.chat.completions.create(model=MODEL, messages=hello(), tools=[WEATHER], max_tokens=400, **seed)
    assert r.choices[0].finish_reason in ("stop", "tool_calls")
    chunks = list(oai.chat.completions.create(model=MODEL, messages=hello(), max_tokens=400, stream=True, **seed))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert oai.responses.create(model=MODEL, input="Hi", max_output_tokens=400, extra_body=seed).status == "completed"
    with oai.responses.stream(model=MODEL, input="Hi", max_output_tokens=400, extra_body=seed) as s:
        assert s.get_final_response().status == "completed"
    assert ant.messages.create(model=MODEL, max_tokens=400, messages=hello(), extra_body=seed).stop_reason
    with ant.messages.stream(model=MODEL, max_tokens=400, tools=ANT_TOOLS, messages=hello(), extra_body=seed) as s:
        assert s.get_final_message().stop_reason in ("end_turn", "tool_use")


def test_other_formats_get_no_reasoning(oai, ant, server):
    """A Hermes template: the same harmony-looking text is the reply's text, with no reasoning."""
    assert type(server.state.tool_parser()) is HermesParser  # the synthetic tokenizer's template
    ts.SCRIPT["text"] = REPLY
    m = oai.chat.completions.create(model=MODEL, messages=hello(), tools=[WEATHER], max_tokens=400,
                                    seed=SCRIPT_SEED).choices[0].message
    assert m.content == REPLY and "reasoning_content" not in (m.model_extra or {})
    r = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=400, extra_body={"seed": SCRIPT_SEED},
                             reasoning={"effort": "high"})
    assert [o.type for o in r.output] == ["message"] and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.output_text == REPLY
    with ant.messages.stream(model=MODEL, max_tokens=400, messages=hello(), extra_body={"seed": SCRIPT_SEED}) as s:
        assert [b.type for b in s.get_final_message().content] == ["text"]


def test_sdk_errors_for_a_bad_effort(oai, ant, harmony):
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        oai.chat.completions.create(model=MODEL, messages=hello(), max_tokens=4, reasoning_effort="extreme")
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        ant.messages.create(model=MODEL, max_tokens=4, messages=hello(), thinking={"type": "sometimes"})
