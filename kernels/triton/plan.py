"""A device-planned layer's expert plan and merge, each in a single Triton program.

The same decisions as torch tensor ops cost some thirty tiny kernels per layer, and in a CUDA
graph each still costs a few microseconds: at 12-48 layers a token that adds up to milliseconds.
`plan` makes every decision of `DevicePlanner` for one decode token, in one program over its k
routed items:
- hit: the row's residency table entry is a slot;
- the first q misses in top-k order are filled (q = m for offload, 0 for cpu, round(m * ratio)
  with at least one for hybrid), the others run on the CPU;
- victims: for each fill in turn, the least recently stamped slot that no hit of this layer
  holds and no earlier fill took; table, owner and stamps are updated in place;
- it writes the device work list (hits and fills, compacted, with a valid count; each entry's
  slot, router weight, row and fill flag: the grouped GEMV fills as it reads), the CPU payload
  (x, weights, rows, CPU flags as float32) and the layer's counters.
`plan_tokens` does the same for a few tokens at once (a short extend), over the layer's experts
rather than its items: an expert routed by several tokens is one decision, one fill, one GEMM
tile (the grouped GEMM fills as it reads too) or one CPU expert; misses are ranked most-used
first, as the host planner ranks them.
`merge` sums each token's k weighted expert outputs per hidden channel in top-k order, each
taken from the device kernel's output or from the CPU worker's mapped output buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

OFFLOAD_MODE, CPU_MODE, HYBRID_MODE = 0, 1, 2
NEVER = tl.constexpr(2**62)  # stamp of a slot this layer may not evict


@triton.jit
def _lookup(table_ptr, rows, lanes, W: tl.constexpr, CAP: tl.constexpr):
    """The lanes' slots from the residency table (-1: not resident), hits and misses."""
    if CAP > 0:
        slot = tl.load(table_ptr + rows, mask=lanes, other=-1)
    else:
        slot = tl.full([W], -1, tl.int32)
    return slot, lanes & (slot >= 0), lanes & (slot < 0)


@triton.jit
def _claim(rows, slot, hit, fill, rank, q, table_ptr, owner_ptr, stamp_ptr, clock_ptr, cap, W: tl.constexpr,
           CAP: tl.constexpr, SB: tl.constexpr):
    """Victims for the fills (lanes of width W): the r-th fill takes the least recently stamped
    slot that no hit of this layer holds and no earlier fill took; table, owner and stamps
    updated. Returns the lanes' slots.
    The stamps are searched in two levels: each block of SB slots keeps its minimum, and a pass
    takes the argmin over the CAP / SB block minima, then over that block's SB stamps (reread),
    so q passes cost O(CAP + q (CAP / SB + SB)) rather than O(q CAP): the whole cache of a
    48-layer model is thousands of slots. Held and taken slots are marked NEVER in the stamps
    themselves; every one of them is stamped with the new clock at the end."""
    tl.store(stamp_ptr + slot, tl.full([W], NEVER, tl.int64), mask=hit)
    tl.debug_barrier()
    nb = tl.arange(0, CAP // SB)
    b = tl.arange(0, SB)
    c = nb[:, None] * SB + b[None, :]
    block_min = tl.min(tl.load(stamp_ptr + c, mask=c < cap, other=NEVER), axis=1)
    for r in range(0, q):
        blk = tl.argmin(block_min, axis=0)
        cb = blk * SB + b
        stamps = tl.load(stamp_ptr + cb, mask=cb < cap, other=NEVER)
        o = tl.argmin(stamps, axis=0)
        v = (blk * SB + o).to(tl.int32)
        block_min = tl.where(nb == blk, tl.min(tl.where(b == o, NEVER, stamps), axis=0), block_min)
        tl.store(stamp_ptr + v, tl.full([], NEVER, tl.int64))
        tl.debug_barrier()  # the next pass may reread this block
        slot = tl.where(fill & (rank == r), v, slot)
    old = tl.load(owner_ptr + slot, mask=fill, other=-1)
    tl.store(table_ptr + old, -1, mask=fill & (old >= 0))
    tl.store(table_ptr + rows, slot, mask=fill)
    tl.store(owner_ptr + slot, rows.to(tl.int32), mask=fill)
    clock = tl.load(clock_ptr) + 1
    tl.store(clock_ptr, clock)
    tl.store(stamp_ptr + slot, tl.zeros([W], tl.int64) + clock, mask=hit | fill)
    return slot


@triton.jit
def _fill_count(m, ratio_ptr, MODE: tl.constexpr):
    """q of m misses: all (offload), none (cpu), round(m * ratio) within 1..m (hybrid)."""
    if MODE == 0:
        q = m
    elif MODE == 1:
        q = m * 0
    else:
        q = tl.minimum(tl.maximum((m.to(tl.float32) * tl.load(ratio_ptr) + 0.5).to(tl.int32), 1), m)
    return q


@triton.jit
def _count(counts_ptr, hit, fill, on_cpu):
    tl.store(counts_ptr, tl.load(counts_ptr) + tl.sum(hit.to(tl.int64), axis=0))
    tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + tl.sum(fill.to(tl.int64), axis=0))
    tl.store(counts_ptr + 2, tl.load(counts_ptr + 2) + tl.sum(on_cpu.to(tl.int64), axis=0))


