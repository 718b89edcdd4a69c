"""Prefill in the canonical segments (see boundaries), snapshotting recurrent state at chosen cuts."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Protocol

import torch

from ..models.kv import CacheSnapshot, KVCache

# CPU prefill: the tokens whose routed experts run as one batch (each expert read once for them
# rather than once per 16-token page); a GPU batches its --prefill-chunk pieces instead
CPU_EXPERT_BATCH = 2048


class Forward(Protocol):
    """What runs a prompt: the engine's step (engine/step.py) or a decoder itself."""

    device: torch.device
    snapshots: dict[int, CacheSnapshot]  # the last forward's `snapshot_at` snapshots

    def forward(self, input_ids: torch.Tensor, cache: KVCache, last_only: bool = False, chunk: int | None = None,
                snapshot_at: Collection[int] = (), cuts: Collection[int] = ()) -> torch.Tensor: ...


def prefill(model: Forward, tokens: list[int], kv: KVCache, cuts: Iterable[int],
            snapshot_at: Collection[int] = (), max_chunk: int | None = None,
            ) -> tuple[torch.Tensor, dict[int, CacheSnapshot]]:
    """Run tokens[kv.length:] through `model` as one forward, layer by layer; returns the last
    position's logits and {cut: snapshot} for the cuts in `snapshot_at` that were reached.

    Without `max_chunk` (CPU) the pieces end at every cut, and only the routed experts run for
    up to CPU_EXPERT_BATCH tokens at once, so the result is bitwise that of one forward per cut
    (`MoEDecoder.forward`'s `cuts`): prefix reuse stays exact. `max_chunk` (GPU): the pieces are
    of at most `max_chunk` tokens and end only at the snapshot cuts, so a streamed expert layer
    crosses PCIe once per prompt; results then agree with a from-scratch run to rounding, not
    bitwise, which is the GPU's contract anyway."""
    start, n = kv.length, len(tokens)
    inside = [p for p in snapshot_at if start < p < n]
    logits = model.forward(torch.tensor(tokens[start:], device=model.device), kv, last_only=True,
                           chunk=max_chunk or CPU_EXPERT_BATCH, snapshot_at=inside, cuts=() if max_chunk else cuts)
    snaps = dict(model.snapshots) if inside else {}
    if n in snapshot_at:
        snaps[n] = kv.snapshot()
    return logits[-1], snaps
