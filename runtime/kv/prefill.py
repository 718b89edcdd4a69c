"""Prefill in the canonical segments (see boundaries), snapshotting recurrent state at chosen cuts."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch

from ..models.decoder import MoEDecoder
from ..models.kv import CacheSnapshot, KVCache

# CPU prefill: the tokens whose routed experts run as one batch (each expert read once for them
# rather than once per 16-token page); a GPU batches its --prefill-chunk pieces instead
CPU_EXPERT_BATCH = 2048


def prefill(decoder: MoEDecoder, tokens: list[int], kv: KVCache, cuts: Iterable[int],
            snapshot_at: Collection[int] = (), max_chunk: int | None = None,
            ) -> tuple[torch.Tensor, dict[int, CacheSnapshot]]:
    """Run tokens[kv.length:] through `decoder` as one forward, layer by layer; returns the last
    position's logits and {cut: snapshot} for the cuts in `snapshot_at` that were reached.

    Without `max_chunk` (CPU) the pieces end at every cut, and only the routed experts run for
    up to CPU_EXPERT_BATCH tokens at once, so the result is bitwise that of one forward per cut
    (`MoEDecoder.forward`'s `cuts`): prefix reuse stays exact. `max_chunk` (GPU): the pieces are
    of at most `max_chunk` tokens and end only at the snapshot cuts, so a streamed expert layer
    crosses PCIe once per prompt; results then agree with a from-scratch run to rounding, not
    bitwise, which is the GPU's contract anyway."""
    start, n = kv.length, len(tokens)
    inside = [p for p in snapshot_at if start < p < n]
    logits = decoder.forward(torch.tensor(tokens[start:], device=decoder.w["embed.weight"].device), kv,
                             last_only=True, chunk=max_chunk or CPU_EXPERT_BATCH, snapshot_at=inside,
                             cuts=() if max_chunk else cuts)
    snaps = dict(decoder.snapshots) if inside else {}
    if n in snapshot_at:
        snaps[n] = kv.snapshot()
    return logits[-1], snaps
