"""Where a prompt's prefill is cut: every page boundary and every semantic boundary.

Reuse is exact only if a resumed request computes every row the way a from-scratch run of the
same prompt would. CPU matmuls, the attention kernels and the chunked delta rule all round
differently for different segment shapes, so every run (cache on or off) prefills in the same
segments: cut at each multiple of `page` and at each marker the chat template emits. The cuts
of a position depend only on the tokens before it (plus `lookahead` tokens for a "before"
marker of several tokens), so two prompts that share a prefix share its cuts, and a resume
point (always a cut) starts the same segments a from-scratch run would.

Markers (turn headers, thinking blocks, tool calls and results) are matched as token sequences;
a marker counts only when its first token is an added token of the tokenizer, so a family whose
template does not use it never matches plain text that happens to spell it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class TextEncoder(Protocol):
    """What finding markers needs of a tokenizer (engine/tokenizer.py's)."""

    added_ids: frozenset[int]  # ids of the added tokens, special or not

    def encode(self, text: str) -> list[int]: ...


PAGE = 16
PERIOD = 256  # an anchor-worthy cut after this many tokens without a semantic boundary

# (text, kind, after): `after` puts the cut right after the marker, otherwise right before it.
# Each template's generation prompt ("<|im_start|>assistant\n" in ChatML) is an `after` marker:
# the next turn's edits of the reply (dropped reasoning, a re-rendered tool call) start exactly
# there. The families' own tags, as their templates write them: a tokenizer whose added tokens
# lack a tag never matches it (Mixtral's "[INST]" is plain text in its v1 tokenizer: no markers).
MARKERS: tuple[tuple[str, str, bool], ...] = (
    # ChatML (Qwen, OLMoE), and Qwen's and GLM-4.5's thinking and tool tags
    ("<|im_start|>", "turn", False),
    ("<|im_start|>assistant\n", "turn", True),
    ("<think>", "think", False),
    ("</think>", "think", True),
    ("<tool_call>", "tool_call", False),
    ("</tool_call>", "tool_call", True),
    ("<tool_response>", "tool_result", False),
    ("</tool_response>", "tool_result", True),
    # gpt-oss's harmony: every message opens "<|start|>{role}", tool calls and results included
    ("<|start|>", "turn", False),
    ("<|start|>assistant", "turn", True),
    # GLM-4.5's role tags (tool results come as an observation turn)
    ("<|system|>", "turn", False),
    ("<|user|>", "turn", False),
    ("<|assistant|>", "turn", False),
    ("<|assistant|>", "turn", True),
    ("<|observation|>", "turn", False),
    # DeepSeek-V3's and Kimi-K2's
    ("<｜User｜>", "turn", False),
    ("<｜Assistant｜>", "turn", False),
    ("<｜Assistant｜>", "turn", True),
    ("<｜tool▁calls▁begin｜>", "tool_call", False),
    ("<｜tool▁calls▁end｜>", "tool_call", True),
    ("<｜tool▁outputs▁begin｜>", "tool_result", False),
    ("<｜tool▁outputs▁end｜>", "tool_result", True),
    ("<|im_system|>", "turn", False),
    ("<|im_user|>", "turn", False),
    ("<|im_assistant|>", "turn", False),
    ("<|im_assistant|>assistant<|im_middle|>", "turn", True),
)
# Cut kinds, lowest anchor value first; "page" cuts are never anchors.
IN_THINK, PERIODIC = "in_think", "periodic"
KIND_RANK = {"page": 0, IN_THINK: 1, PERIODIC: 1, "think": 2, "tool_call": 2, "tool_result": 2, "turn": 3}


@dataclass(frozen=True)
class Marker:
    ids: tuple[int, ...]
    kind: str
    after: bool


class Boundaries:
    def __init__(self, markers: list[Marker], page: int = PAGE, period: int = PERIOD):
        if page < 1 or period % page:
            raise ValueError("the anchor period must be a multiple of the page size")
        self.markers, self.page, self.period = markers, page, period
        self.by_first: dict[int, list[Marker]] = {}
        for m in markers:
            self.by_first.setdefault(m.ids[0], []).append(m)
        self.lookahead = max((len(m.ids) - 1 for m in markers if not m.after), default=0)

    @classmethod
    def for_tokenizer(cls, tok: TextEncoder | None, page: int = PAGE, period: int = PERIOD) -> Boundaries:
        if tok is None:
            return cls([], page, period)
        added = tok.added_ids
        markers = []
        for text, kind, after in MARKERS:
            ids = tuple(tok.encode(text))
            if ids and ids[0] in added:
                markers.append(Marker(ids, kind, after))
        return cls(markers, page, period)

    def scan(self, tokens: list[int]) -> dict[int, str]:
        """Cut position (1..len) -> kind, in increasing order. A cut at p splits p-1 | p."""
        n, found = len(tokens), {}  # position -> [(kind, after)]
        firsts = self.by_first
        for i in [i for i, t in enumerate(tokens) if t in firsts]:  # most prompts: a few markers
            for m in firsts[tokens[i]]:
                end = i + len(m.ids)
                if end <= n and tuple(tokens[i:end]) == m.ids:
                    p = end if m.after else i
                    if 0 < p:
                        found.setdefault(p, []).append((m.kind, m.after))
        cuts: dict[int, str] = {}
        inside, last_anchor = False, 0
        # only the pages' ends and the markers' cuts can be cuts (each turn's restore scans its
        # whole prompt: visiting every position took 0.62 ms of 3200 tokens on the dev box, this 0.28)
        for p in sorted(found.keys() | range(self.page, n + 1, self.page)):
            kind = None
            for mkind, after in found.get(p, ()):
                if mkind == "think":  # "<think>" opens (cut before), "</think>" closes (cut after)
                    inside = not after
                elif mkind == "turn":  # an unclosed block ends with its turn
                    inside = False
                elif inside:
                    mkind = IN_THINK
                if kind is None or KIND_RANK[mkind] > KIND_RANK[kind]:
                    kind = mkind
            if kind is None and p % self.page == 0:
                kind = PERIODIC if p - last_anchor >= self.period else "page"
            if kind is not None:
                cuts[p] = kind
                if kind != "page":
                    last_anchor = p
        return cuts

    def stable_end(self, cuts: dict[int, str], n: int) -> int:
        """The last cut of an n-token prompt that a longer prompt with the same prefix also has:
        rows before it are computed as any run of such a prompt computes them."""
        return max((p for p in cuts if p <= n - self.lookahead), default=0)
