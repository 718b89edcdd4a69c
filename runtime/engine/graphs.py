"""Batch-1 decode steps captured in CUDA graphs and replayed with one launch.

An eager decode step launches some 70 kernels per layer from Python and reads every layer's
routing back to the host; at a few hundred microseconds of expert traffic per layer the host
becomes the bottleneck. Here a step has fixed shapes and no host decision:
- the token and its position live in device tensors; rotary tables are gathered by position;
- K/V go into static per-layer buffers (a sequence's KVCache is re-pointed at them while it is
  bound), and attention covers a fixed span with a position mask, so one graph per span bucket
  (256, 512, ... tokens) serves every position below it; where the family's Q/K treatment allows
  (per-head or no Q/K norm, no clipping), norms, RoPE, the cache writes and attention are two
  Triton launches per layer (kernels/triton/decode.py) instead of about twenty;
- the routed experts go through the store's DevicePlan (hits, fills and the CPU set decided on
  the GPU, the CPU branch started by a doorbell, not by Python);
- a step is a few graphs of two layers each, replayed back to back, so the GPU need not wait
  for the host to launch the whole step.
Without CUDA (`capture=False`) the same step runs eagerly: tests check it on CPU.
"""

from __future__ import annotations

import sys
import weakref

import torch
import torch.nn.functional as F

from ..experts.store import ExpertStore
from ..models.decoder import MoEDecoder
from ..models.kv import KVCache
from ..models.layers import decode_attention
from ..spec import QK_NORM_HEAD, QK_NORM_NONE

FIRST_SPAN = 256  # attention span of the smallest graph; each next one doubles it
# A step is captured as several graphs of this many layers: launching a graph costs host time
# in proportion to its nodes (~0.5 ms for a whole 12-layer step), and the GPU starts on the
# first piece while the host launches the next.
LAYERS_PER_GRAPH = 2


def unsupported(decoder: MoEDecoder, store: ExpertStore) -> str | None:
    """Why this model cannot decode through graphs here, or None."""
    cls = type(decoder)
    if cls.mixer is not MoEDecoder.mixer or cls.attention is not MoEDecoder.attention:
        return f"{decoder.spec.architecture} has its own token mixer"
    if decoder.rope.dynamic:
        return "dynamic NTK rope changes with the sequence length"
    if store.stats.trace:
        return "per-step expert statistics need the host planner"
    return store.device_plan_unsupported()


def _fused_attention(decoder: MoEDecoder):
    """The Triton decode-attention kernels where this family's Q/K treatment is what they do
    (per-head RMSNorm or none, no clipping), else None (the torch ops run)."""
    s = decoder.spec
    if s.qk_norm not in (QK_NORM_HEAD, QK_NORM_NONE) or s.extra.get("clip_qkv"):
        return None
    try:
        from ftkit.kernels.triton import decode
    except ImportError:
        return None
    return decode


