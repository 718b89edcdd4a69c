"""The K/V bytes of a sequence, from the spec alone (no torch: the memory plan of a header-only
check reads them); `kv.KVCache` allocates exactly these.

A full-attention layer keeps a row per position. A sliding-window layer keeps a ring of
`ring_rows` rows, position p at row p mod ring: the window and up to RING_HEADROOM rows more, so
a graph extend of a few tokens can write all its keys before its first query reads the
`window - 1` keys before it (`ring_extend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..spec import FULL_ATTENTION, SLIDING_ATTENTION, ModelSpec

# Rows of a sliding layer's ring beyond its window (at most the window again): the keys of a graph
# extend but its first (kernels/triton/attention.MAX_QUERIES = 64 queries; engine/graphs.py
# takes no more than `ring_extend`).
RING_HEADROOM = 63


class DType(Protocol):
    """A dtype as the plans use it: its bytes per element (a torch.dtype is one)."""

    @property
    def itemsize(self) -> int: ...


def attention_layers(spec: ModelSpec) -> list[int]:
    """The softmax-attention layers (full or sliding): those that keep K/V rows."""
    return [i for i, kind in enumerate(spec.layer_kinds) if kind in (FULL_ATTENTION, SLIDING_ATTENTION)]


def sliding_layers(spec: ModelSpec) -> list[int]:
    """The attention layers with a window: those that keep a ring of `ring_rows(spec)` rows."""
    if spec.sliding_window is None:
        return []
    return [i for i, kind in enumerate(spec.layer_kinds) if kind == SLIDING_ATTENTION]


def ring_rows(spec: ModelSpec) -> int:
    """Rows of a sliding layer's ring (0 without sliding layers): key position p lives at row
    p mod this, in every cache, graph buffer and kernel that addresses it."""
    if not sliding_layers(spec):
        return 0
    return spec.sliding_window + min(spec.sliding_window, RING_HEADROOM)


def ring_extend(spec: ModelSpec) -> int | None:
    """The most tokens a forward may write into the rings before its queries attend (the graph
    extend: its first query still finds the window - 1 keys before it); None without rings."""
    ring = ring_rows(spec)
    return ring - spec.sliding_window + 1 if ring else None


def kv_rows(spec: ModelSpec) -> tuple[tuple[int, int], tuple[int, int]]:
    """(heads, width) of one position's K row and V row in an attention layer. Latent attention
    (MLA, a spec with `extra["kv_lora_rank"]`) keeps one row per position, the compressed latent
    then the rotated rope key (kv_lora_rank + head_dim values), which serves as key and, its
    latent part, as value (deepseek_v3_forward.py): its V row is empty."""
    latent = spec.extra.get("kv_lora_rank")
    if latent:
        return (1, latent + spec.head_dim), (1, 0)
    return (spec.num_kv_heads, spec.head_dim), (spec.num_kv_heads, spec.head_dim)


@dataclass(frozen=True)
class KVSize:
    """What sequences' K/V take: `full` bytes a position over the full-attention layers,
    `sliding` bytes a row over the sliding ones, whose rings hold at most `ring` rows; a saved
    window (a prefix-cache anchor, kv.CacheSnapshot) keeps `saved` rows of them."""

    full: int
    sliding: int = 0
    ring: int = 0
    saved: int = 0

    def bytes(self, tokens: int, sequences: int = 1) -> int:
        """K/V of `sequences` caches holding `tokens` positions in all: every position in the
        full layers, at most `ring` of each sequence's in the sliding ones."""
        return tokens * self.full + min(tokens, sequences * self.ring) * self.sliding

    def tokens_within(self, budget: int, sequences: int = 1) -> int:
        """The most positions `bytes(., sequences)` fits in `budget` (without full layers and
        past the rings: `budget` itself, a bound the positions never reach)."""
        cap = sequences * self.ring
        within_rings = max(0, budget) // max(1, self.full + self.sliding)
        if within_rings <= cap:
            return within_rings
        return (budget - cap * self.sliding) // self.full if self.full else budget

    @property
    def window_bytes(self) -> int:
        """One sequence's sliding-layer rings at their full size."""
        return self.ring * self.sliding

    @property
    def saved_bytes(self) -> int:
        """One saved window of every sliding layer."""
        return self.saved * self.sliding


def kv_size(spec: ModelSpec, dtype: DType) -> KVSize:
    """The K/V bytes KVCache allocates for `spec` at `dtype`."""
    (kh, kw), (vh, vw) = kv_rows(spec)
    row = (kh * kw + vh * vw) * dtype.itemsize  # one position of one layer
    sliding = len(sliding_layers(spec))
    full = len(attention_layers(spec)) - sliding
    return KVSize(full * row, sliding * row, ring_rows(spec), spec.sliding_window - 1 if sliding else 0)
