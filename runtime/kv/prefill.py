"""Prefill in the canonical segments (see boundaries), snapshotting recurrent state at chosen cuts."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch

from ..models.decoder import MoEDecoder
from ..models.kv import CacheSnapshot, KVCache


def prefill(decoder: MoEDecoder, tokens: list[int], kv: KVCache, cuts: Iterable[int],
            snapshot_at: Collection[int] = (), max_chunk: int | None = None,
            ) -> tuple[torch.Tensor, dict[int, CacheSnapshot]]:
    """Run tokens[kv.length:] through `decoder` one segment per cut; returns the last position's
    logits and {cut: snapshot} for the cuts in `snapshot_at` that were reached.

    `max_chunk` (GPU): one forward, layer by layer in pieces of at most `max_chunk` tokens that
    also end at the snapshot cuts (`MoEDecoder.forward`'s `chunk` and `snapshot_at`), so a
    streamed expert layer crosses PCIe once per prompt; results then agree with a from-scratch
    run to rounding, not bitwise, which is the GPU's contract anyway."""
    start, n = kv.length, len(tokens)
    device = decoder.w["embed.weight"].device
    if max_chunk is not None:
        inside = [p for p in snapshot_at if start < p < n]
        logits = decoder.forward(torch.tensor(tokens[start:], device=device), kv, last_only=True,
                                 chunk=max_chunk, snapshot_at=inside)
        snaps = dict(decoder.snapshots) if inside else {}
        if n in snapshot_at:
            snaps[n] = kv.snapshot()
        return logits[-1], snaps
    snaps: dict[int, CacheSnapshot] = {}
    logits = None
    for end in [*sorted(p for p in cuts if start < p < n), n]:
        logits = decoder.forward(torch.tensor(tokens[kv.length:end], device=device), kv, last_only=True)
        if end in snapshot_at:
            snaps[end] = kv.snapshot()
    return logits[-1], snaps
