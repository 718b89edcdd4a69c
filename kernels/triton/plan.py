"""One decode layer's expert plan and merge, each in a single Triton program.

The same decisions as torch tensor ops cost some thirty tiny kernels per layer, and in a CUDA
graph each still costs a few microseconds: at 12-48 layers a token that adds up to milliseconds.
`plan` makes every decision of `DevicePlan` in one program over the k routed items:
- hit: the row's residency table entry is a slot;
- the first q misses in top-k order are filled (q = m for offload, 0 for cpu, round(m * ratio)
  with at least one for hybrid), the others run on the CPU;
- victims: for each fill in turn, the least recently stamped slot that no hit of this layer
  holds and no earlier fill took; table, owner and stamps are updated in place;
- it writes the device work list (hits and fills, compacted, with a valid count; each entry's
  slot, router weight, row and fill flag: the grouped GEMV fills as it reads), the CPU payload (x, weights, rows, CPU flags as float32) and the layer's counters.
`merge` sums the k weighted expert outputs per hidden channel in top-k order, each taken from
the device GEMV or from the CPU worker's mapped output buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

OFFLOAD_MODE, CPU_MODE, HYBRID_MODE = 0, 1, 2
NEVER = tl.constexpr(2**62)  # stamp of a slot this layer may not evict


@triton.jit
def _plan(ids_ptr, w_ptr, x_ptr, base, table_ptr, owner_ptr, stamp_ptr, clock_ptr, ratio_ptr, counts_ptr,
          gslot_ptr, gw_ptr, grow_ptr, gfill_ptr, gpos_ptr, gcount_ptr, payload_ptr, cap, H,
          K: tl.constexpr, KP: tl.constexpr, CAP: tl.constexpr, MODE: tl.constexpr, HAS_CPU: tl.constexpr,
          BLOCK_H: tl.constexpr):
    j = tl.arange(0, KP)
    valid = j < K
    rows = base + tl.load(ids_ptr + j, mask=valid, other=0).to(tl.int64)
    if CAP > 0:
        slot = tl.load(table_ptr + rows, mask=valid, other=-1)
    else:
        slot = tl.full([KP], -1, tl.int32)
    hit = valid & (slot >= 0)
    miss = valid & (slot < 0)
    miss_i = miss.to(tl.int32)
    m = tl.sum(miss_i, axis=0)
    rank = tl.cumsum(miss_i, axis=0) - 1
    if MODE == 0:
        q = m
    elif MODE == 1:
        q = m * 0
    else:
        q = tl.minimum(tl.maximum((m.to(tl.float32) * tl.load(ratio_ptr) + 0.5).to(tl.int32), 1), m)
    fill = miss & (rank < q)
    on_cpu = miss & (rank >= q)
    if CAP > 0:
        c = tl.arange(0, CAP)
        stamps = tl.load(stamp_ptr + c, mask=c < cap, other=NEVER)
        held = tl.sum(((c[:, None] == slot[None, :]) & hit[None, :]).to(tl.int32), axis=1)
        stamps = tl.where(held > 0, NEVER, stamps)  # the slots this layer's hits use
        for r in range(0, q):  # the r-th fill takes the oldest slot still free to take (q passes, not k)
            v = tl.argmin(stamps, axis=0).to(tl.int32)
            stamps = tl.where(c == v, NEVER, stamps)
            slot = tl.where(fill & (rank == r), v, slot)
        old = tl.load(owner_ptr + slot, mask=fill, other=-1)
        tl.store(table_ptr + old, -1, mask=fill & (old >= 0))
        tl.store(table_ptr + rows, slot, mask=fill)
        tl.store(owner_ptr + slot, rows.to(tl.int32), mask=fill)
        clock = tl.load(clock_ptr) + 1
        tl.store(clock_ptr, clock)
        tl.store(stamp_ptr + slot, tl.zeros([KP], tl.int64) + clock, mask=hit | fill)
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
    tl.store(counts_ptr, tl.load(counts_ptr) + tl.sum(hit.to(tl.int64), axis=0))
    tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + tl.sum(fill.to(tl.int64), axis=0))
    tl.store(counts_ptr + 2, tl.load(counts_ptr + 2) + tl.sum(on_cpu.to(tl.int64), axis=0))
    if HAS_CPU:
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            tl.store(payload_ptr + h, tl.load(x_ptr + h, mask=h < H).to(tl.float32), mask=h < H)
        tl.store(payload_ptr + H + j, w.to(tl.float32), mask=valid)
        tl.store(payload_ptr + H + K + j, rows.to(tl.float32), mask=valid)
        tl.store(payload_ptr + H + 2 * K + j, on_cpu.to(tl.float32), mask=valid)


@triton.jit
def _merge(out_ptr, dev_ptr, host_ptr, gpos_ptr, H, K: tl.constexpr, HAS_DEV: tl.constexpr,
           HAS_CPU: tl.constexpr, BLOCK: tl.constexpr):
    h = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    hm = h < H
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(K):
        p = tl.load(gpos_ptr + i) + tl.zeros([BLOCK], tl.int32)
        if HAS_DEV and HAS_CPU:
            dv = tl.load(dev_ptr + p * H + h, mask=hm & (p >= 0), other=0.0).to(tl.float32)
            hv = tl.load(host_ptr + i * H + h, mask=hm & (p < 0), other=0.0)
            acc += tl.where(p >= 0, dv, hv.to(out_ptr.dtype.element_ty).to(tl.float32))
        elif HAS_DEV:
            acc += tl.load(dev_ptr + p * H + h, mask=hm, other=0.0).to(tl.float32)
        else:
            acc += tl.load(host_ptr + i * H + h, mask=hm, other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + h, acc.to(out_ptr.dtype.element_ty), mask=hm)


class LayerBuffers:
    """What `plan` decides for one layer (allocated inside the step, so graph-safe)."""

    def __init__(self, k: int, device: torch.device, weight_dtype: torch.dtype):
        self.gslot = torch.empty(k, dtype=torch.int32, device=device)  # device work list: slots,
        self.gw = torch.empty(k, dtype=weight_dtype, device=device)  # router weights,
        self.grow = torch.empty(k, dtype=torch.int64, device=device)  # expert rows,
        self.gfill = torch.empty(k, dtype=torch.int32, device=device)  # 1: read from the host, fill the slot
        self.gpos = torch.empty(k, dtype=torch.int32, device=device)  # item -> work list index, -1: CPU
        self.gcount = torch.empty(2, dtype=torch.int32, device=device)  # valid work list entries, CPU items


def plan(ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, base: int, table: torch.Tensor,
         owner: torch.Tensor, stamp: torch.Tensor, clock: torch.Tensor, ratio: torch.Tensor, counts: torch.Tensor,
         out: LayerBuffers, payload, cap: int, mode: int) -> None:
    """Decide one layer for one token (see the module docstring). ids, weights [k]; x [H];
    counts: this layer's int64 [3] (hits, fills, cpu); payload: float32 [H + 3k] or None."""
    k = ids.numel()
    _plan[(1,)](ids, weights, x, base, table, owner, stamp, clock, ratio, counts, out.gslot, out.gw, out.grow,
                out.gfill, out.gpos, out.gcount, payload if payload is not None else x, cap, x.numel(),
                K=k, KP=triton.next_power_of_2(k), CAP=triton.next_power_of_2(cap) if cap else 0, MODE=mode,
                HAS_CPU=payload is not None, BLOCK_H=1024)


def merge(dev: torch.Tensor | None, host, gpos: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, H]: sum over the k items of dev[gpos[i]] (device results, compacted) or host[i]
    (the CPU worker's float32 rows) where gpos[i] < 0."""
    k = gpos.numel()
    out = torch.empty((1, hidden), dtype=dtype, device=gpos.device)
    _merge[(triton.cdiv(hidden, 256),)](out, dev if dev is not None else out, host if host is not None else out,
                                        gpos, hidden, K=k, HAS_DEV=dev is not None, HAS_CPU=host is not None,
                                        BLOCK=256)
    return out
