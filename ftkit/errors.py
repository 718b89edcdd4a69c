"""The one family of errors a user can act on: input that cannot be used, said in one line.

Every reader (safetensors, GGUF, config.json, FTW, tokenizer files) raises a subclass, so the
commands catch this family and nothing broader; any other exception is a bug and shows as one.
Imports nothing, so the lowest layers can raise it too.
"""

from __future__ import annotations


def one_line(message: str, limit: int = 400) -> str:
    """A message as one printable line: names read from a corrupt header can hold any bytes."""
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class InputError(Exception):
    """An input file cannot be used; the message is one printable line naming it and why."""

    def __init__(self, message: str):
        super().__init__(one_line(message))
