"""GLM-4.5 / 4.6 tool calls: the function name, then key/value pairs, inside the hermes tags:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

A value is taken as JSON where it reads as JSON (the template writes non-string arguments with
tojson), else as the text it is."""

from __future__ import annotations

import re

from .base import TaggedParser, ToolCall, call, json_or_text

PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class GLMParser(TaggedParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    # GLM's tokenizer has all six as added tokens: each must stay in the decoded text
    TAGS = (OPEN, CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    MARKERS = ("<arg_key>", "<arg_value>")

    def decode(self, body: str) -> list[ToolCall] | None:
        name, _, rest = body.partition("<arg_key>")
        rest = "<arg_key>" + rest if rest else ""
        if not name.strip() or any(c.isspace() for c in name.strip()) or PAIR.sub("", rest).strip():
            return None  # a name of one word, then only pairs
        c = call(name, {k.strip(): json_or_text(v) for k, v in PAIR.findall(rest)})
        return [c] if c else None
