"""Attention of a few queries behind a long cache (Triton): an agent turn's extend after a prefix
hit, an eager decode step of a sliding-window layer, and a graph decode step's one query.

SDPA has no kernel for this shape on CUDA: a causal mask with an offset rules out flash
attention, the memory-efficient kernel takes no GQA (the K/V heads must be repeated first), and
both give each (head, 64 queries) tile one program that walks every key, so 32 queries behind 8k
keys ran 32 programs on a 132-SM GPU (0.55 ms per layer). Here the keys are split as in
flash-decoding: one program per (K/V head, block of queries, key chunk) computes the rows of every
query head sharing that K/V head against its chunk with an online softmax, and a second launch
combines the chunks by their log-sum-exp. K/V are read once per chunk and query block, in place.
A graph decode step (`decode_attention`) reads its position on the device: a captured grid of
a fixed number of chunks serves every position, each chunk sized from the position in the kernel,
so a step behind 8k keys keeps 128 programs busy where one program per head walked them all. Its
batch form takes one query of each of several sequences, each at its own position over its own
cache (their addresses read on the device too), so one captured grid serves every batch of that
many sequences. gpt-oss's learned sinks (a logit per head with no value) join the combine, the
one place that sees a query's whole denominator: added once per head, not once per chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftkit.kernels.triton import interpreting

MAX_QUERIES = 64  # beyond this the split buffers grow and SDPA has enough tiles of its own
MAX_SPLITS = 32
BLOCK_S = 64  # keys per step of a program's walk
DECODE_CHUNK = 256  # a decode step's smallest chunk: below it a program's walk is mostly its start


@triton.jit(do_not_specialize=["T", "S", "offset", "window", "chunk", "first"])  # one compile for every position
def _partial(q_ptr, k_ptr, v_ptr, acc_ptr, ml_ptr, pos_ptr, caches_ptr, T, S, offset, window, scale, chunk, first,
             ring, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
             BT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
             POS_ON_DEVICE: tl.constexpr, BATCH: tl.constexpr, RING: tl.constexpr):
    kh, tb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = first + sp * chunk  # keys before `first` are outside every query's window
    if POS_ON_DEVICE:  # offset, S and the chunk (at least `chunk`) from the position pos_ptr holds
        if BATCH:  # query tb (BT = 1) is its own sequence's: its position, its K and V caches
            last = tl.load(pos_ptr + tb).to(tl.int32)
            offset = last - tb  # query t sits at offset + t below: tb at `last`
            k_ptr = tl.load(caches_ptr + tb).to(tl.pointer_type(k_ptr.dtype.element_ty))
            v_ptr = tl.load(caches_ptr + T + tb).to(tl.pointer_type(v_ptr.dtype.element_ty))
        else:
            offset = tl.load(pos_ptr).to(tl.int32)
            last = offset + T - 1
        S = last + 1  # no key is read past the last query's own
        first = offset * 0
        if window > 0:  # keys before the window are not walked
            first = tl.maximum(offset + tb * BT - window + 1, 0) // BLOCK_S * BLOCK_S
        chunk = tl.maximum(chunk, tl.cdiv(tl.cdiv(S - first, tl.num_programs(2)), BLOCK_S) * BLOCK_S)
        start = first + sp * chunk
    G: tl.constexpr = HEADS // KV_HEADS
    r = tl.arange(0, BLOCK_M)
    t = tb * BT + r // G
    head = kh * G + r % G
    rmask = (r < BT * G) & (t < T)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    qoffs = (t[:, None].to(tl.int64) * HEADS + head[:, None]) * D + d[None, :]
    q = tl.load(q_ptr + qoffs, mask=rmask[:, None] & dm[None, :], other=0.0)
    pos = offset + t  # each query's own position: it sees keys lo..pos
    lo = tl.zeros([BLOCK_M], tl.int32)
    if window > 0:
        lo = tl.maximum(pos - window + 1, 0)
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    stop = tl.minimum(start + chunk, tl.minimum(S, offset + tb * BT + BT))  # no key past the block's last query
    for s0 in range(start, stop, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        at = s
        if RING:  # a sliding layer's ring: key position s at row s mod ring (those masked below
            at = s % ring  # may hold a later position's key: never seen)
        koffs = (at[:, None].to(tl.int64) * KV_HEADS + kh) * D + d[None, :]
        kmask = (s < S)[:, None] & dm[None, :]
        k = tl.load(k_ptr + koffs, mask=kmask, other=0.0)
        v = tl.load(v_ptr + koffs, mask=kmask, other=0.0)
        if IEEE:
            sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        seen = (s[None, :] <= pos[:, None]) & (s[None, :] >= lo[:, None]) & rmask[:, None]
        sc = tl.where(seen, sc * scale, -1e30)
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(seen, tl.exp(sc - m_new[:, None]), 0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    row = (sp * T + t.to(tl.int64)) * HEADS + head  # [splits, T, heads] order
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=rmask[:, None] & dm[None, :])
    tl.store(ml_ptr + 2 * row, m_i, mask=rmask)
    tl.store(ml_ptr + 2 * row + 1, l_i, mask=rmask)


@triton.jit(do_not_specialize=["T", "splits"])
def _combine(acc_ptr, ml_ptr, sink_ptr, out_ptr, T, splits, HEADS: tl.constexpr, D: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, SINK: tl.constexpr):
    t, h = tl.program_id(0), tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    pm = p < splits
    row = (p.to(tl.int64) * T + t) * HEADS + h
    m = tl.load(ml_ptr + 2 * row, mask=pm, other=-1e30)
    l_s = tl.load(ml_ptr + 2 * row + 1, mask=pm, other=0.0)
    top = tl.max(m, axis=0)
    if SINK:  # gpt-oss: one more logit per head with no value, so here once, not once per chunk
        sink = tl.load(sink_ptr + h).to(tl.float32)
        top = tl.maximum(top, sink)
    w = tl.where(pm & (l_s > 0), tl.exp(m - top), 0.0)  # chunks the query saw nothing of weigh 0
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    acc = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=(pm & (l_s > 0))[:, None] & dm[None, :], other=0.0)
    den = tl.sum(l_s * w, axis=0)
    if SINK:
        den += tl.exp(sink - top)
    o = tl.sum(acc * w[:, None], axis=0) / den
    tl.store(out_ptr + (t * HEADS + h) * D + d, o.to(out_ptr.dtype.element_ty), mask=dm)


def few_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int,
                        window: int | None = None, sinks: torch.Tensor | None = None, ring: int = 0) -> torch.Tensor:
    """Causal GQA attention as `layers.attention`: q [T, H, D] at positions offset..offset+T;
    k, v [S, KvH, D] (rows may be strided views of a cache: the inner two dims contiguous) with
    S = offset + T. T <= MAX_QUERIES. `sinks` [H] (gpt-oss): one more logit per head in the
    softmax's denominator, with no value (gpt_oss_forward.sink_attention). `ring` (a sliding
    layer's, models/kv.py): k, v hold key position p at row p mod ring, the last `ring`
    positions up to offset + T (all the queries' windows). Only the keys from the first query's
    window on are read. Returns [T, H, D] in q's dtype."""
    t = q.shape[0]
    s = offset + t if ring else k.shape[0]
    if t > MAX_QUERIES:
        raise ValueError(f"few_query_attention takes at most {MAX_QUERIES} queries")
    first = max(0, offset - window + 1) // BLOCK_S * BLOCK_S if window else 0
    chunk = max(512, triton.cdiv(triton.cdiv(s - first, MAX_SPLITS), BLOCK_S) * BLOCK_S)
    return _attend(q, k, v, s, offset, window, chunk, triton.cdiv(s - first, chunk), sinks=sinks, first=first,
                   ring=ring)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     window: int | None, caches: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None, ring: int = 0) -> torch.Tensor:
    """One query's GQA attention over cache rows 0..pos (the last `window` of them for sliding
    layers), graph-safe: q [1, heads, D]; k_cache, v_cache [positions, kv_heads, D]; pos int64
    [1] on the device. The grid is fixed by the cache's size, each chunk at least DECODE_CHUNK
    keys: near the start one chunk does the work and the others end at once.
    The batch form, `caches` given: q [T, heads, D] holds one query of each of T sequences, pos
    int64 [T] each one's position and `caches` int64 [2, T] on the device the addresses of query
    t's sequence's K cache (row 0) and V cache, contiguous, typed and laid out as k_cache and
    v_cache, which then give only that and the grid (their positions: as many as the longest).
    `sinks`, `ring`: as few_query_attention's (a ring's rows are its window and headroom, so
    its grid is a chunk or two whatever the position)."""
    capacity = k_cache.shape[0]
    splits = min(MAX_SPLITS, triton.cdiv(capacity, DECODE_CHUNK))
    return _attend(q, k_cache, v_cache, capacity, 0, window, DECODE_CHUNK, splits, pos, caches, sinks, ring=ring)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: int, offset: int, window: int | None,
            chunk: int, splits: int, pos: torch.Tensor | None = None,
            caches: torch.Tensor | None = None, sinks: torch.Tensor | None = None, first: int = 0,
            ring: int = 0) -> torch.Tensor:
    """`_partial` over `splits` key chunks of `chunk` keys from key `first` (with `pos`: of at
    least that many from the window's first key, sized on the device; with `caches` too: each
    query over its own sequence's), then `_combine` (which adds the `sinks`). `ring`: key
    position p at row p mod ring."""
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    if heads % kv_heads:
        raise ValueError("attention takes whole GQA groups")
    q = q.contiguous()
    k, v = (a if a.stride(2) == 1 and a.stride(1) == d and a.stride(0) == kv_heads * d else a.contiguous() for a in (k, v))
    group = heads // kv_heads
    bt = 1 if pos is not None else max(1, 32 // group)  # queries per program: at least 16 rows of the tile are real
    block_m = max(16, triton.next_power_of_2(bt * group))
    acc = torch.empty((splits, t, heads, d), dtype=torch.float32, device=q.device)
    ml = torch.empty((splits, t, heads, 2), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    ieee = q.dtype == torch.float32 or interpreting()  # the interpreter's 16-bit dot is wrong (Triton 3.x)
    _partial[(kv_heads, triton.cdiv(t, bt), splits)](
        q, k, v, acc, ml, pos if pos is not None else q, caches if caches is not None else q, t, s, offset,
        window or 0, d**-0.5, chunk, first, ring, HEADS=heads, KV_HEADS=kv_heads, D=d, BLOCK_D=block_d, BT=bt,
        BLOCK_M=block_m, BLOCK_S=BLOCK_S, IEEE=ieee, POS_ON_DEVICE=pos is not None, BATCH=caches is not None,
        RING=ring > 0)
    out = torch.empty_like(q)
    if sinks is not None and sinks.shape != (heads,):
        raise ValueError(f"attention sinks: one per query head ({heads}), not {tuple(sinks.shape)}")
    _combine[(t, heads)](acc, ml, sinks if sinks is not None else acc, out, t, splits, HEADS=heads, D=d,
                         BLOCK_D=block_d, BLOCK_P=MAX_SPLITS,  # fixed: one compile whatever the context length
                         SINK=sinks is not None)
    return out
