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

    def forward_many(self, inputs: list[torch.Tensor], caches: list[KVCache], last_only: bool = False,
                     chunk: int | None = None, cuts: list[Collection[int]] | None = None) -> list[torch.Tensor]: ...


# One prompt to prefill: its tokens, its cache (holding what was resumed), its cuts and the cuts
# to snapshot at.
Prompt = tuple[list[int], KVCache, Iterable[int], Collection[int]]


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


def prefill_many(model: Forward, prompts: list[Prompt], max_chunk: int | None = None,
                 ) -> list[tuple[torch.Tensor, dict[int, CacheSnapshot]]]:
    """`prefill` of several prompts in one forward (`forward_many`): each layer's routed experts
    run, and stream, once for all of them, where one prefill each would read every expert once
    per prompt (a prompt of a few thousand tokens touches most of them). Each result is its own
    prefill's (bitwise on the CPU). No prompt may snapshot inside what it computes (only at its
    end): a forward of several sequences takes no snapshots."""
    if len(prompts) == 1:
        return [prefill(model, *prompts[0], max_chunk)]
    for tokens, kv, _, snap in prompts:
        if any(kv.length < p < len(tokens) for p in snap):
            raise ValueError("a prompt that snapshots inside its prefill runs alone")
    logits = model.forward_many([torch.tensor(t[kv.length:], device=model.device) for t, kv, _, _ in prompts],
                                [kv for _, kv, _, _ in prompts], last_only=True,
                                chunk=max_chunk or CPU_EXPERT_BATCH,
                                cuts=None if max_chunk else [list(c) for _, _, c, _ in prompts])
    return [(out[-1], {len(t): kv.snapshot()} if len(t) in snap else {})
            for (t, kv, _, snap), out in zip(prompts, logits, strict=True)]
