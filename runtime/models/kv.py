"""One sequence's key/value cache: preallocated per attention layer, filled front to back.

A full-attention layer keeps a row per position. A sliding-window layer keeps a ring
(kv_size.ring_rows): position p at row p mod ring, so it holds the last `ring` positions, all a
query's window needs (and a graph extend's keys beside it). Layers with a recurrent state instead
(linear attention) keep it in `states`: layer -> named tensors, created by the decoder on first
use. Neither a recurrent state nor a ring can be rewound past what it still holds, so resuming a
prefix goes through `snapshot()` / `restore()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..spec import ModelSpec
from .kv_size import attention_layers, kv_rows, ring_rows, sliding_layers


class KVCache:
    """k/v [rows, heads, width] per softmax-attention layer (`kv_rows`: num_kv_heads x
    head_dim, or latent attention's one latent row and an empty V), and the number of
    positions filled. A full layer has max_tokens rows, a sliding one min(max_tokens, ring)
    (position p at row p mod ring: below the ring that is p). A forward pass appends each
    layer's new keys at `length`, then advances `length` once, so all layers always hold the
    same positions."""

    def __init__(
        self,
        spec: ModelSpec,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        self.max_tokens = max_tokens
        self.length = 0
        self.kept = 0  # the first position whose rows the sliding layers' rings surely still hold
        self.ring = ring_rows(spec)
        self.window = spec.sliding_window
        self.sliding = frozenset(sliding_layers(spec))
        (kh, kw), (vh, vw) = kv_rows(spec)
        rows = {i: min(max_tokens, self.ring) if i in self.sliding else max_tokens for i in attention_layers(spec)}
        self.k = {i: torch.empty((n, kh, kw), dtype=dtype, device=device) for i, n in rows.items()}
        self.v = {i: torch.empty((n, vh, vw), dtype=dtype, device=device) for i, n in rows.items()}
        # layer -> {name: tensor}: per-sequence recurrent state of non-softmax layers
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store k, v [T, kv_heads, head_dim] at positions length..length+T; returns the keys and
        values the new queries attend over and the first query's index among them: positions
        0..length+T in a full layer (views, not copies; the index is `length`), in a sliding
        one those from length - (window - 1) on (a copy in position order, its ring's older rows
        then k, v: window - 1 + T rows at most)."""
        end = self.room(k.shape[0])
        if layer not in self.sliding:
            self.k[layer][self.length : end] = k
            self.v[layer][self.length : end] = v
            return self.k[layer][:end], self.v[layer][:end], self.length
        first = self.window_start(self.length)
        keys, values = (self._ordered(ring, first, self.length, new) for ring, new in ((self.k[layer], k), (self.v[layer], v)))
        for ring, new in ((self.k[layer], k), (self.v[layer], v)):
            last = min(new.shape[0], self.ring)  # a piece longer than the ring leaves its last rows
            self._put(ring, end - last, new[new.shape[0] - last :])
        return keys, values, self.length - first

    def window_start(self, position: int) -> int:
        """The first key position a query at `position` of a sliding layer sees."""
        return max(0, position - (self.window - 1))

    def _spans(self, a: int, b: int) -> list[tuple[int, int]]:
        """The ring rows of positions a..b (at most `ring` of them), in position order."""
        start, n = a % self.ring, b - a
        if start + n <= self.ring:
            return [(start, start + n)]
        return [(start, self.ring), (0, n - (self.ring - start))]

    def _ordered(self, ring: torch.Tensor, first: int, end: int, new: torch.Tensor) -> torch.Tensor:
        """Ring rows of positions first..end, then `new`, as one tensor."""
        old = end - first
        out = torch.empty((old + new.shape[0], *ring.shape[1:]), dtype=ring.dtype, device=ring.device)
        at = 0
        for a, b in self._spans(first, end) if old else ():
            out[at : at + b - a] = ring[a:b]
            at += b - a
        out[old:] = new
        return out

    def _put(self, ring: torch.Tensor, first: int, rows: torch.Tensor) -> None:
        """`rows` into the ring at positions first..first + len(rows) (at most `ring`)."""
        at = 0
        for a, b in self._spans(first, first + rows.shape[0]):
            ring[a:b] = rows[at : at + b - a]
            at += b - a

    def room(self, n: int) -> int:
        """The end position of n more tokens; a ValueError when the cache cannot hold them."""
        end = self.length + n
        if end > self.max_tokens:
            raise ValueError(f"KV cache full: {end} positions needed, {self.max_tokens} allocated")
        return end

    def advance(self, n: int) -> None:
        """n more positions filled (every path writes them, the last `ring` in the rings)."""
        self.length += n
        if self.sliding:  # one more: a dropped pipelined graph step writes the next row
            self.kept = max(self.kept, self.length + 1 - self.ring)

    def truncate(self, n: int) -> None:
        """Keep the first n positions (a reused prefix); later appends overwrite the rest.
        With recurrent states only n == 0 (start over) or n == length is possible, and with
        sliding layers only an n whose window the rings still hold; restore a `snapshot()` to
        resume an earlier prefix."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a {self.length}-position cache to {n}")
        if n and not self.holds(n):
            raise ValueError(f"cannot truncate to {n} of {self.length} positions: the sliding layers' rings no "
                             "longer hold its window; restore a snapshot taken at that length")
        if self.states and n != self.length:
            if n != 0:
                raise ValueError(
                    f"cannot truncate to {n} of {self.length} positions: recurrent (linear-attention) "
                    "state cannot be rewound; restore a snapshot taken at that length"
                )
            self.states.clear()
        if n == 0:
            self.kept = 0
        self.length = n

    def holds(self, n: int) -> bool:
        """Whether the sliding layers' rings still hold the window a query at position n <= length
        reads besides its own key (a ring keeps the last positions written, fewer after a
        `restore`)."""
        return not self.sliding or self.window_start(n) >= self.kept

    def snapshot(self, at: int | None = None) -> CacheSnapshot:
        """The state needed to resume from the current length: a copy of the recurrent states
        and of the sliding layers' windows (`windows`); the full layers' K/V rows are not copied
        (they stay valid while no truncate goes below this length). `at`: an earlier length,
        where there is no recurrent state (it is now's) and the rings still hold its windows."""
        at = self.length if at is None else at
        if at != self.length and (self.states or not 0 <= at <= self.length or not self.holds(at)):
            raise ValueError(f"no snapshot at {at} of a {self.length}-position cache: its state is gone")
        return CacheSnapshot(at, {i: {k: t.clone() for k, t in s.items()} for i, s in self.states.items()},
                             {i: self.windows(i, at) for i in self.sliding})

    def windows(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a sliding layer's K and V rows a query at `end` needs besides its own
        (positions end - (window - 1)..end, in order, as the ring holds them once keys up to
        `end` are in): what resuming at `end` restores."""
        first = self.window_start(end)
        return tuple(self._ordered(ring, first, end, ring[:0]) for ring in (self.k[layer], self.v[layer]))

    def restore(self, snap: CacheSnapshot) -> None:
        """Go back (or forward) to `snap`: its length, a copy of its states, its windows into the
        rings; the snapshot stays reusable."""
        if snap.length > self.max_tokens:
            raise ValueError(f"snapshot of {snap.length} positions does not fit a {self.max_tokens}-position cache")
        self.length = snap.length
        self.states = {i: {k: t.clone() for k, t in s.items()} for i, s in snap.states.items()}
        if self.sliding:  # the rings hold the snapshot's windows, nothing before them
            self.kept = self.window_start(snap.length)
        for i, (k, v) in snap.windows.items():
            self._put(self.k[i], self.kept, k)
            self._put(self.v[i], self.kept, v)


@dataclass
class CacheSnapshot:
    length: int
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    # sliding layer -> its K and V rows of positions length - (window - 1)..length, in order
    windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return (sum(t.numel() * t.element_size() for s in self.states.values() for t in s.values())
                + sum(t.numel() * t.element_size() for kv in self.windows.values() for t in kv))
