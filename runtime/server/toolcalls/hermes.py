"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
any number per reply, text allowed around them."""

from __future__ import annotations

import json

from .base import TaggedParser, ToolCall, call


class HermesParser(TaggedParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    TAGS = (OPEN, CLOSE)
    MARKERS = (OPEN,)

    def decode(self, body: str) -> list[ToolCall] | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models serialise the arguments twice
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        c = call(obj.get("name"), args)
        return [c] if c else None
