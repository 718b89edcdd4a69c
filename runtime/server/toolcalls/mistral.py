"""Mistral / Mixtral tool calls: `[TOOL_CALLS]` then the calls, to the end of the reply; either
a JSON list of {"name", "arguments"} objects (Mixtral-8x22B, Mistral v3 templates) or, in the
newer templates, `name[ARGS]{...}` after each `[TOOL_CALLS]`. Calls are whole only when the
reply ends, so a stream gets them at its end."""

from __future__ import annotations

import json

from .base import TaggedParser, ToolCall, call

ARGS = "[ARGS]"


class MistralParser(TaggedParser):
    OPEN, CLOSE = "[TOOL_CALLS]", None
    TAGS = (OPEN, ARGS)
    MARKERS = (OPEN,)

    def decode(self, body: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        for part in body.split(self.OPEN):
            got = _json_calls(part) if part.lstrip()[:1] in ("[", "{") else _args_call(part)
            if got is None:
                return None
            calls += got
        return calls or None


def _json_calls(text: str) -> list[ToolCall] | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    objs = obj if isinstance(obj, list) else [obj]
    calls = [call(o.get("name"), o.get("arguments", {})) if isinstance(o, dict) else None for o in objs]
    return None if not calls or None in calls else calls


def _args_call(text: str) -> list[ToolCall] | None:
    name, sep, args = text.partition(ARGS)
    try:
        c = call(name, json.loads(args)) if sep else None
    except json.JSONDecodeError:
        return None
    return [c] if c else None
