"""Decode steps captured in CUDA graphs and replayed with one launch: one sequence's, and a
batch of concurrent sequences' next tokens.

An eager decode step launches some 70 kernels per layer from Python and reads every layer's
routing back to the host; at a few hundred microseconds of expert traffic per layer the host
becomes the bottleneck. Here a step has fixed shapes and no host decision:
- the token and its position live in device tensors; rotary tables are gathered by position;
- K/V go into static per-layer buffers (a sequence's KVCache is re-pointed at them while it is
  bound; a sliding-window layer's is a ring as the cache's, key position p at row p mod its
  size, which the kernels address in place), and attention covers a fixed span with a position
  mask, so one graph per span bucket
  (256, 512, ... tokens) serves every position below it; where the family's Q/K treatment allows
  (per-head or no Q/K norm, no clipping), Q, K and V come from one projection (the three
  weights concatenated once, the decoder's entries left as views of it), norms, RoPE and the
  cache writes are one Triton launch per layer (kernels/triton/decode.py), and attention two
  (its keys split in chunks across the GPU, kernels/triton/attention.py), instead of about
  twenty;
- a family with its own token mixer (Qwen3-Next: gated DeltaNet and gated attention layers)
  runs it as its decoder writes it, keys and values going to the static buffers through the
  mixer's `kv` hook; recurrent states live in static buffers too, bound like K/V and changed in
  place;
- each residual add and the RMSNorm after it are one Triton launch (kernels/triton/norm.py), so
  a piece hands the next one the residual stream and its normed value;
- the routed experts go through the store's DevicePlanner (hits, fills and the CPU set decided on
  the GPU, the CPU branch started by a doorbell, not by Python);
- a step is a few graphs of two layers each, replayed back to back, so the GPU need not wait
  for the host to launch the whole step;
- B concurrent sequences' next tokens (`batch`, B up to `max_batch`) are one step too, captured
  once per B where the fused kernels apply: each token's position and the addresses of its
  sequence's K/V caches are device inputs the batch forms of those kernels read, so a sequence's
  rows stay in its own cache (nothing is copied as sequences join and leave batches); the dense
  products run over the B rows and the experts through the device planner over the B tokens, as
  an extend's, so the batch shares each layer's expert reads.
A short extend (2..64 tokens after a prefix hit, `extend`) runs eagerly, its experts planned on
the device where they fit, through the same fused dense part with the few-query attention kernel
in place of the one-query one (a family with its own token mixer: that mixer over the cache). Without CUDA (`capture=False`) the same step runs eagerly: tests check it on
CPU.
"""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import torch

from ftkit.kernels.triton import optional

from ..experts.store import ExpertStore
from ..models import FAMILIES
from ..models.block_table import embed_rows
from ..models.decoder import Experts, Mixer, MoEDecoder
from ..models.kv import KVCache
from ..models.kv_size import attention_layers, ring_extend, ring_rows, sliding_layers
from ..models.layers import decode_attention, linear
from ..spec import QK_NORM_HEAD, QK_NORM_NONE
from .sampling import Sampler

T = TypeVar("T")

if TYPE_CHECKING:
    from ..experts.device_planner import DevicePlanner

FIRST_SPAN = 256  # attention span of the smallest graph; each next one doubles it
# A step is captured as several graphs of this many layers: launching a graph costs host time
# in proportion to its nodes (~0.5 ms for a whole 12-layer step), and the GPU starts on the
# first piece while the host launches the next.
LAYERS_PER_GRAPH = 2
# Sequences of the largest captured batched step: each batch size up to it is a set of graphs of
# its own (captured on first use or by the warm-up); a larger batch runs eagerly.
MAX_BATCH = 8


def unsupported(decoder: MoEDecoder, store: ExpertStore) -> str | None:
    """Why this model cannot decode through graphs here, or None."""
    if (family := FAMILIES.get(decoder.spec.family)) and (reason := family.graphs_unsupported(decoder.spec)):
        return reason
    if decoder.rope.dynamic:
        return "dynamic NTK rope changes with the sequence length"
    if store.stats.trace:
        return "per-step expert statistics need the host planner"
    return store.device_planner_unsupported()


