"""Reasoning effort: each API's request field -> the chat template's `reasoning_effort`, the
variable gpt-oss's template reads (`Reasoning: low | medium | high` in its system message).
The schemas admit only the values below (anything else is a 400 there); None leaves the
variable undefined, so the template's own default (medium for gpt-oss) applies."""

from __future__ import annotations

from .schemas import ReasoningEffort, ThinkingConfig

# OpenAI's efforts (chat `reasoning_effort`, Responses `reasoning.effort`) onto the template's three.
OPENAI = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high",
          "max": "high"}
# Anthropic `thinking.budget_tokens` below each bound -> that effort; at or above the last: high.
BUDGETS = ((4096, "low"), (16384, "medium"))


def openai_effort(effort: ReasoningEffort | None) -> str | None:
    return OPENAI[effort] if effort else None


def anthropic_effort(thinking: ThinkingConfig | None) -> str | None:
    """`disabled`: low (gpt-oss cannot skip its reasoning, only shorten it); `enabled` by its
    budget (medium without one); `adaptive` and `between_tools`: the model decides, medium."""
    if thinking is None:
        return None
    if thinking.type == "disabled":
        return "low"
    if thinking.type != "enabled" or thinking.budget_tokens is None:
        return "medium"
    return next((effort for bound, effort in BUDGETS if thinking.budget_tokens < bound), "high")
