"""The engine's step: which path runs a forward, decided here and nowhere else.

One token of a sequence the graphs can hold replays the captured decode step, and a batch of
sequences' next tokens the captured batched step where it applies (`GraphDecode.batched`); a few
tokens (an agent's turn after a prefix hit, a batch the captured step does not take) run the
graphs' eager few-token path with the experts planned on the device; everything else, and
everything without CUDA graphs, is the decoder's own forward. The model knows nothing of graphs.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch

from ..models.decoder import MoEDecoder
from ..models.kv import CacheSnapshot, KVCache
from .graphs import GraphDecode
from .sampling import Sampler


class Step:
    def __init__(self, decoder: MoEDecoder, graphs: GraphDecode | None = None):
        self.decoder, self.graphs, self.device = decoder, graphs, decoder.device

    def forward(self, input_ids: torch.Tensor, cache: KVCache, last_only: bool = False,
                chunk: int | None = None, snapshot_at: Collection[int] = (),
                cuts: Collection[int] = ()) -> torch.Tensor:
        """Logits for input_ids at cache.length.. (MoEDecoder.forward's contract)."""
        g, t, start = self.graphs, input_ids.shape[0], cache.length
        if g is not None and t == 1 and g.accepts(cache):
            return g.step(input_ids, cache)
        inside = any(start < p < start + t for p in (*snapshot_at, *cuts))
        if g is not None and g.takes(t) and not inside:
            return g.extend(input_ids, cache, last_only)
        return self.decoder.forward(input_ids, cache, last_only=last_only, chunk=chunk, snapshot_at=snapshot_at, cuts=cuts)

    def forward_many(self, inputs: list[torch.Tensor], caches: list[KVCache], last_only: bool = False,
                     chunk: int | None = None, cuts: list[Collection[int]] | None = None) -> list[torch.Tensor]:
        """Several prompts in one forward, each layer's experts once for all of them
        (MoEDecoder.forward_many); one prompt takes `forward`."""
        if len(inputs) == 1:
            return [self.forward(inputs[0], caches[0], last_only, chunk, cuts=cuts[0] if cuts else ())]
        return self.decoder.forward_many(inputs, caches, last_only=last_only, chunk=chunk, cuts=cuts)

    def joins(self, tokens: int) -> bool:
        """Whether a prompt of `tokens` new tokens may share a forward with others': one the
        decoder's forward would run anyway (not a graph step or a graph extend, which are
        cheaper alone than an eager forward together)."""
        return tokens > 1 and not (self.graphs is not None and self.graphs.takes(tokens))

    @property
    def snapshots(self) -> dict[int, CacheSnapshot]:
        """The last forward's `snapshot_at` snapshots (only the decoder's forward takes any)."""
        return self.decoder.snapshots

    def batch(self, input_ids: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """Logits [B, V] for one new token of each of B sequences. On a GPU the graphs' batched
        step, the experts planned on the device: no host round trip a layer (the host-planned
        batch took 309 ms a 4-token step, the device-planned one run eagerly 27); captured per
        batch size where `GraphDecode.batched`. One sequence takes `forward` (its graph step)."""
        if len(caches) == 1:
            return self.forward(input_ids, caches[0])
        if self.graphs is not None and self.graphs.takes(len(caches)):
            return self.graphs.batch(input_ids, caches)
        return self.decoder.forward_batch(input_ids, caches)

    def pipelines_batch(self, caches: list[KVCache]) -> bool:
        """Whether `pipeline_batch` can decode these sequences (a captured batched step)."""
        return self.graphs is not None and len(caches) > 1 and self.graphs.batched(caches)

    def pipeline_batch(self, firsts: list[int], caches: list[KVCache], limit: int,
                       samplers: list[Sampler | None], feed: torch.Tensor | None = None) -> Iterator[list[int]]:
        """GraphDecode.pipeline_batch: B sequences' tokens, a step always queued on the GPU."""
        assert self.graphs is not None, "pipeline_batch needs CUDA graphs (check `pipelines_batch` first)"
        return self.graphs.pipeline_batch(firsts, caches, limit, samplers, feed)

    def pipelines(self, cache: KVCache) -> bool:
        """Whether `pipeline` can decode this sequence (through CUDA graphs)."""
        return self.graphs is not None and self.graphs.accepts(cache)

    def pipeline(self, first: int, cache: KVCache, limit: int, sampler: Sampler | None = None,
                 feed: torch.Tensor | None = None) -> Iterator[int]:
        """GraphDecode.pipeline: tokens decoded with the next step always queued on the GPU."""
        assert self.graphs is not None, "pipeline needs CUDA graphs (check `pipelines` first)"
        return self.graphs.pipeline(first, cache, limit, sampler, feed)
