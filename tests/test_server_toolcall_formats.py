"""Every tool-call format through the real server and both official SDKs, streaming and not: the
served model's chat template is swapped for one written in the format (its tool-call lines as
the checkpoints ship them, test_server_toolcalls.TEMPLATES), the model's reply is scripted in
that format (test_server's scripted sampler), and the clients get parsed calls, or, for a call
that does not decode, the text as it was (never a 5xx)."""

from __future__ import annotations

import json

import pytest
import test_server as ts
from test_server import MODEL, SCRIPT_SEED, WEATHER, hello
from test_server_toolcalls import TEMPLATES

from ftkit.runtime.engine.tokenizer import compile_template
from ftkit.runtime.server.toolcalls.glm import GLMParser
from ftkit.runtime.server.toolcalls.harmony import HarmonyParser
from ftkit.runtime.server.toolcalls.hermes import HermesParser
from ftkit.runtime.server.toolcalls.mistral import MistralParser
from ftkit.runtime.server.toolcalls.qwen_xml import QwenXMLParser

server, oai, ant = ts.server, ts.oai, ts.ant  # test_server's fixtures: its server and clients

# A template that renders any conversation plainly; the format's lines sit in a branch never
# taken, where they still tell the server which format the model writes.
PLAIN = ("{%- for m in messages %}{{ m.role }}: {{ m.content or '' }}\n{%- endfor %}"
         "{%- if add_generation_prompt %}assistant: {% endif %}{%- if false %}")

# Per format: a reply with text, then calls for Paris and Rome, in that format.
REPLIES = {
    HermesParser: ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
    QwenXMLParser: ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
                    "</parameter>\n</function>\n</tool_call>"),
    GLMParser: ("Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                "</tool_call><tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>"),
    MistralParser: ('Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                    '{"name": "get_weather", "arguments": {"city": "Rome"}}]'),
    HarmonyParser: ("<|channel|>analysis<|message|>Two cities.<|end|><|start|>assistant<|channel|>commentary"
                    "<|message|>Let me check.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
                    '<|constrain|>json<|message|>{"city": "Paris"}<|call|><|start|>assistant<|channel|>commentary '
                    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}'),
}
MALFORMED = {
    QwenXMLParser: "Oops <tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</tool_call>",
    GLMParser: "Oops <tool_call>get weather\n<arg_key>city</arg_key></tool_call>",
    MistralParser: 'Oops [TOOL_CALLS] [{"name": "get_weather", "arguments": ',
}
ANT_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER["function"]["parameters"]}]


@pytest.fixture
def template(server, monkeypatch):
    """`template(cls)`: the served tokenizer speaks cls's format for this test."""
    tok = server.state.rt.tokenizer

    def use(cls) -> None:
        source = PLAIN + TEMPLATES[cls] + "{%- endif %}"
        monkeypatch.setattr(tok, "template_source", source)
        monkeypatch.setattr(tok, "template", compile_template(source, "test"))
        assert type(server.state.tool_parser()) is cls

    return use


@pytest.mark.parametrize("cls", list(REPLIES), ids=lambda c: c.__name__)
def test_openai_gets_the_calls(oai, template, cls):
    template(cls)
    ts.SCRIPT["text"] = REPLIES[cls]
    kw = dict(model=MODEL, messages=hello("Weather in Paris and Rome?"), tools=[WEATHER], max_tokens=400,
              seed=SCRIPT_SEED)
    m = oai.chat.completions.create(**kw).choices[0]
    assert m.finish_reason == "tool_calls" and m.message.content.strip() == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.message.tool_calls] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert len({c.id for c in m.message.tool_calls}) == 2
    calls, text, finish = {}, "", None
    for c in oai.chat.completions.create(**kw, stream=True):
        d = c.choices[0].delta
        text += d.content or ""
        for tc in d.tool_calls or []:
            got = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            got["name"] += tc.function.name or ""
            got["arguments"] += tc.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    assert finish == "tool_calls" and text.strip() == "Let me check."
    assert [(f["name"], json.loads(f["arguments"])["city"]) for f in calls.values()] == \
        [("get_weather", "Paris"), ("get_weather", "Rome")]


@pytest.mark.parametrize("cls", list(REPLIES), ids=lambda c: c.__name__)
def test_anthropic_gets_the_tool_use_blocks(ant, template, cls):
    template(cls)
    ts.SCRIPT["text"] = REPLIES[cls]
    kw = dict(model=MODEL, max_tokens=400, tools=ANT_TOOLS, messages=hello("Weather?"), extra_body={"seed": SCRIPT_SEED})
    r = ant.messages.create(**kw)
    with ant.messages.stream(**kw) as s:
        final = s.get_final_message()
    for msg in (r, final):
        content = [b for b in msg.content if b.type != "thinking"]  # harmony's analysis: test_server_reasoning.py
        assert msg.stop_reason == "tool_use" and [b.type for b in content] == ["text", "tool_use", "tool_use"]
        assert content[0].text.strip() == "Let me check."
        assert [(b.name, b.input) for b in content[1:]] == \
            [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize("cls", list(MALFORMED), ids=lambda c: c.__name__)
def test_a_malformed_call_reaches_both_sdks_as_text(oai, ant, template, cls):
    template(cls)
    ts.SCRIPT["text"] = MALFORMED[cls]
    m = oai.chat.completions.create(model=MODEL, messages=hello(), tools=[WEATHER], max_tokens=400,
                                    seed=SCRIPT_SEED).choices[0]
    assert (m.finish_reason, m.message.content, m.message.tool_calls) == ("stop", MALFORMED[cls], None)
    with ant.messages.stream(model=MODEL, max_tokens=400, tools=ANT_TOOLS, messages=hello(),
                             extra_body={"seed": SCRIPT_SEED}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "end_turn" and [b.text for b in final.content] == [MALFORMED[cls]]


def test_a_harmony_reply_without_tools_is_its_final_text(oai, ant, template):
    """Harmony frames every reply: without tools too the text is the final channel's (the
    analysis is the reasoning), where the other formats leave a reply without tools as it is."""
    template(HarmonyParser)
    ts.SCRIPT["text"] = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    r = oai.chat.completions.create(model=MODEL, messages=hello(), max_tokens=400, seed=SCRIPT_SEED)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Hi!", "stop")
    with ant.messages.stream(model=MODEL, max_tokens=400, messages=hello(), extra_body={"seed": SCRIPT_SEED}) as s:
        assert [(b.type, getattr(b, "text", None)) for b in s.get_final_message().content] == \
            [("thinking", None), ("text", "Hi!")]
    template(GLMParser)
    ts.SCRIPT["text"] = REPLIES[GLMParser]
    r = oai.chat.completions.create(model=MODEL, messages=hello(), max_tokens=400, seed=SCRIPT_SEED)
    assert r.choices[0].message.content == REPLIES[GLMParser] and r.choices[0].message.tool_calls is None


def test_the_formats_tags_stay_in_the_decoded_text(server, template):
    """The tags of the template's format that are tokens of the vocabulary (the synthetic one
    has hermes' two) are kept when the reply is decoded, so the parser sees them."""
    tok = server.state.rt.tokenizer
    template(GLMParser)
    assert server.state.keep_special == {tok.token_id("<tool_call>"), tok.token_id("</tool_call>")}
    template(MistralParser)
    assert server.state.keep_special == frozenset()
