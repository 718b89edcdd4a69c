"""Qwen3-Coder / Qwen3.5 tool calls, XML-ish inside the hermes tags:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text between its tags less one newline either side, taken as JSON
where it reads as JSON (the template writes non-string arguments with tojson)."""

from __future__ import annotations

import re

from .base import TaggedParser, ToolCall, call, json_or_text

FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class QwenXMLParser(TaggedParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    TAGS = (OPEN, CLOSE)
    MARKERS = ("<function=", "<parameter=")

    def decode(self, body: str) -> list[ToolCall] | None:
        m = FUNCTION.fullmatch(body)
        if m is None or PARAMETER.sub("", m[2]).strip():  # only parameters between the function tags
            return None
        args = {k.strip(): json_or_text(_unwrap(v)) for k, v in PARAMETER.findall(m[2])}
        c = call(m[1], args)
        return [c] if c else None


def _unwrap(value: str) -> str:
    """The template's value, without the newlines it puts around it."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value
