"""gpt-oss's harmony format, as the model writes it after the prompt's `<|start|>assistant`:
messages of a header and a body,

    <|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

A message addressed `to=functions.NAME` (in its header, before or after the channel) is a call
with its body as the JSON arguments; `final` and other `commentary` bodies are the reply's text
and `analysis` bodies its reasoning (`Reasoning` items), both streamed as they come. The reply
may end without the last message's terminator (`<|call|>` and `<|return|>` are stop tokens).
Text with no header is text (held until a `<|message|>` or the reply's end shows it is not a
header); a call whose body is not a JSON object is given back as the text it was."""

from __future__ import annotations

import json
import re

from .base import Format, Item, Reasoning, ToolCall, call, held

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN, START)  # what ends a body (a new message's start too)
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
RECIPIENT = re.compile(r"\bto=(functions\.[^\s<]+)")


class HarmonyParser(Format):
    TAGS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
    MARKERS = (CHANNEL, MESSAGE)
    FRAMES_EVERY_REPLY = True  # every reply is in channels: its text is the final channel's

    def __init__(self) -> None:
        self.buf = ""
        self.in_body = False  # else in a header, which runs to <|message|>
        self.header, self.channel, self.recipient = "", "", None

    def feed(self, delta: str) -> list[Item]:
        self.buf += delta
        out: list[Item] = []
        while True:
            if not self.in_body:
                i = self.buf.find(MESSAGE)
                if i < 0:
                    return out
                self._open(self.buf[:i])
                self.buf = self.buf[i + len(MESSAGE):]
                continue
            i = min((j for j in (self.buf.find(t) for t in ENDS) if j >= 0), default=-1)
            if i < 0:
                break
            out += self._body(self.buf[:i], done=True)
            end = next(t for t in ENDS if self.buf.startswith(t, i))
            self.buf, self.in_body = self.buf[i + len(end):], False
        if not self.recipient:  # text streams, less a tail that may be a tag
            keep = held(self.buf, *ENDS)
            out += self._body(self.buf[: len(self.buf) - keep], done=False)
            self.buf = self.buf[len(self.buf) - keep:]
        return out

    def finish(self) -> list[Item]:
        rest, self.buf = self.buf, ""
        if not self.in_body:  # text with no <|message|> after it: not a header, so text
            return [rest] if rest else []
        return self._body(rest, done=True)

    @property
    def in_reasoning(self) -> bool:
        return self.in_body and self.channel == "analysis" and not self.recipient

    def _open(self, header: str) -> None:
        m, r = CHANNEL_NAME.search(header), RECIPIENT.search(header)
        self.header, self.channel, self.recipient = header, (m[1] if m else ""), (r[1] if r else None)
        self.in_body = True

    def _body(self, text: str, done: bool) -> list[Item]:
        """`text` of the current body (a call's whole body, when `done`)."""
        if self.recipient:
            if not done:
                return []
            c = _call(self.recipient.removeprefix("functions."), text)
            return [c] if c else [self.header + MESSAGE + text]
        if not text:
            return []
        return [Reasoning(text)] if self.channel == "analysis" else [text]


def _call(name: str, body: str) -> ToolCall | None:
    try:
        return call(name, json.loads(body))
    except json.JSONDecodeError:
        return None
