"""What every tool-call parser returns: text pieces and whole calls."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialised
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))


Item = str | ToolCall
