"""Tool-call parsers on their own: the chat template picks the format, any chunking of the text
gives the same items, and a call that does not decode stays text. The same formats through the
real server and both SDKs: test_server_toolcall_formats.py."""

from __future__ import annotations

import json

import pytest

from ftkit.runtime.server.toolcalls import Reasoning, ToolCall, parser_for
from ftkit.runtime.server.toolcalls.glm import GLMParser
from ftkit.runtime.server.toolcalls.harmony import HarmonyParser
from ftkit.runtime.server.toolcalls.hermes import HermesParser
from ftkit.runtime.server.toolcalls.mistral import MistralParser
from ftkit.runtime.server.toolcalls.qwen_xml import QwenXMLParser
from ftkit.runtime.synthetic import CHAT_TEMPLATE

# The tool-call lines of the templates the checkpoints ship (abridged).
TEMPLATES = {
    HermesParser: CHAT_TEMPLATE,  # Qwen3's, as the synthetic tokenizer writes it
    QwenXMLParser: "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
                   "{{- '<parameter=' + args_name + '>\\n' }}{{- '\\n</parameter>\\n' }}"
                   "{{- '</function>\\n</tool_call>' }}",
    GLMParser: "{{- '<tool_call>' + tc.name }}{% for k, v in _args.items() %}"
               "<arg_key>{{ k }}</arg_key>\\n<arg_value>{{ v | tojson if v is not string else v }}</arg_value>\\n"
               "{% endfor %}</tool_call>",
    MistralParser: "{{- '[AVAILABLE_TOOLS] ' + tools|tojson + '[/AVAILABLE_TOOLS]' }}"
                   "{{- '[TOOL_CALLS] ' + tool_calls|tojson + eos_token }}",
    HarmonyParser: "{{- '<|start|>assistant to=functions.' + tool_call.name + '<|channel|>commentary json"
                   "<|message|>' + tool_call.arguments|tojson + '<|call|>' }}",
}

# Per format: the model's text, and the items it parses to (adjacent text merged).
CASES = {
    HermesParser: ('Checking.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
                   '<tool_call>{"name": "g", "arguments": "{\\"b\\": 2}"}</tool_call> done <tool',
                   ["Checking.", ("f", {"a": 1}), "\n", ("g", {"b": 2}), " done <tool"]),
    QwenXMLParser: ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n"
                    "</function>\n</tool_call>",
                    ["Let me look.\n", ("get_weather", {"city": "Paris", "days": 3}), "\n", ("now", {})]),
    GLMParser: ('Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n'
                '<arg_key>opts</arg_key>\n<arg_value>{"unit": "C"}</arg_value>\n</tool_call>',
                ["Sure.", ("get_weather", {"city": "Paris", "opts": {"unit": "C"}})]),
    MistralParser: ('Calling. [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
                    ["Calling. ", ("f", {"a": 1}), ("g", {})]),
    HarmonyParser: ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
                    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
                    [Reasoning("Need weather."), ("get_weather", {"city": "Paris"})]),
}


def run(cls, chunks: list[str]) -> list:
    """The items, adjacent text (and adjacent reasoning) merged so chunkings compare equal; calls
    as (name, arguments)."""
    p = cls()
    out: list = []
    for i in [i for c in chunks for i in p.feed(c)] + p.finish():
        if isinstance(i, ToolCall):
            out.append((i.name, json.loads(i.arguments)))
        elif out and type(out[-1]) is type(i):
            out[-1] = out[-1] + i if isinstance(i, str) else Reasoning(out[-1].text + i.text)
        else:
            out.append(i)
    return out


@pytest.mark.parametrize("cls", list(TEMPLATES), ids=lambda c: c.__name__)
def test_the_template_picks_the_parser(cls):
    assert parser_for(TEMPLATES[cls]) is cls
    assert parser_for(None) is None and parser_for("{{ messages }}") is None


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("cls", list(CASES), ids=lambda c: c.__name__)
def test_any_chunking(cls, size):
    text, want = CASES[cls]
    assert run(cls, [text[i:i + size] for i in range(0, len(text), size)]) == want


def test_hermes_closing_tag_split_and_never_leaked():
    p = HermesParser()
    assert p.feed('<tool_call>{"name": "f", "arguments": {}}</tool_') == []
    items = p.feed("call>")
    assert len(items) == 1 and items[0].name == "f"
    assert p.feed("<tool_c") == []  # held back: may be a tag


@pytest.mark.parametrize("cls, text", [
    (HermesParser, "<tool_call>{oops}</tool_call>"),
    (QwenXMLParser, "<tool_call>\n<function=f>\n<parameter=a>1</parameter>\nstray</function>\n</tool_call>"),
    (QwenXMLParser, "<tool_call>\n<function=f>\n<parameter=a>1</parameter>\n</tool_call>"),
    (GLMParser, "<tool_call>two words\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"),
    (GLMParser, "<tool_call>f\n<arg_key>a</arg_key></tool_call>"),
    (MistralParser, "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}"),
    (MistralParser, "[TOOL_CALLS] [{\"arguments\": {}}]"),
    (HarmonyParser, "<|channel|>commentary to=functions.f<|message|>{not json}<|call|>"),
])
def test_a_malformed_call_stays_text(cls, text):
    assert run(cls, [text]) == [text.removesuffix("<|call|>")]


def test_unterminated_calls_count_when_whole():
    assert run(HermesParser, ['<tool_call>\n{"name": "f", "arguments": {}}\n']) == [("f", {})]
    assert run(GLMParser, ["<tool_call>f\n<arg_key>a</arg_key><arg_value>x</arg_value>"]) == [("f", {"a": "x"})]


def test_mistral_newer_args_form():
    text = 'x[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}'
    assert run(MistralParser, [text]) == ["x", ("f", {"a": 1}), ("g", {})]


def test_harmony_analysis_is_reasoning_and_final_text_streams():
    p = HarmonyParser()
    assert not p.in_reasoning
    assert p.feed("<|channel|>analysis<|message|>think") == [Reasoning("think")] and p.in_reasoning
    assert p.feed("ing<|") == [Reasoning("ing")]  # "<|" held: may be <|end|>
    assert p.feed("end|><|start|>assistant<|channel|>final<|message|>Hel") == ["Hel"] and not p.in_reasoning
    assert p.feed("lo<|") == ["lo"]  # "<|" held: may be <|return|>
    assert p.feed("return|>") == [] and p.finish() == []
    # plain text with no harmony header at all is the reply's text
    assert run(HarmonyParser, ["just text"]) == ["just text"]
    # the recipient before the channel, and a reply cut before its <|call|>
    assert run(HarmonyParser, ['<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": 2}']) \
        == [("f", {"a": 2})]
