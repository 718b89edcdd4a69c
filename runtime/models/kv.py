"""One sequence's key/value cache: preallocated per attention layer, filled front to back.

Layers with a recurrent state instead (linear attention) keep it in `states`: layer -> named
tensors, created by the decoder on first use. A recurrent state cannot be rewound, so resuming
a prefix goes through `snapshot()` / `restore()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..spec import ModelSpec
from .kv_size import attention_layers, kv_rows


class KVCache:
    """k/v [max_tokens, heads, width] per softmax-attention layer (`kv_rows`: num_kv_heads x
    head_dim, or latent attention's one latent row and an empty V), and the number of
    positions filled. A forward pass appends each layer's new keys at `length`, then advances
    `length` once, so all layers always hold the same positions."""

    def __init__(
        self,
        spec: ModelSpec,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        self.max_tokens = max_tokens
        self.length = 0
        (kh, kw), (vh, vw) = kv_rows(spec)
        layers = attention_layers(spec)
        self.k = {i: torch.empty((max_tokens, kh, kw), dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.empty((max_tokens, vh, vw), dtype=dtype, device=device) for i in layers}
        # layer -> {name: tensor}: per-sequence recurrent state of non-softmax layers
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [T, kv_heads, head_dim] at positions length..length+T; returns the
        layer's keys and values for positions 0..length+T (views, not copies)."""
        end = self.room(k.shape[0])
        self.k[layer][self.length : end] = k
        self.v[layer][self.length : end] = v
        return self.k[layer][:end], self.v[layer][:end]

    def room(self, n: int) -> int:
        """The end position of n more tokens; a ValueError when the cache cannot hold them."""
        end = self.length + n
        if end > self.max_tokens:
            raise ValueError(f"KV cache full: {end} positions needed, {self.max_tokens} allocated")
        return end

    def advance(self, n: int) -> None:
        self.length += n

    def truncate(self, n: int) -> None:
        """Keep the first n positions (a reused prefix); later appends overwrite the rest.
        With recurrent states only n == 0 (start over) or n == length is possible; restore a
        `snapshot()` to resume an earlier prefix."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a {self.length}-position cache to {n}")
        if self.states and n != self.length:
            if n != 0:
                raise ValueError(
                    f"cannot truncate to {n} of {self.length} positions: recurrent (linear-attention) "
                    "state cannot be rewound; restore a snapshot taken at that length"
                )
            self.states.clear()
        self.length = n

    def snapshot(self) -> CacheSnapshot:
        """The state needed to resume from the current length: a copy of the recurrent states
        (K/V rows are not copied; they stay valid while no truncate goes below this length)."""
        return CacheSnapshot(self.length, {i: {k: t.clone() for k, t in s.items()} for i, s in self.states.items()})

    def restore(self, snap: CacheSnapshot) -> None:
        """Go back (or forward) to `snap`: its length and a copy of its states; the snapshot stays
        reusable."""
        if snap.length > self.max_tokens:
            raise ValueError(f"snapshot of {snap.length} positions does not fit a {self.max_tokens}-position cache")
        self.length = snap.length
        self.states = {i: {k: t.clone() for k, t in s.items()} for i, s in snap.states.items()}


@dataclass
class CacheSnapshot:
    length: int
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.states.values() for t in s.values())
