"""JSON from files we did not write: safetensors headers, config.json, indexes, FTW manifests,
tokenizer configs.

`json.loads` recurses once per nesting level (a 100,000-deep `[[[...` is a RecursionError, not a
parse error), takes `NaN` and `Infinity` (and `1e999` as infinity), and reads whatever size the
file has. Here the nesting depth is counted before parsing, non-finite numbers are refused while
parsing, files are size-checked before they are read, and every failure is one line of the
caller's error class naming the file.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from pathlib import Path
from typing import Any

from ftkit.errors import InputError

MAX_DEPTH = 64  # real headers and configs nest 2-5 deep; json.loads is safe far beyond this
MAX_JSON_BYTES = 64 << 20  # config, index, manifest and tokenizer config files are at most a few MB

_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'  # a JSON string literal, escapes included
_STRINGS = re.compile(_STRING)
_NOT_BRACKET = re.compile(r"[^][{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def too_deep(text: str, limit: int) -> bool:
    """Whether arrays and objects in `text` nest deeper than `limit` (brackets inside strings
    skipped): the running count of open brackets, without parsing anything."""
    if text.count("[") + text.count("{") <= limit:
        return False
    brackets = _NOT_BRACKET.sub("", _STRINGS.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > limit


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(data: bytes | str, where: str, error: type[InputError], what: str | None = None) -> Any:
    """`data` parsed, or `error("{where}: [{what} is ]not valid JSON (...)")`."""
    invalid = f"{what} is not valid JSON" if what else "not valid JSON"
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise error(f"{where}: {invalid} (not UTF-8 at byte {e.start})") from None
    if too_deep(text, MAX_DEPTH):
        raise error(f"{where}: {what or 'the file'} nests arrays or objects deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except ValueError as e:  # JSONDecodeError, a refused number, an integer of too many digits
        raise error(f"{where}: {invalid} ({e})") from None


def read_json(path: Path, error: type[InputError], limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON document in the file `path`, read only when it is at most `limit` bytes."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise error(f"{path}: {size} bytes, more than the {limit} a JSON file here may have")
        data = path.read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    return parse_json(data, str(path), error)


def read_object(path: Path, error: type[InputError]) -> dict[str, Any]:
    """`read_json` for files whose top level must be an object (configs, manifests)."""
    value = read_json(path, error)
    if not isinstance(value, dict):
        raise error(f"{path}: the top level is {type_name(value)}, not a JSON object")
    return value


def type_name(value: Any) -> str:
    """How a JSON value's type reads in a message."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)
