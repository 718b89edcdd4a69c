"""What every tool-call parser returns (text pieces, whole calls, reasoning pieces), and the
framing most formats share: calls between an opening and a closing tag, text around them."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialised
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))


@dataclass
class Reasoning:
    """A piece of the model's reasoning (harmony's analysis channel): each API carries it in its
    own reasoning field, apart from the reply's text."""

    text: str


Item = str | ToolCall | Reasoning


def held(text: str, *tags: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `tags`: what a
    streaming parser holds back, as it may be the start of a tag."""
    return max((n for tag in tags for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)


def call(name: Any, args: Any) -> ToolCall | None:
    """A call from a decoded name and arguments object, or None where they are not those."""
    if not isinstance(name, str) or not name.strip() or not isinstance(args, dict):
        return None
    return ToolCall(name.strip(), json.dumps(args, ensure_ascii=False))


def json_or_text(value: str) -> Any:
    """An argument value written as text (the XML-ish formats): JSON where it reads as JSON (a
    number, true, an object), else the text itself; as vLLM's parsers for these formats do."""
    try:
        return json.loads(value)
    except ValueError:
        return value


class Format:
    """What a parser class says about its format."""

    TAGS: ClassVar[tuple[str, ...]]  # tag strings whose tokens must stay in the decoded text
    MARKERS: ClassVar[tuple[str, ...]]  # all of these in a chat template: it is this format
    FRAMES_EVERY_REPLY: ClassVar[bool] = False  # parse replies to requests without tools too
    in_reasoning: bool = False  # inside reasoning now: the token just fed counts as a reasoning token

    @classmethod
    def matches(cls, template: str) -> bool:
        return all(m in template for m in cls.MARKERS)


class TaggedParser(Format):
    """Calls framed by OPEN ... CLOSE (CLOSE None: the call runs to the end of the reply).

    Incremental: `feed(delta)` returns the items complete so far, holding back any tail that
    may be the start of a tag, and `finish()` flushes the rest at the end of the reply. A body
    that `decode` refuses is given back as the text it was, tags included."""

    OPEN: ClassVar[str]
    CLOSE: ClassVar[str | None]

    def __init__(self) -> None:
        self.buf = ""
        self.inside = False

    def decode(self, body: str) -> list[ToolCall] | None:
        """The calls a body between the tags holds, or None when it is not a valid one."""
        raise NotImplementedError

    def feed(self, delta: str) -> list[Item]:
        self.buf += delta
        out: list[Item] = []
        while not (self.inside and self.CLOSE is None):
            tag = self.CLOSE if self.inside else self.OPEN
            i = self.buf.find(tag)
            if i < 0:
                break
            body, self.buf = self.buf[:i], self.buf[i + len(tag):]
            if self.inside:
                out += self._calls(body)
            elif body:
                out.append(body)
            self.inside = not self.inside
        if not self.inside:
            keep = held(self.buf, self.OPEN)
            if len(self.buf) > keep:
                out.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
        return out

    def finish(self) -> list[Item]:
        """An unterminated call (the reply ended before its closing tag) still counts when its
        body decodes; anything else is text."""
        rest, self.buf = self.buf, ""
        if self.inside:
            self.inside = False
            return self._calls(rest, closed=False)
        return [rest] if rest else []

    def _calls(self, body: str, closed: bool = True) -> list[Item]:
        calls = self.decode(body)
        if calls:
            return list(calls)
        return [self.OPEN + body + ((self.CLOSE or "") if closed else "")]
