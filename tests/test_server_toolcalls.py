"""Tool-call parsers on their own: any chunking of the text gives the same items."""

from __future__ import annotations

import json

import pytest

from ftkit.runtime.server.toolcalls import ToolCall, parser_for

TEXT = ('Checking.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": "{\\"b\\": 2}"}</tool_call> done <tool')


def run(chunks: list[str]) -> list:
    p = parser_for("qwen3_moe")()
    items = [i for c in chunks for i in p.feed(c)] + p.finish()
    out, text = [], ""
    for i in items:  # merge adjacent text so chunkings compare equal
        if isinstance(i, ToolCall):
            out += [text, (i.name, json.loads(i.arguments))] if text else [(i.name, json.loads(i.arguments))]
            text = ""
        else:
            text += i
    return out + ([text] if text else [])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_hermes_any_chunking(size):
    chunks = [TEXT[i:i + size] for i in range(0, len(TEXT), size)]
    assert run(chunks) == ["Checking.", ("f", {"a": 1}), "\n", ("g", {"b": 2}), " done <tool"]


def test_hermes_closing_tag_split_and_never_leaked():
    p = parser_for("qwen3_moe")()
    assert p.feed('<tool_call>{"name": "f", "arguments": {}}</tool_') == []
    items = p.feed("call>")
    assert len(items) == 1 and items[0].name == "f"
    assert p.feed("<tool_c") == []  # held back: may be a tag


def test_hermes_bad_json_is_text_and_unterminated_call_counts():
    assert run(["<tool_call>{oops}</tool_call>"]) == ["<tool_call>{oops}</tool_call>"]
    assert run(['<tool_call>\n{"name": "f", "arguments": {}}\n']) == [("f", {})]
    assert parser_for("mixtral") is None
