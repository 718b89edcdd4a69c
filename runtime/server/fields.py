"""Typed access to a JSON request body: every bad field becomes a 400 naming the field."""

from __future__ import annotations

from typing import Any

from .errors import ApiError

REQUIRED = object()
_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
          dict: "an object"}


def get(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = REQUIRED) -> Any:
    """`body[name]` checked against `kind`; `default` when absent or null (required without one)."""
    value = body.get(name)
    if value is None:
        if default is REQUIRED:
            raise ApiError(400, f"'{name}' is required", param=name)
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise ApiError(400, f"'{name}' is out of range", param=name) from None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        want = " or ".join(_NAMES.get(k, k.__name__) for k in kinds)
        raise ApiError(400, f"'{name}' must be {want}, got {type(value).__name__}", param=name)
    return value


def get_range(body: dict[str, Any], name: str, kind: type, lo: float, hi: float, default: Any = REQUIRED) -> Any:
    value = get(body, name, kind, default)
    if value is not None and not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {value}", param=name)
    return value


def stop_list(body: dict[str, Any], name: str) -> list[str]:
    """A stop field: one string or a list of strings."""
    value = get(body, name, (str, list), [])
    items = [value] if isinstance(value, str) else value
    if not all(isinstance(s, str) for s in items):
        raise ApiError(400, f"'{name}' must be a string or an array of strings", param=name)
    return [s for s in items if s]
