"""Qwen / Hermes tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number
per reply, text allowed around them."""

from __future__ import annotations

import json

from .base import Item, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _held(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    return max((n for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)


class HermesParser:
    TAGS = (OPEN, CLOSE)

    def __init__(self) -> None:
        self.buf = ""
        self.inside = False

    def feed(self, delta: str) -> list[Item]:
        self.buf += delta
        out: list[Item] = []
        while True:
            tag = CLOSE if self.inside else OPEN
            i = self.buf.find(tag)
            if i < 0:
                break
            body, self.buf = self.buf[:i], self.buf[i + len(tag):]
            if self.inside:
                out.append(self._call(body))
            elif body:
                out.append(body)
            self.inside = not self.inside
        if not self.inside:
            keep = _held(self.buf, OPEN)
            if len(self.buf) > keep:
                out.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
        return out

    def finish(self) -> list[Item]:
        """An unterminated call (the reply ended before its closing tag) still counts when its
        body is a whole JSON call; anything else is text."""
        rest, self.buf = self.buf, ""
        if self.inside:
            self.inside = False
            return [self._call(rest)]
        return [rest] if rest else []

    @staticmethod
    def _call(body: str) -> Item:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return OPEN + body + CLOSE
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return OPEN + body + CLOSE
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models serialise the arguments twice
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return OPEN + body + CLOSE
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
