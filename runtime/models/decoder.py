"""The Llama-style MoE decoder every supported family shares, driven by ModelSpec flags.

Dense weights come as a dict of canonical names (see base.py). Routed experts are not computed
here: each MoE layer hands its tokens, top-k ids and top-k weights to `experts.run`, which owns
the expert weights wherever they live (device cache, host pool).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

import torch
import torch.nn.functional as F

from ..spec import (
    QK_NORM_FULL,
    QK_NORM_HEAD,
    SLIDING_ATTENTION,
    ModelSpec,
)
from .block_table import embed_rows
from .kv import CacheSnapshot, KVCache
from .layers import Rope, apply_rope, attention, linear, rms_norm, softmax_topk, swiglu


class Experts(Protocol):
    def run(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        final: bool = True,
    ) -> torch.Tensor:
        """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) -> [T, H]; `layer` is
        the model layer index. `final=False`: more pieces of this layer's tokens follow in the
        same forward (a long prompt runs layer by layer), so its experts are wanted again."""
        ...

    def expect(self, layer: int, topk_ids: list[torch.Tensor]) -> None:
        """The routing of each piece `run` gets next for `layer`, in order: a layer-by-layer
        forward routes all its pieces before their experts run (a GPU store may read it back
        once, not once a piece)."""
        ...


# (layer, q [T, heads, D], k, v [T, kv_heads, D]) -> attention output [T, heads, D]: stores the
# new keys and values and attends over everything cached (MoEDecoder.mixer's `kv`)
KVAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (layer, h [T, H]) -> the layer's token mixer output [T, H] (MoEDecoder.layer's `mix`)
Mixer = Callable[[int, torch.Tensor], torch.Tensor]
# (x, delta, norm weight name) -> (x + delta, its norm) (MoEDecoder.add_norm)
AddNorm = Callable[[torch.Tensor, torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]]


class MoEDecoder:
    # transformers' Qwen/OLMoE routers cast the top-k weights to the hidden dtype; Mixtral's
    # keeps them float32 (its experts then scale in float32 and cast the product).
    cast_router_weights = True
    norm_offset = False  # RMSNorms multiply by (1 + weight) in float32 (Qwen3-Next); layers.rms_norm
    norm_float32 = False  # RMSNorms multiply by the weight in float32, then cast (gpt-oss); layers.rms_norm

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], experts: Experts):
        """`spec` has passed its family's `check_spec` (the layer kinds this forward runs among it)."""
        self.spec, self.w, self.experts = spec, weights, experts
        self.device = weights["embed.weight"].device
        self.rope = Rope(spec, self.device)
        self.lm_head = weights["embed.weight"] if spec.tie_word_embeddings else weights["lm_head.weight"]
        # model layer -> (topk_ids, topk_weights) of the last forward, for routing statistics
        self.last_routing: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.snapshots: dict[int, CacheSnapshot] = {}  # the last forward's `snapshot_at` snapshots

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def forward(self, input_ids: torch.Tensor, cache: KVCache, last_only: bool = False,
                chunk: int | None = None, snapshot_at: Collection[int] = (), cuts: Collection[int] = ()) -> torch.Tensor:
        """Logits [T, V] for input_ids [T] at positions cache.length.. ; appends to the cache.
        `last_only`: only the last position's [1, V] (prefill: a chunk's logits would take
        T x V activations, 2.5 GB at 8192 tokens of a 152k vocabulary in bf16).
        `chunk` (prefill): more tokens than this run layer by layer, each layer over pieces of at
        most `chunk` tokens in order before the next layer starts. Activations stay those of one
        piece (plus the residual stream of all T), while each layer's experts are needed over
        one stretch of time: a streamed layer crosses PCIe once for the whole prompt, not once
        per piece. Every piece attends to the keys (and carries on the recurrent state) the
        pieces before it left in that layer, so the result is the forward's, to rounding.
        `snapshot_at`: positions inside this forward where pieces also end; `self.snapshots`
        then holds the cache's snapshot at each, every layer's recurrent state (and sliding
        window) as that layer left it there: what a forward ending at that position would have
        left.
        `cuts` (CPU prefill): positions where pieces also end, for everything but the routed
        experts, which run once for consecutive pieces of up to `chunk` tokens together. A
        token's expert output does not depend on the others in its batch, so the result is
        bitwise that of one forward per piece, with each expert read once per batch."""
        return self.forward_many([input_ids], [cache], last_only, chunk, snapshot_at, [cuts])[0]

    @torch.inference_mode()
    def forward_many(self, inputs: list[torch.Tensor], caches: list[KVCache], last_only: bool = False,
                     chunk: int | None = None, snapshot_at: Collection[int] = (),
                     cuts: list[Collection[int]] | None = None) -> list[torch.Tensor]:
        """`forward` for several sequences at once, each input_ids [T_s] on its own cache (and
        `cuts[s]`): the pieces of all of them go through layer l before layer l+1 starts, so
        the routed experts of a layer run (and stream) once for all the prompts, not once per
        prompt. Each sequence's result is what its own forward gives (bitwise where that one's
        is, as a token's expert output does not depend on its batch). `snapshot_at`: one
        sequence only."""
        if snapshot_at and len(inputs) > 1:
            raise ValueError("snapshots are taken in a forward of one sequence")
        step = chunk or max(x.shape[0] for x in inputs)
        starts = [c.length for c in caches]
        pieces: list[tuple[int, int, int]] = []  # (sequence, a, b): tokens a..b of it
        for s, (ids, start) in enumerate(zip(inputs, starts, strict=True)):
            t = ids.shape[0]
            ends = sorted({p - start for p in (*snapshot_at, *(cuts[s] if cuts else ())) if start < p < start + t})
            pieces += [(s, a, b) for a, b in _pieces(t, step, ends)]
        batches = _batches([(a, b) for _, a, b in pieces], step)
        # each piece its own tensor: views of one would keep the whole embedding alive next to them
        xs = [embed_rows(inputs[s][a:b], self.w["embed.weight"]) for s, a, b in pieces]
        ropes = [self.rope(starts[s] + a, b - a, x.dtype) for (s, a, b), x in zip(pieces, xs, strict=True)]
        start = starts[0]
        snaps = {start + b: CacheSnapshot(start + b) for _, a, b in pieces[:-1] if start + b in snapshot_at}
        keep = len(batches) == 1  # one batch needs every piece's normed input at once anyway
        try:
            for i in range(self.spec.num_layers):
                p, moe = f"layers.{i}.", self.spec.is_moe(i)
                # Every piece's token mixer (and routing) first: a piece's mixer needs only the keys
                # (or state) the pieces before it left, not their experts; so `experts` sees the
                # layer's whole routing before its first piece's experts.
                routes, normed = [], {}
                for n, (s, a, b) in enumerate(pieces):
                    cache = caches[s]
                    cache.length = starts[s] + a  # where this piece's keys go and its queries sit
                    xs[n] = xs[n] + self.mixer(i, self.norm(xs[n], p + "attn_norm.weight"), *ropes[n], cache)
                    if (snap := snaps.get(start + b)) is not None:  # what this layer holds there
                        if i in cache.states:
                            snap.states[i] = {k: v.clone() for k, v in cache.states[i].items()}
                        if i in cache.sliding:
                            snap.windows[i] = cache.windows(i, start + b)
                    if moe:  # with several batches the normed input is recomputed below, not kept
                        h = self.norm(xs[n], p + "mlp_norm.weight")
                        routes.append(self.route(i, h))
                        if keep:
                            normed[n] = h
                if moe:  # each batch's routing as `run` will get it
                    routes = [_joined([routes[n] for n in batch]) for batch in batches]
                    self.experts.expect(i, [ids for ids, _ in routes])
                for m, batch in enumerate(batches):
                    hs = [normed[n] if n in normed else self.norm(xs[n], p + "mlp_norm.weight") for n in batch]
                    outs = (self.moe_pieces(i, hs, final=m == len(batches) - 1, routing=routes[m])
                            if moe else [self.mlp(p + "mlp", h) for h in hs])
                    for n, out in zip(batch, outs, strict=True):
                        xs[n] = xs[n] + out
        finally:
            for cache, start_s in zip(caches, starts, strict=True):
                cache.length = start_s
        for cache, ids in zip(caches, inputs, strict=True):
            cache.advance(ids.shape[0])
        if snapshot_at:
            self.snapshots = snaps
        outs = []
        for s in range(len(inputs)):
            mine = [x for (q, _, _), x in zip(pieces, xs, strict=True) if q == s]
            outs.append(mine[-1][-1:] if last_only else torch.cat(mine) if len(mine) > 1 else mine[0])
        # each sequence's own product: rows stacked would be summed in another order (not bitwise)
        return [linear(self.norm(x, "final_norm.weight"), self.lm_head) for x in outs]

    @torch.inference_mode()
    def forward_batch(self, input_ids: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """Logits [B, V] for one new token of each of B sequences. Attention runs per sequence
        (its own cache and position); everything else, the routed experts above all, runs once
        for the batch, so concurrent requests share each layer's expert work."""
        if len(caches) == 1:
            return self.forward(input_ids, caches[0])
        x = embed_rows(input_ids, self.w["embed.weight"])
        ropes = [self.rope(c.length, 1, x.dtype) for c in caches]

        def mix(i: int, h: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.mixer(i, h[b : b + 1], *ropes[b], c) for b, c in enumerate(caches)])

        h = self.norm(x, "layers.0.attn_norm.weight")
        for i in range(self.spec.num_layers):
            x, h = self.layer(i, x, h, mix)
        for c in caches:
            c.advance(1)
        return linear(h, self.lm_head)

    def layer(self, i: int, x: torch.Tensor, h: torch.Tensor, mix: Mixer, add_norm: AddNorm | None = None,
              experts: Experts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i of the residual stream x [T, H] given h, x normed by its attn_norm: returns
        the stream after the layer and its norm by the next layer's attn_norm (the final norm
        after the last). `mix(i, h)`: the token mixer's output. The one layer body the batched
        forward and the graph paths share; a fast path passes a fused `add_norm` (only where
        this family's own is the default: engine/graphs.py) and its own `experts`."""
        add_norm = add_norm or self.add_norm
        p = f"layers.{i}."
        x, h = add_norm(x, mix(i, h), p + "mlp_norm.weight")
        delta = self.moe(i, h, experts) if self.spec.is_moe(i) else self.mlp(p + "mlp", h)
        nxt = f"layers.{i + 1}.attn_norm.weight" if i + 1 < self.spec.num_layers else "final_norm.weight"
        return add_norm(x, delta, nxt)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w[name], self.spec.rms_norm_eps, self.norm_offset, self.norm_float32)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """x + delta and its norm by the weight `name`."""
        x = x + delta
        return x, self.norm(x, name)

    def mixer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
              kv: KVAttend | None = None) -> torch.Tensor:
        """The layer's token mixer: attention here; families with other layer kinds override.
        `kv` (graph decode): where keys and values go and what they attend over, instead of
        `cache`'s rows at cache.length; a recurrent layer still keeps its state in
        `cache.states`, updated in place (graph decode binds it to static buffers)."""
        return self.attention(i, x, cos, sin, cache, kv)

    def mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, *(self.w[f"{prefix}.{n}.weight"] for n in ("gate", "up", "down")))

    def attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                  kv: KVAttend | None = None) -> torch.Tensor:
        out = (kv or self.cached(cache))(i, *self.qkv(i, x, cos, sin))
        return self.linear(f"layers.{i}.attn.o", out.reshape(x.shape[0], -1))

    def cached(self, cache: KVCache) -> KVAttend:
        """Attention over `cache`: the new keys and values appended at cache.length, causal (a
        sliding layer's over the window's keys `append` returns, positions relative to them)."""
        def kv(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attention(q, *cache.append(i, k, v), self.window(i))
        return kv

    def window(self, i: int) -> int | None:
        """The layer's sliding window, None for full attention."""
        return self.spec.sliding_window if self.spec.layer_kinds[i] == SLIDING_ATTENTION else None

    def qkv(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries [T, heads, D] and keys, values [T, kv_heads, D] of x [T, H]: projections,
        Q/K norms, clipping and rotary embedding, ready for the cache."""
        s, p, t = self.spec, f"layers.{i}.attn.", x.shape[0]
        q, k, v = (self.linear(p + n, x) for n in "qkv")
        if s.qk_norm == QK_NORM_FULL:  # OLMoE: over the whole projection, before the head split
            q = rms_norm(q, self.w[p + "q_norm.weight"], s.rms_norm_eps)
            k = rms_norm(k, self.w[p + "k_norm.weight"], s.rms_norm_eps)
        clip = s.extra.get("clip_qkv")
        if clip:  # OLMoE
            q, k, v = (a.clamp(-clip, clip) for a in (q, k, v))
        q = q.view(t, s.num_heads, s.head_dim)
        k = k.view(t, s.num_kv_heads, s.head_dim)
        v = v.view(t, s.num_kv_heads, s.head_dim)
        if s.qk_norm == QK_NORM_HEAD:  # Qwen3: per head, over head_dim
            q = rms_norm(q, self.w[p + "q_norm.weight"], s.rms_norm_eps)
            k = rms_norm(k, self.w[p + "k_norm.weight"], s.rms_norm_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def route(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids [T, k], topk_weights [T, k]): softmax over all experts in float32, top-k
        (sorted, as torch.topk), optionally renormalised."""
        logits = linear(x, self.w[f"layers.{i}.router.weight"])
        dtype = logits.dtype if self.cast_router_weights else torch.float32
        return softmax_topk(logits, self.spec.top_k, self.spec.norm_topk_prob, dtype)

    def moe(self, i: int, x: torch.Tensor, experts: Experts | None = None) -> torch.Tensor:
        return self.moe_pieces(i, [x], experts=experts)[0]

    def moe_pieces(self, i: int, xs: list[torch.Tensor], final: bool = True,
                   routing: tuple[torch.Tensor, torch.Tensor] | None = None,
                   experts: Experts | None = None) -> list[torch.Tensor]:
        """Layer i's MoE output for each of the pieces `xs`: each piece routed and its shared
        expert run as a forward of it alone would, the routed experts once for all of them.
        `final=False`: more pieces of this layer follow in this forward (Experts.run).
        `routing`: the pieces' (ids, weights) one after another, where already computed.
        `experts`: who runs the routed experts, if not `self.experts` (graph paths: the store's
        device planner)."""
        s, p = self.spec, f"layers.{i}."
        ids, weights = routing or _joined([self.route(i, x) for x in xs])
        self.last_routing[i] = (ids, weights)
        out = (experts or self.experts).run(i, torch.cat(xs) if len(xs) > 1 else xs[0], ids, weights, final=final)
        outs = list(out.split([x.shape[0] for x in xs]))
        if s.shared_expert_intermediate_size:
            for n, x in enumerate(xs):
                shared = self.mlp(p + "shared", x)
                if s.shared_expert_gate:  # Qwen2-MoE
                    shared = torch.sigmoid(F.linear(x, self.w[p + "shared_gate.weight"])) * shared
                outs[n] = outs[n] + shared
        return outs


def _joined(routes: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pieces' (ids, weights) one after another (one piece's as they are)."""
    return routes[0] if len(routes) == 1 else tuple(torch.cat(r) for r in zip(*routes, strict=True))


def _pieces(t: int, step: int, ends: list[int]) -> list[tuple[int, int]]:
    """[a, b) spans covering 0..t: ending at each of `ends` (sorted, inside), at most `step` long."""
    out, a = [], 0
    for end in [*ends, t]:
        while end - a > step:
            out.append((a, a + step))
            a += step
        if end > a:
            out.append((a, end))
            a = end
    return out


def _batches(pieces: list[tuple[int, int]], limit: int) -> list[list[int]]:
    """Consecutive pieces (by index) grouped while their tokens add up to at most `limit`."""
    out: list[list[int]] = [[]]
    size = 0
    for n, (a, b) in enumerate(pieces):
        if out[-1] and size + b - a > limit:
            out.append([])
            size = 0
        out[-1].append(n)
        size += b - a
    return out
