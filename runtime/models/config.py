"""Typed reads of an untrusted config: an HF `config.json`, or GGUF metadata under its keys.

Families read every value through these, so a wrong type, a non-finite number or a count that
would make a per-layer list enormous is a SpecError naming the key, raised before anything is
built from it. A key whose value is null counts as absent (HF configs write null for unset).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ftkit.errors import shown

from ..spec import MAX_LAYERS, MAX_TOKEN_ID, SpecError, real, whole

MISSING: Any = object()
MAX_COUNT = (1 << 31) - 1  # a count no family bounds more tightly
MAX_LIST = 4096  # lists in a config: architectures, layer types, dense-layer indices, eos ids


def need(cfg: Mapping[str, Any], *keys: str, what: str) -> Any:
    """The first present key's value; a clear error naming what is missing otherwise."""
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    raise SpecError(f"config has no {what} (looked for {', '.join(keys)})")


def _get(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    v = cfg.get(key)
    if v is None:
        if default is MISSING:
            raise SpecError(f"config has no {key}")
        return default
    return v


def count(cfg: Mapping[str, Any], key: str, default: Any = MISSING, lo: int = 0, hi: int = MAX_COUNT) -> int:
    """A whole number in lo..hi; `default` (as given) when absent."""
    v = cfg.get(key)
    return _get(cfg, key, default) if v is None else whole(v, key, lo, hi)


def first_count(cfg: Mapping[str, Any], *keys: str, what: str, lo: int = 1, hi: int = MAX_COUNT) -> int:
    """The first present key of `keys` as a whole number in lo..hi."""
    v = need(cfg, *keys, what=what)
    return whole(v, next(k for k in keys if cfg.get(k) is not None), lo, hi)


def number(cfg: Mapping[str, Any], key: str, default: float, lo: float, hi: float, open_lo: bool = False) -> float:
    """A finite number in lo..hi (`open_lo`: above lo); `default` when absent."""
    v = _get(cfg, key, default)
    return real(v, key, lo, hi, open_lo)


def flag(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    v = _get(cfg, key, default)
    if type(v) is not bool:
        raise SpecError(f"{key} is {shown(v)}, not true or false")
    return v


def text(cfg: Mapping[str, Any], key: str, default: str | None = None) -> str | None:
    v = _get(cfg, key, default)
    if v is not None and type(v) is not str:
        raise SpecError(f"{key} is {shown(v)}, not a string")
    return v


def section(cfg: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A nested object (`rope_parameters`, `rope_scaling`), or {} when absent."""
    v = _get(cfg, key, {})
    if type(v) is not dict:
        raise SpecError(f"{key} is {shown(v)}, not an object")
    return v


def _list(cfg: Mapping[str, Any], key: str, hi_len: int) -> list[Any]:
    v = _get(cfg, key, [])
    if type(v) is not list or len(v) > hi_len:
        what = f"a list of {len(v)}" if type(v) is list else shown(v)
        raise SpecError(f"{key} is {what}, not a list of at most {hi_len} entries")
    return v


def names(cfg: Mapping[str, Any], key: str, hi_len: int = MAX_LIST) -> list[str]:
    """A list of strings ([] when absent)."""
    v = _list(cfg, key, hi_len)
    bad = [x for x in v if type(x) is not str]
    if bad:
        raise SpecError(f"{key} holds {shown(bad[0])}, not a string")
    return v


def layer_indices(cfg: Mapping[str, Any], key: str) -> list[int]:
    """A list of layer indices (`mlp_only_layers`); [] when absent."""
    return [whole(x, f"an entry of {key}", 0, MAX_LAYERS - 1) for x in _list(cfg, key, MAX_LAYERS)]


def token_ids(cfg: Mapping[str, Any], key: str) -> tuple[int, ...]:
    """One token id or a list of them (`eos_token_id` is either); () when absent."""
    v = cfg.get(key)
    if v is None:
        return ()
    ids = _list(cfg, key, MAX_LIST) if isinstance(v, list) else [v]
    return tuple(whole(x, key, 0, MAX_TOKEN_ID) for x in ids)
