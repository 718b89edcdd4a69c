"""A minimal client for the control API (`ft-run ctl`), on the standard library only."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def call(url: str, method: str, path: str, api_key: str | None = None, body: dict | None = None) -> Any:
    """One JSON request; an HTTP error or an unreachable server becomes a one-line ValueError."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method,
                                 headers={"content-type": "application/json"})
    if api_key:
        req.add_header("authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise ValueError(f"{url}{path}: HTTP {e.code}: {message}") from None
    except urllib.error.URLError as e:
        raise ValueError(f"{url}: cannot reach the server ({e.reason}); is `ft-run serve` running?") from None