def _fused_attention(decoder: MoEDecoder):
    """The Triton decode-attention kernels where this family's attention is what they do
    (MoEDecoder's, per-head RMSNorm or none, no clipping; gpt-oss's sink attention too, whose
    sinks the kernels add: `GraphDecode._sinks`), else None (the decoder's own token mixer runs,
    its keys and values going to the static buffers)."""
    s, cls = decoder.spec, type(decoder)
    if cls.mixer is not MoEDecoder.mixer or cls.attention is not MoEDecoder.attention or decoder.norm_offset:
        return None
    if s.qk_norm not in (QK_NORM_HEAD, QK_NORM_NONE) or s.extra.get("clip_qkv"):
        return None
    return optional("decode")


def _concat_qkv(w: dict[str, torch.Tensor], i: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Layer i's Q, K and V projections as one weight [q+k+v, H] (and bias), or None where they
    do not all live on `device`. The entries of `w` become row views of the new tensors, so the
    old ones are freed and the eager path reads the same values."""
    p = f"layers.{i}.attn."
    groups = [[p + n + ".weight" for n in "qkv"]]
    if p + "q.bias" in w:
        groups.append([p + n + ".bias" for n in "qkv"])
    if any(w[n].device != device for g in groups for n in g):
        return None
    fused = []
    for g in groups:
        fused.append(torch.cat([w[n] for n in g]))
        w.update(zip(g, fused[-1].split([w[n].shape[0] for n in g]), strict=True))
    return fused[0], fused[1] if len(fused) > 1 else None


def _two_in_flight(launch: Callable[[int], None], limit: int, done: list[torch.cuda.Event],
                   caches: list[KVCache], read: Callable[[int], T], drop: Callable[[int], None]) -> Iterator[T]:
    """Steps 0..limit-1 with the next always queued: `launch(i + 1)` goes before step i's `done`
    event (none on a CPU) is waited for, then the caches advance and `read(i)` is yielded. Stopped
    early, the step in flight is waited for (nothing may touch the caches or the slots under a
    running step) and `drop`ped."""
    launch(0)
    in_flight, i = False, 0
    try:
        for i in range(limit):
            in_flight = i + 1 < limit
            if in_flight:
                launch(i + 1)
            if done:
                done[i % 2].synchronize()
            for c in caches:
                c.advance(1)
            yield read(i)
        in_flight = False
    finally:
        if in_flight:
            if done:
                done[(i + 1) % 2].synchronize()
            drop(i + 1)


class _Batch:
    """A batched step's device inputs for B sequences: their tokens, and in one int64 buffer (one
    copy a step) their positions and, per attention layer, the addresses of each one's K and V
    caches, which the captured kernels read at every replay. Static K/V slots per batch place
    instead would hold B more sequences at the graph capacity (B times the graph K/V the memory
    plan reserves) and copy a sequence's rows in whenever it joined a batch."""

    def __init__(self, size: int, layers: list[int], device: torch.device):
        with torch.inference_mode(False):  # normal tensors: steps inside inference mode and out write them
            self.token = torch.zeros(size, dtype=torch.int64, device=device)
            self.io = torch.zeros(size * (1 + 2 * len(layers)), dtype=torch.int64, device=device)
        self.size = size
        self.pos = self.io[:size]
        table = self.io[size:].view(len(layers), 2, size)
        self.caches = {i: table[j] for j, i in enumerate(layers)}  # layer -> [2, B]: K, then V addresses


