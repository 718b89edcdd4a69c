"""Tool calls parsed out of generated text, one small module per format, chosen by family.

A parser is incremental: `feed(delta)` returns the output items complete so far (plain text and
whole tool calls), holding back any tail that may be the start of a tag, and `finish()` flushes
what is left at the end of the reply. A call whose body is not valid JSON is given back as text.
"""

from __future__ import annotations

from . import hermes
from .base import Item, ToolCall

__all__ = ["FORMATS", "Item", "ToolCall", "parser_for", "tag_tokens"]

# family -> the parser its chat template's tool format needs
FORMATS = {"qwen3_moe": hermes.HermesParser, "qwen2_moe": hermes.HermesParser}


def parser_for(family: str) -> type | None:
    """The parser class for a family's tool-call format, or None when it has none we know."""
    return FORMATS.get(family)


def tag_tokens(family: str) -> tuple[str, ...]:
    """Tag strings whose tokens must stay in the decoded text for the family's parser."""
    cls = parser_for(family)
    return cls.TAGS if cls else ()
