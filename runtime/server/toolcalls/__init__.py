"""Tool calls parsed out of generated text, one small module per format, chosen by the chat
template the checkpoint ships: the format its tool-call instructions and examples are written
in is the one the model was trained to emit.

A parser is incremental: `feed(delta)` returns the output items complete so far (plain text,
whole tool calls, and reasoning where the format marks it), holding back any tail that may be the start of a tag, and `finish()` flushes
what is left at the end of the reply. A call that does not decode is given back as text.
"""

from __future__ import annotations

from typing import Protocol

from . import glm, harmony, hermes, mistral, qwen_xml
from .base import Item, Reasoning, ToolCall

__all__ = ["PARSERS", "Item", "Parser", "Reasoning", "ToolCall", "parser_for", "tag_tokens"]


class Parser(Protocol):
    """A format's parser (base.Format says which format; one instance parses one reply)."""

    TAGS: tuple[str, ...]
    FRAMES_EVERY_REPLY: bool
    in_reasoning: bool

    def feed(self, delta: str) -> list[Item]: ...

    def finish(self) -> list[Item]: ...


# Most specific first: the Qwen XML and GLM formats sit inside hermes' <tool_call> tags.
PARSERS = (harmony.HarmonyParser, glm.GLMParser, qwen_xml.QwenXMLParser, hermes.HermesParser,
           mistral.MistralParser)


def parser_for(template: str | None) -> type[Parser] | None:
    """The parser for the tool-call format a chat template's text is written in, or None when
    it has none we know (or no template)."""
    return next((p for p in PARSERS if p.matches(template)), None) if template else None


def tag_tokens(template: str | None) -> tuple[str, ...]:
    """Tag strings whose tokens must stay in the decoded text for the template's parser."""
    cls = parser_for(template)
    return cls.TAGS if cls else ()
