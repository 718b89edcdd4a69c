"""The one family of errors a user can act on: input that cannot be used, said in one line.

Every reader (safetensors, GGUF, config.json, FTW, tokenizer files) raises a subclass, so the
commands catch this family and nothing broader; any other exception is a bug and shows as one.
Imports nothing of ftkit, so the lowest layers can raise it too.
"""

from __future__ import annotations

import os
import reprlib
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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


def refused(e: BaseException) -> bool:
    """Whether `e` is how a compiled library refuses its input: any Exception, or a Rust panic.

    pyo3 raises a panic as PanicException, which derives from BaseException (so `except
    Exception` lets it through, to a traceback) and cannot be imported by name. A tokenizer.json
    whose continuing_subword_prefix is longer than a merge's right half panics in tokenizers'
    BPE builder, for one.
    """
    return isinstance(e, Exception) or _panic(e)


def _panic(e: BaseException) -> bool:
    return type(e).__name__ == "PanicException"


@contextmanager
def panic_quiet() -> Iterator[None]:
    """Hold what is written to fd 2 while a Rust library runs, and drop it if the library panics.

    A panic prints its own lines to stderr before it is raised; the caller turns the exception
    into the one-line error, so those lines would only repeat it as noise. Anything written
    meanwhile without a panic is passed on when the block ends.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    panicked = False
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException as e:
            panicked = _panic(e)
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            if not panicked and (text := held.read()):
                os.write(2, text)
