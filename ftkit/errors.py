"""The one family of errors a user can act on: input that cannot be used, said in one line.

Every reader (safetensors, GGUF, config.json, FTW, tokenizer files) raises a subclass, so the
commands catch this family and nothing broader; any other exception is a bug and shows as one.
Imports nothing, so the lowest layers can raise it too.
"""

from __future__ import annotations

import reprlib
from typing import Any


def one_line(message: str, limit: int = 400) -> str:
    """A message as one printable line: names read from a corrupt header can hold any bytes."""
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist, _SHORT.maxtuple = 3, 4, 6, 6
_SHORT.maxstring, _SHORT.maxlong, _SHORT.maxother = 60, 40, 60


def shown(value: Any) -> str:
    """A value read from a file, as a message quotes it: its repr, cut short (a corrupt header
    can hold a list of a million entries or a 4,000-digit number)."""
    return _SHORT.repr(value)


class InputError(Exception):
    """An input file cannot be used; the message is one printable line naming it and why."""

    def __init__(self, message: str):
        super().__init__(one_line(message))