@triton.jit
def _payload_x(payload_ptr, x_ptr, n, BLOCK: tl.constexpr):
    """The first n floats of x into the payload (the CPU branch's activations)."""
    for o in range(0, n, BLOCK):
        e = o + tl.arange(0, BLOCK)
        tl.store(payload_ptr + e, tl.load(x_ptr + e, mask=e < n).to(tl.float32), mask=e < n)


@triton.jit
def _payload_items(payload_ptr, j, mask, w, rows, on_cpu, token, XN, NMAX):
    """Items j's weight, expert row, CPU flag and token into the payload's item sections."""
    tl.store(payload_ptr + XN + j, w.to(tl.float32), mask=mask)
    tl.store(payload_ptr + XN + NMAX + j, rows.to(tl.float32), mask=mask)
    tl.store(payload_ptr + XN + 2 * NMAX + j, on_cpu.to(tl.float32), mask=mask)
    tl.store(payload_ptr + XN + 3 * NMAX + j, token.to(tl.float32), mask=mask)


@triton.jit
def _plan(ids_ptr, w_ptr, x_ptr, base, table_ptr, owner_ptr, stamp_ptr, clock_ptr, ratio_ptr, counts_ptr,
          gslot_ptr, gw_ptr, grow_ptr, gfill_ptr, gpos_ptr, gcount_ptr, payload_ptr, cap, H, XN, NMAX,
          K: tl.constexpr, KP: tl.constexpr, CAP: tl.constexpr, SB: tl.constexpr, MODE: tl.constexpr,
          HAS_CPU: tl.constexpr, BLOCK_H: tl.constexpr):
    j = tl.arange(0, KP)
    valid = j < K
    rows = base + tl.load(ids_ptr + j, mask=valid, other=0).to(tl.int64)
    slot, hit, miss = _lookup(table_ptr, rows, valid, KP, CAP)
    miss_i = miss.to(tl.int32)
    rank = tl.cumsum(miss_i, axis=0) - 1
    q = _fill_count(tl.sum(miss_i, axis=0), ratio_ptr, MODE)
    fill = miss & (rank < q)
    on_cpu = miss & (rank >= q)
    if CAP > 0:
        slot = _claim(rows, slot, hit, fill, rank, q, table_ptr, owner_ptr, stamp_ptr, clock_ptr, cap, KP, CAP, SB)
    w = tl.load(w_ptr + j, mask=valid, other=0.0)
    dev = hit | fill
    pos = tl.cumsum(dev.to(tl.int32), axis=0) - 1
    tl.store(gslot_ptr + pos, slot, mask=dev)
    tl.store(gw_ptr + pos, w, mask=dev)
    tl.store(grow_ptr + pos, rows, mask=dev)
    tl.store(gfill_ptr + pos, fill.to(tl.int32), mask=dev)
    tl.store(gpos_ptr + j, tl.where(dev, pos, -1), mask=valid)
    tl.store(gcount_ptr, tl.sum(dev.to(tl.int32), axis=0))
    tl.store(gcount_ptr + 1, tl.sum(on_cpu.to(tl.int32), axis=0))
    _count(counts_ptr, hit, fill, on_cpu)
    if HAS_CPU:
        _payload_x(payload_ptr, x_ptr, H, BLOCK_H)
        _payload_items(payload_ptr, j, valid, w, rows, on_cpu, j * 0, XN, NMAX)
        tl.store(payload_ptr + XN + 4 * NMAX, K * 1.0)


