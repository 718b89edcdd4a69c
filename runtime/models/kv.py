"""One sequence's key/value cache: preallocated per attention layer, filled front to back."""

from __future__ import annotations

import torch

from ..spec import FULL_ATTENTION, SLIDING_ATTENTION, ModelSpec


class KVCache:
    """k/v [max_tokens, num_kv_heads, head_dim] per softmax-attention layer, and the number of
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
        shape = (max_tokens, spec.num_kv_heads, spec.head_dim)
        layers = [i for i, kind in enumerate(spec.layer_kinds) if kind in (FULL_ATTENTION, SLIDING_ATTENTION)]
        self.k = {i: torch.empty(shape, dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.empty(shape, dtype=dtype, device=device) for i in layers}

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [T, kv_heads, head_dim] at positions length..length+T; returns the
        layer's keys and values for positions 0..length+T (views, not copies)."""
        end = self.length + k.shape[0]
        if end > self.max_tokens:
            raise ValueError(f"KV cache full: {end} positions needed, {self.max_tokens} allocated")
        self.k[layer][self.length : end] = k
        self.v[layer][self.length : end] = v
        return self.k[layer][:end], self.v[layer][:end]

    def advance(self, n: int) -> None:
        self.length += n

    def truncate(self, n: int) -> None:
        """Keep the first n positions (a reused prefix); later appends overwrite the rest."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a {self.length}-position cache to {n}")
        self.length = n
