"""Client quirks that would silently defeat the prefix cache, normalised before templating.

Claude Code puts a per-request line in its first system block,
    x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; cch=7f3e2;
whose hash changes on every request: the prompt would diverge at its first lines and nothing
could be reused. It is billing metadata for Anthropic's API, not an instruction, so it is
dropped. (Clients that drop reasoning blocks need nothing here: the anchors at turn boundaries
survive the re-rendered history.)
"""

from __future__ import annotations

import re
from typing import Any

BILLING_LINE = re.compile(r"^[ \t]*x-anthropic-billing-header:[^\n]*(?:\n|$)", re.IGNORECASE | re.MULTILINE)


def normalise(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with per-request noise removed from system prompts."""
    out = []
    for m in messages:
        if m.get("role") == "system" and isinstance(m.get("content"), str) and "billing-header" in m["content"]:
            m = {**m, "content": BILLING_LINE.sub("", m["content"]).lstrip("\n")}
        out.append(m)
    return out