@triton.jit
def _plan_tokens(ids_ptr, w_ptr, x_ptr, n_items, base, table_ptr, owner_ptr, stamp_ptr, clock_ptr, ratio_ptr,
                 counts_ptr, fill_all_above, e_tile_ptr, tiles_ptr, tfill_ptr, trow_ptr, tok_ptr, sw_ptr,
                 dst_ptr, gpos_ptr, gcount_ptr, payload_ptr, cap, H, XN, NMAX,
                 E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, NP: tl.constexpr,
                 CAP: tl.constexpr, SB: tl.constexpr, MODE: tl.constexpr, HAS_CPU: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    # Per expert of the layer: how many of the n_items (token, k) items route to it (a
    # histogram over twice the experts' lanes: the items past n_items count in bin E, unused).
    e = tl.arange(0, EP)
    p = tl.arange(0, NP)
    ids = tl.load(ids_ptr + p, mask=p < n_items, other=E).to(tl.int32)
    cnt, _ = tl.split(tl.permute(tl.reshape(tl.histogram(ids, 2 * EP), [2, EP]), (1, 0)))
    active = (cnt > 0) & (e < E)
    rows = base + e.to(tl.int64)
    slot, hit, miss = _lookup(table_ptr, rows, active, EP, CAP)
    # misses ranked most-used first (ties: lower expert first): the first q are filled. A
    # sort, each miss's place written to e_tile and read back by its lane: the pairwise
    # [EP, EP] count it replaces is a quarter million comparisons at 512 experts.
    order = tl.sort(tl.where(miss, NP - cnt, NP + 1) * EP + e)
    tl.store(e_tile_ptr + order % EP, e, mask=order % EP < E)  # lane i: the i-th key
    tl.debug_barrier()
    rank = tl.load(e_tile_ptr + e, mask=e < E, other=0)
    tl.debug_barrier()  # every lane has its rank before e_tile is written again
    m = tl.sum(miss.to(tl.int32), axis=0)
    q = _fill_count(m, ratio_ptr, MODE)
    if MODE == 2:  # many tokens per expert: the CPU branch is compute-bound, fill every miss
        q = tl.where(n_items > fill_all_above * tl.sum(active.to(tl.int32), axis=0), m, q)
    q = tl.minimum(q, cap - tl.sum(hit.to(tl.int32), axis=0))  # no more fills than free slots
    fill = miss & (rank < q)
    on_cpu = miss & (rank >= q)
    if CAP > 0:
        slot = _claim(rows, slot, hit, fill, rank, q, table_ptr, owner_ptr, stamp_ptr, clock_ptr, cap, EP, CAP, SB)
    # The items sorted by expert (then by item): expert e's run starts at the items of the
    # experts before it. GEMM tiles, one per device expert: fills first (their reads over PCIe
    # are the long ones), then hits; each points at its expert's run.
    first = tl.cumsum(cnt, axis=0) - cnt
    dev = hit | fill
    tile = tl.where(fill, rank, tl.sum(fill.to(tl.int32), axis=0) + tl.cumsum(hit.to(tl.int32), axis=0) - 1)
    tile = tl.where(dev, tile, -1)
    tl.store(tiles_ptr + 3 * tile, slot, mask=dev)
    tl.store(tiles_ptr + 3 * tile + 1, first, mask=dev)
    tl.store(tiles_ptr + 3 * tile + 2, cnt, mask=dev)
    tl.store(tfill_ptr + tile, fill.to(tl.int32), mask=dev)
    tl.store(trow_ptr + tile, rows, mask=dev)
    tl.store(e_tile_ptr + e, tile, mask=e < E)
    tl.store(gcount_ptr, tl.sum(dev.to(tl.int32), axis=0))
    tl.store(gcount_ptr + 1, tl.sum(on_cpu.to(tl.int32), axis=0))
    _count(counts_ptr, hit, fill, on_cpu)
    tl.debug_barrier()  # each expert's tile is read back per item below
    key = tl.sort(ids * NP + p)  # the items past n_items (expert E) sort after every expert
    j, idj = key % NP, key // NP  # the item at sorted position p, and its expert
    valid = idj < E
    t = tl.load(e_tile_ptr + idj, mask=valid, other=-1)
    on_dev = valid & (t >= 0)
    w = tl.load(w_ptr + j, mask=valid, other=0.0)
    token = j // K
    tl.store(tok_ptr + p, token, mask=on_dev)
    tl.store(sw_ptr + p, w, mask=on_dev)
    tl.store(dst_ptr + p, j, mask=on_dev)
    tl.store(gpos_ptr + j, tl.where(on_dev, j, -1), mask=valid)
    if HAS_CPU:
        _payload_items(payload_ptr, j, valid, w, base + idj.to(tl.int64), valid & (t < 0), token, XN, NMAX)
        _payload_x(payload_ptr, x_ptr, (n_items // K) * H, BLOCK_H)
        tl.store(payload_ptr + XN + 4 * NMAX, n_items * 1.0)


@triton.jit
def _merge(out_ptr, dev_ptr, host_ptr, gpos_ptr, H, K: tl.constexpr, HAS_DEV: tl.constexpr,
           HAS_CPU: tl.constexpr, BLOCK: tl.constexpr):
    h = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    t = tl.program_id(1)  # the token: its items are t * K ..
    hm = h < H
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(K):
        p = tl.load(gpos_ptr + t * K + i) + tl.zeros([BLOCK], tl.int32)
        host = host_ptr + (t * K + i) * H + h
        if HAS_DEV and HAS_CPU:
            dv = tl.load(dev_ptr + p * H + h, mask=hm & (p >= 0), other=0.0).to(tl.float32)
            hv = tl.load(host, mask=hm & (p < 0), other=0.0)
            acc += tl.where(p >= 0, dv, hv.to(out_ptr.dtype.element_ty).to(tl.float32))
        elif HAS_DEV:
            acc += tl.load(dev_ptr + p * H + h, mask=hm, other=0.0).to(tl.float32)
        else:
            acc += tl.load(host, mask=hm, other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=hm)


def _slots(cap: int) -> dict[str, int]:
    """The victim search's shape: CAP (cap rounded up to a power of two; 0: no cache) in blocks
    of SB, about its square root, so both levels stay short."""
    if not cap:
        return dict(CAP=0, SB=1)
    full = triton.next_power_of_2(cap)
    return dict(CAP=full, SB=1 << (full.bit_length() // 2))


class LayerBuffers:
    """What `plan` decides for one layer (allocated inside the step, so graph-safe)."""

    def __init__(self, k: int, device: torch.device, weight_dtype: torch.dtype):
        self.gslot = torch.empty(k, dtype=torch.int32, device=device)  # device work list: slots,
        self.gw = torch.empty(k, dtype=weight_dtype, device=device)  # router weights,
        self.grow = torch.empty(k, dtype=torch.int64, device=device)  # expert rows,
        self.gfill = torch.empty(k, dtype=torch.int32, device=device)  # 1: read from the host, fill the slot
        self.gpos = torch.empty(k, dtype=torch.int32, device=device)  # item -> work list index, -1: CPU
        self.gcount = torch.empty(2, dtype=torch.int32, device=device)  # valid work list entries, CPU items


class TokenBuffers:
    """What `plan_tokens` decides for one layer of up to `items` routed items over `experts`
    experts: the grouped GEMM's tiles (one per device expert) and its items sorted by expert."""

    def __init__(self, experts: int, items: int, device: torch.device):
        i32 = dict(dtype=torch.int32, device=device)
        self.tiles = torch.empty(3 * experts, **i32)  # (slot, first item, items) per tile
        self.tfill = torch.empty(experts, **i32)  # 1: the tile's expert is read from the host, filled
        self.trow = torch.empty(experts, dtype=torch.int64, device=device)  # the tile's expert row
        self.tokens = torch.empty(items, **i32)  # sorted items: token,
        self.weights = torch.empty(items, dtype=torch.float32, device=device)  # router weight,
        self.dst = torch.empty(items, **i32)  # item index (the row of the GEMM's output)
        self.gpos = torch.empty(items, **i32)  # item -> its GEMM output row (itself), -1: CPU
        self.gcount = torch.empty(2, **i32)  # valid tiles, CPU experts
        self.e_tile = torch.empty(experts, **i32)  # scratch: each expert's tile (-1: none)


def plan(ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, base: int, table: torch.Tensor,
         owner: torch.Tensor, stamp: torch.Tensor, clock: torch.Tensor, ratio: torch.Tensor, counts: torch.Tensor,
         out: LayerBuffers, payload, cap: int, mode: int, max_tokens: int = 1, num_warps: int = 8) -> None:
    """Decide one layer for one token (see the module docstring). ids, weights [k]; x [H];
    counts: this layer's int64 [3] (hits, fills, cpu); payload: the CPU worker's float32
    [worker_payload(max_tokens, k, H)] or None. Eight warps: the victim passes' argmin over
    the slots is the long part (H200, 537 slots, 4 fills: 4.8 us against 5.2 with four)."""
    k = ids.numel()
    _plan[(1,)](ids, weights, x, base, table, owner, stamp, clock, ratio, counts, out.gslot, out.gw, out.grow,
                out.gfill, out.gpos, out.gcount, payload if payload is not None else x, cap, x.numel(),
                max_tokens * x.numel(), max_tokens * k, K=k, KP=triton.next_power_of_2(k),
                **_slots(cap), MODE=mode, HAS_CPU=payload is not None, BLOCK_H=1024, num_warps=num_warps)


def plan_tokens(ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, base: int, experts: int,
                table: torch.Tensor, owner: torch.Tensor, stamp: torch.Tensor, clock: torch.Tensor,
                ratio: torch.Tensor, counts: torch.Tensor, fill_all_above: int, out: TokenBuffers, payload, cap: int,
                mode: int, max_tokens: int) -> None:
    """Decide one layer for T tokens (T <= max_tokens): ids, weights [T, k]; x [T, H]. The
    layer's `experts` experts are deduplicated across tokens: one decision per expert (misses
    most-used first; hybrid fills every miss when the items exceed `fill_all_above` per active
    expert), one GEMM tile per device expert, one CPU expert per CPU expert."""
    t, k = ids.shape
    nmax = max_tokens * k
    np_ = triton.next_power_of_2(nmax)
    _plan_tokens[(1,)](ids.reshape(-1), weights.reshape(-1), x, t * k, base, table, owner, stamp, clock, ratio,
                       counts, fill_all_above, out.e_tile, out.tiles, out.tfill, out.trow, out.tokens,
                       out.weights, out.dst, out.gpos, out.gcount, payload if payload is not None else x, cap,
                       x.shape[1], max_tokens * x.shape[1], nmax, E=experts, EP=triton.next_power_of_2(experts),
                       K=k, NP=np_, **_slots(cap), MODE=mode, HAS_CPU=payload is not None,
                       BLOCK_H=1024, num_warps=8)


def merge(dev: torch.Tensor | None, host, gpos: torch.Tensor, hidden: int, dtype: torch.dtype,
          tokens: int = 1, k: int | None = None) -> torch.Tensor:
    """[tokens, H]: per token t, the sum over its k items i (default k: all of gpos) of
    dev[gpos[t k + i]] (device results) or host[t k + i] (the CPU worker's float32 rows) where
    gpos is < 0."""
    k = k or gpos.numel()
    out = torch.empty((tokens, hidden), dtype=dtype, device=gpos.device)
    _merge[(triton.cdiv(hidden, 256), tokens)](out, dev if dev is not None else out,
                                               host if host is not None else out, gpos, hidden, K=k,
                                               HAS_DEV=dev is not None, HAS_CPU=host is not None, BLOCK=256)
    return out
