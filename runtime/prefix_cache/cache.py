"""The prefix cache the generation loop talks to: resume a prompt from the longest exact prefix,
then remember what its prefill computed."""

from __future__ import annotations

from dataclasses import dataclass

from ..models.kv import CacheSnapshot, KVCache
from ..models.kv_size import attention_layers, sliding_layers
from ..spec import LINEAR_ATTENTION, ModelSpec
from .anchors import TAIL, AnchorPool
from .boundaries import Boundaries
from .radix import RadixTree


@dataclass
class PrefixStats:
    requests: int = 0
    reused_tokens: int = 0
    prompt_tokens: int = 0


class PrefixCache:
    """Full-attention layers resume from the longest radix match (cut down to a cut of the
    canonical grid); recurrent layers and sliding-window ones from the deepest live anchor
    inside it, which saved their states or their windows (`window - 1` rows each: all a
    later query reads of the prefix; the tree keeps none of their rows). With `anchors` off,
    only each prompt's tail is saved (what a plain hybrid cache does)."""

    def __init__(self, spec: ModelSpec, boundaries: Boundaries, max_tokens: int, anchors: bool = True,
                 anchor_slots: int = 32):
        self.grid, self.anchors_on = boundaries, anchors
        self.recurrent = LINEAR_ATTENTION in spec.layer_kinds
        sliding = sliding_layers(spec)
        self.anchored = self.recurrent or bool(sliding)  # resumes only where a snapshot was saved
        self.tree = RadixTree(max_tokens, [i for i in attention_layers(spec) if i not in sliding])
        self.pool = AnchorPool(anchor_slots)
        self.stats = PrefixStats()

    def resume(self, tokens: list[int], cuts: dict[int, str], kv: KVCache) -> int:
        """Load the longest reusable prefix of `tokens` into the empty `kv`; returns its length
        (at most len - 1: the last prompt token is always computed, for its logits)."""
        path, matched = self.tree.match(tokens)
        limit = min(matched, len(tokens) - 1)
        start, snap = 0, None
        if self.anchored:
            for node in path:
                if node.anchor is not None and node.depth <= limit:
                    node.anchor.last_used = self.tree.clock  # a live session keeps its anchors young
                    start, snap = node.depth, node.anchor.snap
        else:
            start = max((p for p in cuts if p <= limit), default=0)
        if start:
            self.tree.copy_into(path, start, kv)
            kv.restore(snap or CacheSnapshot(start))
        self.stats.requests += 1
        self.stats.reused_tokens += start
        self.stats.prompt_tokens += len(tokens)
        return start

    def snapshot_points(self, tokens: list[int], cuts: dict[int, str]) -> dict[int, str]:
        """Cut -> anchor kind, for the cuts whose recurrent state (or sliding windows) the prefill
        should save."""
        if not self.anchored:
            return {}
        end = self.grid.stable_end(cuts, len(tokens))
        points = {p: k for p, k in cuts.items() if k != "page" and p < end} if self.anchors_on else {}
        if end:
            points[end] = TAIL
        return points

    def insert(self, tokens: list[int], cuts: dict[int, str], kv: KVCache,
               snaps: dict[int, CacheSnapshot], kinds: dict[int, str]) -> None:
        """Remember rows 0..stable end of `kv` and the new snapshots, then evict to the budgets."""
        end = self.grid.stable_end(cuts, len(tokens))
        if not end:
            return
        nodes = self.tree.insert(tokens, end, kv, list(snaps))
        for pos, snap in snaps.items():
            self.pool.add(nodes[pos], snap, kinds[pos], self.tree.clock)
        self.pool.evict(self.tree.clock)
        self.tree.evict(self.pool.drop)

    def remember(self, tokens: list[int], cuts: dict[int, str], kv: KVCache) -> bool:
        """`insert` a decoded sequence's rows (a GPU's: rounding, not bits, is its contract);
        False where it cannot resume from them: a recurrent state inside it was never saved, or
        the rings no longer hold the sliding windows at its stable end (a tail anchor saves
        them: the end is a page from the last position, which a ring's headroom covers)."""
        end = self.grid.stable_end(cuts, len(tokens))
        if self.recurrent or (end and not kv.holds(end)):
            return False
        snaps = {end: kv.snapshot(end)} if self.anchored and end else {}
        self.insert(tokens, cuts, kv, snaps, dict.fromkeys(snaps, TAIL))
        return True

    def clear(self) -> None:
        """Forget every prefix and anchor (the warm-up's requests), the budgets kept."""
        self.tree = RadixTree(self.tree.max_tokens, self.tree.layers)
        self.pool = AnchorPool(self.pool.slots)
        self.stats = PrefixStats()

    def info(self) -> dict:
        s = self.stats
        return {"tokens": self.tree.tokens, "max_tokens": self.tree.max_tokens, "anchors": len(self.pool.live),
                "anchor_slots": self.pool.slots if self.anchored else 0, "anchors_on": self.anchors_on,
                "requests": s.requests, "prompt_tokens": s.prompt_tokens, "reused_tokens": s.reused_tokens}