class GraphDecode:
    def __init__(self, decoder: MoEDecoder, store: ExpertStore, capacity: int, capture: bool = True,
                 max_batch: int = MAX_BATCH):
        """`capacity`: tokens of static K/V (sequences longer than this decode eagerly);
        `max_batch`: the most sequences a captured batched step takes."""
        s, dev = decoder.spec, store.device
        self.decoder, self.store, self.capacity, self.capture = decoder, store, capacity, capture
        self.max_batch = max_batch
        dtype = decoder.lm_head.dtype
        layers = attention_layers(s)
        # a sliding layer's rows are a ring as its sequences' caches keep it (models/kv.py)
        self.ring, self.sliding = ring_rows(s), frozenset(sliding_layers(s))
        rows = {i: min(capacity, self.ring) if i in self.sliding else capacity for i in layers}
        self.k = {i: torch.zeros((n, s.num_kv_heads, s.head_dim), dtype=dtype, device=dev) for i, n in rows.items()}
        self.v = {i: torch.zeros((n, s.num_kv_heads, s.head_dim), dtype=dtype, device=dev) for i, n in rows.items()}
        # Recurrent (linear-attention) layers' states: static buffers shaped as the first bound
        # sequence's, carved from one flat buffer so one copy saves (or restores) them all.
        self.recurrent = sorted(set(range(s.num_layers)) - set(layers))
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.flat: torch.Tensor | None = None
        self.flat_saved: torch.Tensor | None = None
        self.cos, self.sin = decoder.rope(0, capacity, dtype)
        self.token = torch.zeros(1, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int64, device=dev)
        self.positions = torch.arange(capacity, device=dev)
        # (span, sequences) -> the step's pieces, in order; their logits
        self.graphs: dict[tuple[int, int], list[torch.cuda.CUDAGraph]] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        n = s.num_layers
        self.pieces = [range(i, min(i + LAYERS_PER_GRAPH, n)) for i in range(0, n, LAYERS_PER_GRAPH)]
        self.pool = None  # one memory pool for every step's graphs: they never run at once
        self.bound: weakref.ref[KVCache] | None = None
        self.batches: dict[int, _Batch] = {}  # batch size -> its device inputs
        # each batched sequence's K/V addresses (`_addresses`), until `_bind` re-points its cache
        self.addresses: weakref.WeakKeyDictionary[KVCache, torch.Tensor] = weakref.WeakKeyDictionary()
        self.version = store.version
        self.fused = _fused_attention(decoder)
        # layer -> its concatenated Q/K/V projection (weight, bias), on the fused path
        self.qkv: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        if self.fused:
            here = self.token.device  # with its index, as the weights' devices have it
            self.qkv = {i: qkv for i in layers if (qkv := _concat_qkv(decoder.w, i, here)) is not None}
            self.qkv_split = (s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim)
            if dev.type == "cuda":  # the old tensors' segments back to the driver, not held in reserve
                torch.cuda.empty_cache()
        # Triton is there: `unsupported` checked (and the device planner needs it anyway)
        from ftkit.kernels.triton import attention as few
        from ftkit.kernels.triton.norm import add_rms_norm

        self.few = few
        self.add_norm = decoder.add_norm
        if type(decoder).norm is MoEDecoder.norm and type(decoder).add_norm is MoEDecoder.add_norm:
            s = decoder.spec

            def fused_add_norm(x: torch.Tensor, delta: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
                """The decoder's add_norm in one launch (a family overriding its norm keeps its own)."""
                return add_rms_norm(x, delta, decoder.w[name], s.rms_norm_eps, decoder.norm_offset, decoder.norm_float32)

            self.add_norm = fused_add_norm
        self.said_too_long = False  # the eager fallback for long sequences is announced once

    def accepts(self, cache: KVCache) -> bool:
        if cache.max_tokens > self.capacity and not self.said_too_long:
            print(f"ftkit: sequences longer than {self.capacity} tokens (the graph K/V capacity) decode "
                  "without CUDA graphs (raise --kv-tokens)", file=sys.stderr)
            self.said_too_long = True
        # recurrent states exist once a forward has run (a first token goes the eager way)
        return (cache.max_tokens <= self.capacity and cache.length < cache.max_tokens
                and all(i in cache.states for i in self.recurrent))

    def step(self, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits [1, V] for one token at position cache.length; appends its K/V."""
        span = self._prepare(cache, cache.length + 1)
        self.store.device_planner.adapt()
        self.token.copy_(input_ids.reshape(1))
        self.pos.fill_(cache.length)
        logits = self._launch(span)
        cache.advance(1)
        return logits.clone() if self.capture else logits  # the graph's buffer is reused next step

    def pipeline(self, first: int, cache: KVCache, limit: int, sampler: Sampler | None = None,
                 feed: torch.Tensor | None = None) -> Iterator[int]:
        """Up to `limit` tokens after `first` (the token at position cache.length), with the next
        step always queued on the GPU while the host reads a token: each step's graphs end by
        writing their argmax as the next step's input and advancing the position, so launching a
        step needs nothing from the one before. `sampler` (None: greedy): queued after the graphs,
        it picks the next input from the logits on the device instead of the argmax. Each
        yielded token's step has appended its input's K/V. When the caller stops early, the
        step in flight is waited for and dropped (its expert counts stay in the stats, its
        sampler draw is rewound); running it again writes the same K/V row and draws the same
        token (recurrent states are put back as they were before it). `feed` (benchmarks): the
        inputs after `first` are these device token ids instead of the picks, which are still
        read back."""
        limit = min(limit, cache.max_tokens - cache.length)
        if limit <= 0:
            return
        span = self._prepare(cache, cache.length + limit)
        self.token.fill_(first)
        self.pos.fill_(cache.length)
        cuda = self.token.is_cuda
        out = torch.zeros(2, dtype=torch.int64, pin_memory=cuda)  # the tokens of two steps in turn
        done = [torch.cuda.Event() for _ in range(2)] if cuda else []
        draws = [{}, {}]  # the sampler's generators before each of the two steps

        def launch(i: int) -> None:
            self.store.device_planner.adapt()  # between steps, from the counters of those finished
            if self.flat is not None:  # what to put back should the caller stop before this step
                self.flat_saved.copy_(self.flat)
            logits = self._launch(span)
            if sampler is not None:
                draws[i % 2] = sampler.draws()
                self.token.copy_(sampler.sample(logits))
            out[i % 2].copy_(self.token[0], non_blocking=True)
            if cuda:
                done[i % 2].record()
            if feed is not None and i + 1 < feed.numel():
                self.token.copy_(feed[i + 1 : i + 2])

        def drop(i: int) -> None:
            if self.flat is not None:
                self.flat.copy_(self.flat_saved)
            if sampler is not None:
                sampler.rewind(draws[i % 2])

        yield from _two_in_flight(launch, limit, done, [cache], lambda i: int(out[i % 2]), drop)

    def _prepare(self, cache: KVCache, end: int) -> int:
        """Bind `cache`, hand the residency to the device planner; the attention span that
        covers positions below `end`."""
        self._bind(cache)
        self._plan_on_device()
        if self.fused:  # fused attention reads the position on the device: one graph serves every span
            return self.capacity
        span = FIRST_SPAN
        while span < end:
            span *= 2
        return min(span, self.capacity)

    def _plan_on_device(self) -> DevicePlanner:
        """The device planner, holding the residency; the graphs captured before a rebuild of
        the cache are dropped (its slots moved)."""
        plan = self.store.device_planner_for_graphs()
        if self.store.version != self.version:
            self.graphs.clear()
            self.logits.clear()
            self.version = self.store.version
        plan.to_device()
        return plan

    def _launch(self, span: int, batch: _Batch | None = None) -> torch.Tensor:
        """Run one step at the device's tokens and positions (`batch`: its sequences', else the
        bound one's): replay its graphs (captured on first use) or, without capture, run it
        eagerly. Returns the logits (the graph's own buffer)."""
        if not self.capture:
            return self._forward(span, batch)
        key = (span, batch.size if batch is not None else 1)
        for graph in self.graphs.get(key) or self._capture(key, batch):
            graph.replay()
        return self.logits[key]

    def _forward(self, span: int, batch: _Batch | None = None) -> torch.Tensor:
        state = None
        for layers in self.pieces:
            state = self._piece(state, layers, span, batch)
        return state

    def _piece(self, state: tuple[torch.Tensor, torch.Tensor] | None, layers: range, span: int,
               batch: _Batch | None = None) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """The step's `layers` (`batch`: of its sequences' tokens, else of the bound sequence's).
        `state`: the residual stream and its RMSNorm by the first layer's attn_norm (None: from
        the tokens' embeddings). Returns the same for the next piece, or the logits after the
        model's last layer."""
        dec, s = self.decoder, self.decoder.spec
        token, pos, caches = (self.token, self.pos, None) if batch is None else (batch.token, batch.pos, batch.caches)
        if state is None:
            state = self._embed(token)
        if self.fused:
            def attend(i: int, h: torch.Tensor) -> torch.Tensor:
                # the static K/V buffers, or (a batch) each token's own sequence's caches, which
                # those buffers then only lay out
                rows = None if caches is None else caches[i]
                q = self._rope_store(i, self._qkv(i, h), self.k[i], self.v[i], (self.cos, self.sin, 0), pos, rows)
                return self.few.decode_attention(q, self.k[i], self.v[i], pos, dec.window(i), rows, self._sinks(i),
                                                 self._ring(i))

            mix = self._projected(attend)
        else:  # the decoder's own token mixer (one sequence), its keys and values in the static buffers
            cos, sin = self.cos.index_select(0, self.pos), self.sin.index_select(0, self.pos)
            keys = self.positions[:span]
            visible = keys <= self.pos

            def kv(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                window = dec.window(i)
                if i in self.sliding:  # the ring: each row holds the latest position it can
                    held = self.pos - (self.pos - self.positions[: self.k[i].shape[0]]) % self.ring
                    self.k[i].index_copy_(0, self.pos % self.ring, k)
                    self.v[i].index_copy_(0, self.pos % self.ring, v)
                    return decode_attention(q, self.k[i], self.v[i], (held >= 0) & (held > self.pos - window))
                self.k[i].index_copy_(0, self.pos, k)
                self.v[i].index_copy_(0, self.pos, v)
                mask = visible if window is None else visible & (keys > self.pos - window)
                return decode_attention(q, self.k[i][:span], self.v[i][:span], mask)

            bound = self.bound()  # its recurrent states are the static ones (`_bind`)

            def mix(i: int, h: torch.Tensor) -> torch.Tensor:
                return dec.mixer(i, h, cos, sin, bound, kv)

        x, h = self._layers(state, layers, mix, self.store.device_planner)
        if layers.stop < s.num_layers:
            return x, h
        logits = linear(h, dec.lm_head)
        # the next step's inputs when decoding greedily (`pipeline`, `pipeline_batch`; `step` and
        # `batch` write both before each step)
        token, pos = (self.token, self.pos) if batch is None else (batch.token, batch.pos)
        token.copy_(logits.argmax(-1))
        pos.add_(1)
        return logits

    def takes(self, tokens: int) -> bool:
        """Whether `extend` runs these tokens: a few (the few-query attention kernel's limit, and
        what the sliding layers' rings hold beside a window: `ring_extend`)."""
        return 1 < tokens <= min(self.few.MAX_QUERIES, ring_extend(self.decoder.spec) or self.few.MAX_QUERIES)

    def extend(self, input_ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """Logits for a few tokens at cache.length.. (an agent turn after a prefix hit), eager,
        with the dense part as a graph step has it: one Q/K/V product, norms, RoPE and the cache
        writes in one launch, the few-query attention kernel, each residual add fused with the
        RMSNorm after it (8 kernels a layer instead of ~23). The experts are planned on the
        device (`DevicePlanner.takes`): no layer waits for its routing on the host, which with the
        host planner cost ~0.8 ms a layer, more than the launches (docs/benchmarks.md). A family
        with its own token mixer (Qwen3-Next) runs that as its forward pass does, over the
        cache's rows and recurrent states, with the rest as here."""
        return self._eager(input_ids, [cache], [input_ids.shape[0]], last_only)

    def batch(self, input_ids: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """Logits [B, V] for one new token of each of B sequences (concurrent requests), each
        attending over its own cache at its own position, the experts planned once on the device
        for them all (as an extend's), so the batch shares their reads. Where `batched`: a step
        captured once per batch size and replayed; else as `extend` over the B tokens, eagerly."""
        if not self.batched(caches):
            return self._eager(input_ids, caches, [1] * len(caches))
        batch = self._batch_inputs(caches)
        self._plan_on_device().adapt(extend=True)  # the extends' split: its experts are planned as theirs
        batch.token.copy_(input_ids)
        logits = self._launch(self.capacity, batch)
        for c in caches:
            c.advance(1)
        return logits.clone() if self.capture else logits  # the graph's buffer is reused next step

    def pipeline_batch(self, firsts: list[int], caches: list[KVCache], limit: int,
                       samplers: list[Sampler | None], feed: torch.Tensor | None = None) -> Iterator[list[int]]:
        """`pipeline` for B sequences that `batched` takes: up to `limit` captured batched steps,
        the next always queued on the GPU while the host reads a step's B tokens (each row's
        argmax, or its sampler's pick on the device, is its next input; the positions advance
        on the device), so the GPU does not wait for the host's sampling and replies between
        steps, as it does in `batch`. Stopped early, it waits for the step in flight and drops
        it (its samplers' draws rewound), as `pipeline` does. `feed` (benchmarks, [limit, B]): the
        inputs after `firsts`, as `pipeline`'s."""
        limit = min(limit, *(c.max_tokens - c.length for c in caches))
        if limit <= 0:
            return
        batch = self._batch_inputs(caches)
        batch.token.copy_(torch.tensor(firsts), non_blocking=True)
        cuda, n = batch.token.is_cuda, len(caches)
        out = torch.zeros(2, n, dtype=torch.int64, pin_memory=cuda)  # two steps' tokens in turn
        done = [torch.cuda.Event() for _ in range(2)] if cuda else []
        draws: list[list[dict]] = [[{}] * n, [{}] * n]  # each row's sampler before each of the two steps

        def launch(i: int) -> None:
            self._plan_on_device().adapt(extend=True)
            logits = self._launch(self.capacity, batch)
            for b, sampler in enumerate(samplers):
                if sampler is not None:
                    draws[i % 2][b] = sampler.draws()
                    batch.token[b : b + 1].copy_(sampler.sample(logits[b]))
            out[i % 2].copy_(batch.token, non_blocking=True)
            if cuda:
                done[i % 2].record()
            if feed is not None and i + 1 < len(feed):
                batch.token.copy_(feed[i + 1])

        def drop(i: int) -> None:
            for sampler, draw in zip(samplers, draws[i % 2], strict=True):
                if sampler is not None:
                    sampler.rewind(draw)

        yield from _two_in_flight(launch, limit, done, caches, lambda i: out[i % 2].tolist(), drop)

    def batched(self, caches: list[KVCache]) -> bool:
        """Whether `batch` replays captured graphs for these sequences: 2 to `max_batch` of them;
        attention the fused kernels do (a family's own token mixer, Qwen3-Next's recurrent
        layers among them, or OLMoE's whole-projection Q/K norm keeps the eager batch, whose
        mixers read each cache from the host); each sequence within the rotary tables (no longer
        than the capacity) with room for its token; B tokens' experts the device planner takes
        (offload: when they fit the cache)."""
        n = len(caches)
        return (self.fused is not None and 1 < n <= self.max_batch
                and all(c.max_tokens <= self.capacity and c.length < c.max_tokens for c in caches)
                and self.store.device_planner_for_graphs().takes(n))

    def _batch_inputs(self, caches: list[KVCache]) -> _Batch:
        """The device inputs of a batched step of these sequences, their positions and cache
        addresses written (one copy); the tokens are the caller's to write."""
        n = len(caches)
        batch = self.batches.get(n)
        if batch is None:
            batch = self.batches[n] = _Batch(n, list(self.k), self.token.device)
        table = torch.stack([self._addresses(c) for c in caches], dim=-1)  # [layers, 2, B]
        host = torch.cat((torch.tensor([c.length for c in caches]), table.reshape(-1)))
        batch.io.copy_(host, non_blocking=True)  # from pageable memory: staged before this returns
        return batch

    def _addresses(self, cache: KVCache) -> torch.Tensor:
        """int64 [attention layers, 2]: the addresses of `cache`'s K and V rows per layer, for the
        batch-form kernels (kept until `_bind` re-points the cache). Those kernels write there,
        so every tensor must be laid out as the static buffers: contiguous, same dtype, heads
        and device."""
        found = self.addresses.get(cache)
        if found is None:
            pairs = [(cache.k[i], cache.v[i]) for i in self.k]
            like = next(iter(self.k.values()))
            if any(t.dtype != like.dtype or t.device != like.device or t.shape[1:] != like.shape[1:]
                   or not t.is_contiguous() for pair in pairs for t in pair):
                raise ValueError("a batched graph step writes K/V rows in place: every cache must be contiguous, "
                                 f"{like.dtype} [positions, {like.shape[1]}, {like.shape[2]}] on {like.device}")
            found = self.addresses[cache] = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in pairs])
        return found

    def _eager(self, input_ids: torch.Tensor, caches: list[KVCache], counts: list[int],
               last_only: bool = False) -> torch.Tensor:
        """`extend` and `batch`: input_ids holds counts[b] tokens for each caches[b] in turn."""
        dec, t = self.decoder, input_ids.shape[0]
        plan = self.store.device_planner_for_graphs()
        on_device = plan.takes(t)
        if on_device:
            plan.to_device()
            plan.adapt(extend=True)  # from the extends before this one
        starts = [c.length for c in caches]
        ends = [c.room(n) for c, n in zip(caches, counts, strict=True)]
        rows = [0]
        for n in counts:
            rows.append(rows[-1] + n)
        segments = list(zip(caches, starts, ends, rows[:-1], rows[1:], strict=True))
        if self.fused:
            if len(caches) == 1:
                self.pos.fill_(starts[0])
                pos = [self.pos]
            else:
                where = torch.tensor(starts, dtype=torch.int64).to(self.pos.device, non_blocking=True)
                pos = [where[b : b + 1] for b in range(len(caches))]
            # rotary tables: the static ones, or this run's beyond them (sequences past the capacity)
            tables = [(self.cos, self.sin, 0) if end <= self.capacity else (*dec.rope(start, end - start, self.cos.dtype), start)
                      for _, start, end, _, _ in segments]

            def attend(i: int, h: torch.Tensor) -> torch.Tensor:
                q, k, v = self._qkv(i, h)
                out = []
                for b, (c, start, end, a, z) in enumerate(segments):
                    ring = self._ring(i)
                    qb = self._rope_store(i, (q[a:z], k[a:z], v[a:z]), c.k[i], c.v[i], tables[b], pos[b])
                    keys, values = (c.k[i], c.v[i]) if ring else (c.k[i][:end], c.v[i][:end])
                    out.append(self.few.few_query_attention(qb, keys, values, start, dec.window(i), self._sinks(i), ring))
                return out[0] if len(out) == 1 else torch.cat(out)

            mix = self._projected(attend)
        else:
            ropes = [dec.rope(start, end - start, self.cos.dtype) for _, start, end, _, _ in segments]

            def mix(i: int, h: torch.Tensor) -> torch.Tensor:
                out = [dec.mixer(i, h[a:z], *ropes[b], c) for b, (c, _, _, a, z) in enumerate(segments)]
                return out[0] if len(out) == 1 else torch.cat(out)

        _, h = self._layers(self._embed(input_ids), range(dec.spec.num_layers), mix, plan if on_device else None)
        for c, n in zip(caches, counts, strict=True):
            c.advance(n)
        return linear(h[-1:] if last_only else h, dec.lm_head)

    def _embed(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = embed_rows(ids, self.decoder.w["embed.weight"])
        return x, self.decoder.norm(x, "layers.0.attn_norm.weight")

    def _projected(self, attend):
        """The token mixer from `attend(i, h)`, layer i's attention output [T, heads, D]: that
        through the output projection."""
        def mix(i: int, h: torch.Tensor) -> torch.Tensor:
            return self.decoder.linear(f"layers.{i}.attn.o", attend(i, h).reshape(h.shape[0], -1))
        return mix

    def _layers(self, state: tuple[torch.Tensor, torch.Tensor], layers: range, mix: Mixer,
                experts: Experts | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `layers` (the decoder's own layer body) on (residual stream, its attn_norm), each
        residual add fused with the norm after it; `experts`: the device planner, or None for
        the store's host planner."""
        x, h = state
        for i in layers:
            x, h = self.decoder.layer(i, x, h, mix, self.add_norm, experts)
        return x, h

    def _rope_store(self, i: int, qkv: tuple[torch.Tensor, ...], k_cache: torch.Tensor, v_cache: torch.Tensor,
                    table: tuple[torch.Tensor, torch.Tensor, int], pos: torch.Tensor,
                    caches: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's rotated queries [T, heads, D] from its projections (`_qkv`) at positions
        pos.. (`pos`: the first, on the device); its keys and values written into the cache rows
        there (a sliding layer's: its ring's). `table`: (cos, sin, the first row's position).
        `caches`: a batch's (rope_store's batch form: each token at its own position pos[t], into
        its own sequence's caches)."""
        p, s = f"layers.{i}.attn.", self.decoder.spec
        w = self.decoder.w
        return self.fused.rope_store(*qkv, w.get(p + "q_norm.weight"), w.get(p + "k_norm.weight"), s.rms_norm_eps,
                                     *table[:2], pos, k_cache, v_cache, table[2], caches, self._ring(i))

    def _ring(self, i: int) -> int:
        """Layer i's ring size where it is a sliding one (key position p at row p mod it), else 0."""
        return self.ring if i in self.sliding else 0

    def _sinks(self, i: int) -> torch.Tensor | None:
        """Layer i's attention sinks [heads] (gpt-oss: a logit per head in the softmax), or None."""
        return self.decoder.w.get(f"layers.{i}.attn.sinks")

    def _qkv(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Layer i's Q, K and V projections of h [T, H]: one product where the weights were
        concatenated (rope_store reads the column views in place); one token's through the
        Triton GEMV, which beat cuBLAS there (kernels/triton/gemv.py)."""
        if i in self.qkv:
            return linear(h, *self.qkv[i]).split(self.qkv_split, dim=-1)
        return tuple(self.decoder.linear(f"layers.{i}.attn.{n}", h) for n in "qkv")

    def _capture(self, key: tuple[int, int], batch: _Batch | None) -> list[torch.cuda.CUDAGraph]:
        """Capture the step of `key` (span, sequences) as `_launch` replays it."""
        span = key[0]
        plan = self.store.device_planner_for_graphs()
        inputs = (self.token, self.pos) if batch is None else (batch.token, batch.io)  # the step writes the next
        kept = [t for t in (plan.counts, *inputs, self.flat) if t is not None]
        saved = [t.clone() for t in kept]
        # Warm-up on a side stream (Triton compiles, cuBLAS picks kernels): it runs this very
        # step, which is idempotent (same K/V rows, a valid cache state), minus its counts, the
        # recurrent states it advanced and its move to the next token and position.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(span, batch)
        torch.cuda.current_stream().wait_stream(side)
        for t, old in zip(kept, saved, strict=True):
            t.copy_(old)
        torch.cuda.synchronize(self.token.device)
        plan.rebase()  # the warm-up's compile time is no measure of the split
        graphs, state = [], None
        collecting = gc.isenabled()
        gc.disable()  # a collection while capturing can free an earlier runtime's page-locked
        try:  # buffers, whose event bookkeeping a capturing stream does not allow
            for layers in self.pieces:  # replayed in capture order, so sharing one pool is safe
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    state = self._piece(state, layers, span, batch)
                self.pool = graph.pool()
                graphs.append(graph)
        finally:
            if collecting:
                gc.enable()
        self.logits[key], self.graphs[key] = state, graphs
        return graphs

    def _bind(self, cache: KVCache) -> None:
        """Point `cache` at the static K/V and state buffers (copying its rows and states in);
        the previously bound sequence gets its own copy back. States are checked every time:
        a restored snapshot or a restart brings new tensors."""
        prev = self.bound() if self.bound is not None else None
        if prev is not cache:
            if prev is not None:
                for i in self.k:
                    prev.k[i], prev.v[i] = prev.k[i].clone(), prev.v[i].clone()
                self.addresses.pop(prev, None)
                for i in prev.states:
                    prev.states[i] = {n: t.clone() for n, t in prev.states[i].items()}
            self._bind_kv(cache)
        if self.flat is None and cache.states:
            self._carve(cache.states)
        for i, state in cache.states.items():
            for name, t in state.items():
                mine = self.states[i][name]
                if t is not mine:
                    mine.copy_(t)
                    state[name] = mine

    def _carve(self, like: dict[int, dict[str, torch.Tensor]]) -> None:
        """The static state buffers, shaped as `like`, views of one flat buffer."""
        align = 256
        sizes = {(i, n): -(-t.numel() * t.element_size() // align) * align for i, st in like.items() for n, t in st.items()}
        with torch.inference_mode(False):  # written by graph capture's restore outside inference mode too
            self.flat = torch.zeros(sum(sizes.values()), dtype=torch.uint8, device=self.token.device)
            self.flat_saved = torch.empty_like(self.flat)
        at = 0
        for (i, n), size in sizes.items():
            t = like[i][n]
            self.states.setdefault(i, {})[n] = self.flat[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            at += size

    def _bind_kv(self, cache: KVCache) -> None:
        for i in self.k:
            rows = cache.k[i].shape[0]  # max_tokens, or a sliding layer's ring: its rows as they lie
            n = min(cache.length, rows)
            self.k[i][:n].copy_(cache.k[i][:n])
            self.v[i][:n].copy_(cache.v[i][:n])
            cache.k[i], cache.v[i] = self.k[i][:rows], self.v[i][:rows]
        self.addresses.pop(cache, None)
        self.bound = weakref.ref(cache)
