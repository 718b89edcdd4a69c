"""A bounded pool of snapshots ("anchors": recurrent states, sliding windows), each at the end of
a radix node.

A recurrent layer can resume only where its state was saved, and one state costs as much as
hundreds of tokens of K/V, so few fit. A sliding-window layer likewise resumes only where its
window (the `window - 1` K/V rows before the cut) was saved: the tree keeps none of its rows.
They are taken where agent harnesses cut (see boundaries.MARKERS) and kept by value:

    value = position x weight(kind) / (1 + age in requests)

- position: a deeper anchor saves more recompute, and a short side request's anchors (a title
  generation) lose to a long session's;
- weight: the tail of a request's prompt (the next turn appends there) 8, a turn header 4, a
  thinking / tool-call / tool-result boundary 2, a cut inside a thinking block or a periodic one
  1 (thinking blocks of older turns are what OpenClaw-style harnesses delete first);
- age: requests since the anchor was made or last lay on a matched prefix; every request of a
  live session touches all the anchors of its prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.kv import CacheSnapshot
from .boundaries import KIND_RANK
from .radix import Node

TAIL = "tail"
WEIGHT = {TAIL: 8, **{k: 2 ** (r - 1) if r else 0 for k, r in KIND_RANK.items()}}


@dataclass(eq=False)
class Anchor:
    snap: CacheSnapshot
    kind: str
    node: Node
    last_used: int

    def value(self, clock: int) -> float:
        return self.snap.length * WEIGHT[self.kind] / (1 + clock - self.last_used)


class AnchorPool:
    def __init__(self, slots: int):
        self.slots = slots
        self.live: set[Anchor] = set()

    def add(self, node: Node, snap: CacheSnapshot, kind: str, clock: int) -> None:
        if node.anchor is not None:  # the same prefix, saved again: keep the stronger kind
            old = node.anchor
            old.kind = max(old.kind, kind, key=WEIGHT.__getitem__)
            old.last_used = clock
            return
        node.anchor = Anchor(snap, kind, node, clock)
        self.live.add(node.anchor)

    def evict(self, clock: int) -> None:
        while len(self.live) > self.slots:
            self.drop(min(self.live, key=lambda a: a.value(clock)).node)

    def drop(self, node: Node) -> None:
        if node.anchor is not None:
            self.live.discard(node.anchor)
            node.anchor = None