class GraphDecode:
    def __init__(self, decoder: MoEDecoder, store: ExpertStore, capacity: int, capture: bool = True):
        """`capacity`: tokens of static K/V (sequences longer than this decode eagerly)."""
        s, dev = decoder.spec, store.device
        self.decoder, self.store, self.capacity, self.capture = decoder, store, capacity, capture
        dtype = decoder.lm_head.dtype
        shape = (capacity, s.num_kv_heads, s.head_dim)
        layers = [i for i in range(s.num_layers) if i in KVCache(s, 0).k]
        self.k = {i: torch.zeros(shape, dtype=dtype, device=dev) for i in layers}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=dev) for i in layers}
        self.cos, self.sin = decoder.rope(0, capacity, dtype)
        self.token = torch.zeros(1, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int64, device=dev)
        self.positions = torch.arange(capacity, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # span -> the step's pieces, in order
        n = s.num_layers
        self.pieces = [range(i, min(i + LAYERS_PER_GRAPH, n)) for i in range(0, n, LAYERS_PER_GRAPH)]
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None  # one memory pool for every span's graph: they never run at once
        self.bound: weakref.ref[KVCache] | None = None
        self.version = store.version
        self.fused = _fused_attention(decoder)
        self.said_too_long = False  # the eager fallback for long sequences is announced once

    def accepts(self, cache: KVCache) -> bool:
        if cache.max_tokens > self.capacity and not self.said_too_long:
            print(f"ftkit: sequences longer than {self.capacity} tokens (the graph K/V capacity) decode "
                  "without CUDA graphs", file=sys.stderr)
            self.said_too_long = True
        return not cache.states and cache.max_tokens <= self.capacity and cache.length < cache.max_tokens

    def step(self, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits [1, V] for one token at position cache.length; appends its K/V."""
        self._bind(cache)
        plan = self.store.device_plan_for_graphs()
        if self.store.version != self.version:  # the cache was rebuilt: its slots moved
            self.graphs.clear()
            self.logits.clear()
            self.version = self.store.version
        plan.to_device()
        plan.adapt()
        self.token.copy_(input_ids.reshape(1))
        self.pos.fill_(cache.length)
        span = FIRST_SPAN
        while span <= cache.length:
            span *= 2
        span = self.capacity if self.fused else min(span, self.capacity)  # fused attention: one graph
        if self.capture:
            for graph in self.graphs.get(span) or self._capture(span):
                graph.replay()
            logits = self.logits[span].clone()
        else:
            logits = self._forward(span)
        cache.advance(1)
        return logits

    def _forward(self, span: int) -> torch.Tensor:
        x = None
        for layers in self.pieces:
            x = self._piece(x, layers, span)
        return x

    def _piece(self, x: torch.Tensor | None, layers: range, span: int) -> torch.Tensor:
        """The step's `layers`: from the token's embedding when x is None; the logits after the
        model's last layer, else the hidden state."""
        dec, s = self.decoder, self.decoder.spec
        if x is None:
            x = F.embedding(self.token, dec.w["embed.weight"])
        if not self.fused:
            cos, sin = self.cos.index_select(0, self.pos), self.sin.index_select(0, self.pos)
            keys = self.positions[:span]
            visible = keys <= self.pos
        self.store.in_graph = True
        try:
            for i in layers:
                p = f"layers.{i}."
                h = dec.norm(x, p + "attn_norm.weight")
                window = dec.window(i)
                if self.fused:
                    q, k, v = (dec.linear(p + "attn." + n, h) for n in "qkv")
                    q = self.fused.rope_store(q, k, v, dec.w.get(p + "attn.q_norm.weight"),
                                              dec.w.get(p + "attn.k_norm.weight"), s.rms_norm_eps, self.cos, self.sin,
                                              self.pos, self.k[i], self.v[i])
                    out = self.fused.attention(q, self.k[i], self.v[i], self.pos, window)
                else:
                    q, k, v = dec.qkv(i, h, cos, sin)
                    self.k[i].index_copy_(0, self.pos, k)
                    self.v[i].index_copy_(0, self.pos, v)
                    mask = visible if window is None else visible & (keys > self.pos - window)
                    out = decode_attention(q, self.k[i][:span], self.v[i][:span], mask)
                x = x + dec.linear(p + "attn.o", out.reshape(1, -1))
                h = dec.norm(x, p + "mlp_norm.weight")
                x = x + (dec.moe(i, h) if s.is_moe(i) else dec.mlp(p + "mlp", h))
        finally:
            self.store.in_graph = False
        if layers.stop < s.num_layers:
            return x
        return F.linear(dec.norm(x, "final_norm.weight"), dec.lm_head)

    def _capture(self, span: int) -> list[torch.cuda.CUDAGraph]:
        plan = self.store.device_plan_for_graphs()
        counts = plan.counts.clone()
        # Warm-up on a side stream (Triton compiles, cuBLAS picks kernels): it runs this very
        # step, which is idempotent (same K/V row, a valid cache state), minus its counts.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(span)
        torch.cuda.current_stream().wait_stream(side)
        plan.counts.copy_(counts)
        graphs, x = [], None
        for layers in self.pieces:  # replayed in capture order, so sharing one pool is safe
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                x = self._piece(x, layers, span)
            self.pool = graph.pool()
            graphs.append(graph)
        self.logits[span], self.graphs[span] = x, graphs
        return graphs

    def _bind(self, cache: KVCache) -> None:
        """Point `cache` at the static K/V buffers (copying its rows in); the previously bound
        sequence gets its own copy back."""
        prev = self.bound() if self.bound is not None else None
        if prev is cache:
            return
        if prev is not None:
            for i in self.k:
                prev.k[i], prev.v[i] = prev.k[i].clone(), prev.v[i].clone()
        n = cache.length
        for i in self.k:
            self.k[i][:n].copy_(cache.k[i][:n])
            self.v[i][:n].copy_(cache.v[i][:n])
            cache.k[i], cache.v[i] = self.k[i][: cache.max_tokens], self.v[i][: cache.max_tokens]
        self.bound = weakref.ref(cache)
