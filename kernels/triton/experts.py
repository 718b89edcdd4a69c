"""Grouped expert kernels over cache slots (Triton), reading each expert's weights straight from
its slot:
- decode: a grouped GEMV, every (token, expert) item of a step in two launches;
- prefill: a grouped GEMM, every resident expert of a layer in two launches, its tokens in tiles.

Decode runs a handful of tokens through a handful of experts per layer, and prefill runs
thousands of tokens through every expert: one launch per matrix per expert would spend more
time launching (and, from Python, more host time) than reading weights. Item i computes
    y[i] = weight[i] * down_s (silu(gate_s x_t) * (up_s x_t)),   s = slot[i], t = token[i]
with float32 accumulation; where the slot layout has biases and the clamped SwiGLU (gpt-oss),
    y[i] = weight[i] * (down_s act(gate_s x_t + gb_s, up_s x_t + ub_s) + db_s)
with act the clamped form (ftkit.vocab.ClampedSwiGLU), the biases read as float32.

The GEMV's work list has a fixed capacity and a valid count, so the same launch shapes serve
every step (a prerequisite for capturing decode in a CUDA graph). It can also fill slots as it
goes: an item flagged as a fill reads its gate and up matrices from mapped pinned host memory
(zero-copy, by a row address table) and writes each tile into the slot as it is read, while
extra programs of the same launch copy its down matrix across; the second launch reads down
from the slot. So a miss crosses PCIe once, the whole expert in one launch (two launches with
a gap between them reached ~42 GB/s), and the hits' work overlaps the transfer.

The GEMM takes the same two options for a multi-token step planned on the device: an optional
valid tile count (the grid is the tile list's capacity; tiles past the count do nothing) and
fill-through tiles, which leave their expert in its slot as the GEMV's fills do, but copy
their gate/up rows across in contiguous blocks before multiplying from the slot (host loads
inside the product loop moved 25-38 GB/s, the block copy ~50: docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftkit.kernels.triton import interpreting
from ftkit.kernels.triton.blocks import CODES, TYPED, lut, tile, weights, x256
from ftkit.vocab import SlotLayout, stored_nbytes

_TYPED = tl.constexpr(TYPED)  # as the kernels compare it

TORCH_FLOAT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GEMM_M = 128  # items (an expert's tokens) per prefill tile: the decode of a block's weights is shared by them
FILL_N = 32  # gate/up output columns of a GEMM tile when it may fill (the GEMV's width)
FILL_COPY = 2048  # elements a fill's copy program moves a step (2048-16384 read alike: H200, 8 misses)
# A GEMM launch's (output columns, reduction step, warps) by the format it decodes: the fastest
# of a sweep, H200, 4096 tokens through one layer under uniform routing (docs/benchmarks.md, BS).
# A block format's decode costs instructions per weight; its best tiles decode 16 weights a
# thread a step: gpt-oss-20b's MXFP4 10.3 ms, qwen3-30b-a3b's IQ4_XS 2.71 (from 214 and 142 at
# 64 items x 128 columns x 64 on 4 warps, levels gathered); bf16 1.74 ms on gpt-oss-20b (2.16).
_FLOAT_TILE = (128, 64, 8)
_TILES = {**{c: (64, 64, 8) for f, c in CODES.items() if f in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "mxfp4")},
          **{c: (64, 32, 4) for f, c in CODES.items() if f in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl",
                                                                "iq4_xs")}}


def gemm_tile(fmt: int, columns: int | None = None) -> dict:
    """The launch options of a GEMM kernel decoding format code `fmt` (TYPED: a float slot),
    `columns` output columns a tile where given."""
    n, k, warps = _TILES.get(fmt, _FLOAT_TILE)
    return dict(BLOCK_M=GEMM_M, BLOCK_N=columns or n, BLOCK_K=k, num_warps=warps, num_stages=3)


@triton.jit
def _source(w_ptr, slot, fill_ptr, row_ptr, addr_ptr, i, slot_elems, FILL: tl.constexpr):
    """(where item (or tile) i's expert is read from, its slot `slot`, whether to write what is
    read into the slot)."""
    dst = w_ptr + slot.to(tl.int64) * slot_elems
    src = dst
    copy = False
    if FILL:
        copy = tl.load(fill_ptr + i) != 0
        if copy:
            src = tl.load(addr_ptr + tl.load(row_ptr + i)).to(tl.pointer_type(w_ptr.dtype.element_ty))
    return src, dst, copy


@triton.jit
def _copy_span(src, dst, lo, hi, BLOCK: tl.constexpr):
    """Elements lo..hi-1 from src to dst, in contiguous blocks (PCIe reads stream best so)."""
    for o in range(lo, hi, BLOCK):
        e = o + tl.arange(0, BLOCK)
        tl.store(dst + e, tl.load(src + e, mask=e < hi), mask=e < hi)


@triton.jit
def _copy_down(src, dst, down_off, total, p, COPY_PROGS: tl.constexpr, COPY_BLOCK: tl.constexpr):
    """Copy program p's share (of COPY_PROGS) of a fill's down matrix and the biases after it
    (`total` elements from down's start) into its slot, so PCIe streams the whole expert in the
    gate/up launch; the down launch reads the slot."""
    chunk = tl.cdiv(tl.cdiv(total, COPY_PROGS), COPY_BLOCK) * COPY_BLOCK
    lo = p * chunk
    _copy_span(src + down_off, dst + down_off, lo, tl.minimum(lo + chunk, total), COPY_BLOCK)


@triton.jit
def _copy_rows(src, dst, up_off, g_row, u_row, n0, I, BLOCK_N: tl.constexpr, COPY_BLOCK: tl.constexpr):  # noqa: E741
    """Copy gate and up rows n0..n0+BLOCK_N-1 (of I; `g_row`, `u_row` bytes each) of a fill from
    the host into its slot in contiguous blocks, then give the slot to read them from: block
    formats are decoded from gathered bytes, which over PCIe would each be a round trip (the
    float path's loads inside the product loop moved ~25 GB/s, block copies ~50)."""
    hi = tl.minimum(n0 + BLOCK_N, I)
    _copy_span(src, dst, n0 * g_row, hi * g_row, COPY_BLOCK)
    _copy_span(src + up_off, dst + up_off, n0 * u_row, hi * u_row, COPY_BLOCK)
    tl.debug_barrier()  # every thread's part of the rows is in the slot
    return dst


@triton.jit
def _bias(base, off, idx, mask):
    """Float32 biases at element `off` (of the slot's dtype) from `base`, at indices idx."""
    return tl.load((base + off).to(tl.pointer_type(tl.float32), bitcast=True) + idx, mask=mask, other=0.0)


@triton.jit
def _act(g, u, CLAMP: tl.constexpr, alpha, limit):
    """silu(g) * u, or gpt-oss's clamped SwiGLU (transformers' order of operations)."""
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return (u + 1.0) * (g / (1.0 + tl.exp(-g * alpha)))
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _gate_up(x_ptr, w_ptr, slot_ptr, tok_ptr, count_ptr, fill_ptr, row_ptr, addr_ptr, h_ptr, H, I,  # noqa: E741 (I: the FFN width)
             slot_elems, up_off, down_off, tail, n_gu, gb_off, ub_off, alpha, limit, g_row, u_row, lut_ptr,
             FILL: tl.constexpr, BIAS: tl.constexpr, CLAMP: tl.constexpr, FMT_G: tl.constexpr, FMT_U: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COPY_PROGS: tl.constexpr, COPY_BLOCK: tl.constexpr):
    i = tl.program_id(0)
    if i >= tl.load(count_ptr):
        return
    src, dst, copy = _source(w_ptr, tl.load(slot_ptr + i), fill_ptr, row_ptr, addr_ptr, i, slot_elems, FILL)
    if FILL and tl.program_id(1) >= n_gu:  # the programs past the gate/up tiles copy a fill's down matrix
        if copy:
            _copy_down(src, dst, down_off, tail, tl.program_id(1) - n_gu, COPY_PROGS, COPY_BLOCK)
        return
    t = tl.load(tok_ptr + i).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    rows = src  # where the gate and up rows are read (a fill's biases stay read from the host:
    # the copy programs may not have moved them yet)
    if FMT_G != _TYPED and copy:  # a fill's block rows cross first, then are decoded from the slot
        rows = _copy_rows(src, dst, up_off, g_row, u_row, tl.program_id(1) * BLOCK_N, I, BLOCK_N, COPY_BLOCK)
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    if FMT_G == _TYPED:
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < H
            xv = tl.load(x_ptr + t * H + k, mask=kmask, other=0.0).to(tl.float32)
            m2 = nmask[:, None] & kmask[None, :]
            offs = n[:, None] * H + k[None, :]
            g = tl.load(src + offs, mask=m2, other=0.0)
            u = tl.load(src + up_off + offs, mask=m2, other=0.0)
            if copy:  # float slots: a fill stores each tile into its slot as it is read
                tl.store(dst + offs, g, mask=m2)
                tl.store(dst + up_off + offs, u, mask=m2)
            acc_g += tl.sum(g.to(tl.float32) * xv[None, :], axis=1)
            acc_u += tl.sum(u.to(tl.float32) * xv[None, :], axis=1)
    else:  # blocks: 256 weights of a row at a time, [rows, 8, 32]
        for kb in range(0, tl.cdiv(H, 256)):
            xv = x256(x_ptr + t * H, kb, H)
            acc_g += tl.sum(tl.sum(tile(rows, n, kb, nmask, H, FMT_G, lut_ptr) * xv, axis=2), axis=1)
            acc_u += tl.sum(tl.sum(tile(rows + up_off, n, kb, nmask, H, FMT_U, lut_ptr) * xv, axis=2), axis=1)
    if BIAS:  # from where the weights came (a fill's biases reach its slot through _copy_down)
        acc_g += _bias(src, gb_off, n, nmask)
        acc_u += _bias(src, ub_off, n, nmask)
    h = _act(acc_g, acc_u, CLAMP, alpha, limit)
    tl.store(h_ptr + i * I + n, h, mask=nmask)


@triton.jit
def _down(h_ptr, w_ptr, slot_ptr, wt_ptr, count_ptr, y_ptr, H, I,  # noqa: E741
          slot_elems, down_off, db_off, lut_ptr, BIAS: tl.constexpr, FMT_D: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_K: tl.constexpr):
    i = tl.program_id(0)
    if i >= tl.load(count_ptr):
        return
    src = w_ptr + tl.load(slot_ptr + i).to(tl.int64) * slot_elems  # fills are in their slots by now
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < H
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    if FMT_D == _TYPED:
        for k0 in range(0, I, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < I
            hv = tl.load(h_ptr + i * I + k, mask=kmask, other=0.0)
            d = tl.load(src + down_off + m[:, None] * I + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            acc += tl.sum(d.to(tl.float32) * hv[None, :], axis=1)
    else:
        for kb in range(0, tl.cdiv(I, 256)):
            hv = x256(h_ptr + i * I, kb, I)
            acc += tl.sum(tl.sum(tile(src + down_off, m, kb, mmask, I, FMT_D, lut_ptr) * hv, axis=2), axis=1)
    if BIAS:
        acc += _bias(src, db_off, m, mmask)
    w = tl.load(wt_ptr + i).to(tl.float32)
    tl.store(y_ptr + i * H + m, (acc * w).to(y_ptr.dtype.element_ty), mask=mmask)


def _slot_view(slots: torch.Tensor, layout: SlotLayout) -> tuple[torch.Tensor, int]:
    """The slots as the pointer the kernels take, and its element size: the layout's float dtype
    where gate, up and down share one, else bytes (the parts decoded by their format codes)."""
    if any(f not in CODES for f in layout.formats):
        raise ValueError(f"grouped expert kernels do not read {layout.dtype} slots")
    if layout.dtype in TORCH_FLOAT:
        dt = TORCH_FLOAT[layout.dtype]
        return slots.view(dt), torch.empty((), dtype=dt).element_size()
    return slots, 1


def _expert_fn(layout: SlotLayout, esize: int) -> dict:
    """The kernels' arguments for what the layout computes: each part's format code (TYPED for
    a float slot read as its dtype) and row length in the pointer's elements, the biases'
    element offsets and the clamped SwiGLU's constants, the elements a fill copies from down's
    start (down and the biases after it)."""
    last = layout.parts[-1]
    gate, up, down = layout.parts[:3]
    typed = esize > 1
    out = dict(BIAS=layout.biased, CLAMP=layout.activation is not None,
               alpha=layout.activation.alpha if layout.activation else 1.0,
               limit=layout.activation.limit if layout.activation else 0.0,
               tail=(last.offset + last.nbytes - down.offset) // esize,
               g_row=gate.shape[1] if typed else stored_nbytes(gate.dtype, gate.shape[1:]),
               u_row=up.shape[1] if typed else stored_nbytes(up.dtype, up.shape[1:]))
    for name, part in (("FMT_G", gate), ("FMT_U", up), ("FMT_D", down)):
        out[name] = TYPED if typed else CODES[part.dtype]
    for name in ("gate_bias", "up_bias", "down_bias"):
        out[name[0] + "b_off"] = layout.part(name).offset // esize if layout.biased else 0
    return out


def grouped_expert_gemv(
    x: torch.Tensor,
    slots: torch.Tensor,
    layout: SlotLayout,
    slot_ids: torch.Tensor,
    token_ids: torch.Tensor,
    weights: torch.Tensor,
    count: torch.Tensor,
    fills: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    copy_block: int = FILL_COPY,
    block_n: int = 32,
) -> torch.Tensor:
    """Weighted expert outputs [N, H] for work items 0..count-1 (rows past `count` untouched).

    x [T, H]; slots [C, slot_bytes] uint8; slot_ids, token_ids int32 [N]; weights [N];
    count: int32 [1] on the device (the valid number of items). `fills`: (flags int32 [N],
    rows int64 [N], addr int64 [rows]): items with a flag read row `rows[i]` from the host
    address `addr[rows[i]]` and copy it into their slot on the way, `copy_block` elements a
    step; `block_n`: gate/up rows a program (a fill has as many copy programs as row tiles; the
    fills bench sweeps both).
    """
    w, esize = _slot_view(slots, layout)
    gate, up, down = layout.parts[:3]
    fn = _expert_fn(layout, esize)
    i_dim, h_dim = gate.shape
    n = slot_ids.numel()
    h = torch.empty((n, i_dim), dtype=torch.float32, device=x.device)
    y = torch.empty((n, h_dim), dtype=x.dtype, device=x.device)
    x, table = x.contiguous(), lut(x.device)
    slot_elems = layout.slot_bytes // esize
    flag, rows, addr = fills if fills is not None else (slot_ids, slot_ids, slot_ids)
    n_gu = triton.cdiv(i_dim, block_n)
    copy_progs = n_gu if fills is not None else 0  # as many as read gate/up: the down third in step
    _gate_up[(n, n_gu + copy_progs)](x, w, slot_ids, token_ids, count, flag, rows, addr, h, h_dim, i_dim,
                                      slot_elems, up.offset // esize, down.offset // esize, fn["tail"], n_gu,
                                      fn["gb_off"], fn["ub_off"], fn["alpha"], fn["limit"], fn["g_row"],
                                      fn["u_row"], table, FILL=fills is not None, BIAS=fn["BIAS"],
                                      CLAMP=fn["CLAMP"], FMT_G=fn["FMT_G"], FMT_U=fn["FMT_U"], BLOCK_N=block_n,
                                      BLOCK_K=128, COPY_PROGS=max(copy_progs, 1), COPY_BLOCK=copy_block)
    grid = (n, triton.cdiv(h_dim, 32))
    _down[grid](h, w, slot_ids, weights, count, y, h_dim, i_dim, slot_elems, down.offset // esize, fn["db_off"],
                table, BIAS=fn["BIAS"], FMT_D=fn["FMT_D"], BLOCK_M=32, BLOCK_K=128)
    return y


@triton.jit
def _tile(tile_ptr, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile: (its expert's slot, first item, item lanes, their mask, output
    columns, their mask)."""
    tile = tile_ptr + 3 * tl.program_id(0)
    first, rows = tl.load(tile + 1), tl.load(tile + 2)
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(tile), first, m, m < rows, n, n < N


@triton.jit
def _gemm_gate_up(x_ptr, w_ptr, tile_ptr, tok_ptr, count_ptr, fill_ptr, row_ptr, addr_ptr, h_ptr, H, I,  # noqa: E741
                  slot_elems, up_off, down_off, tail, gb_off, ub_off, alpha, limit, g_row, u_row,
                  COUNT: tl.constexpr, FILL: tl.constexpr, BIAS: tl.constexpr, CLAMP: tl.constexpr,
                  FMT_G: tl.constexpr, FMT_U: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COPY_PROGS: tl.constexpr,
                  COPY_BLOCK: tl.constexpr):
    t = tl.program_id(0)
    if COUNT:
        if t >= tl.load(count_ptr):  # past the valid tiles (whose fields may be garbage)
            return
    slot, first, m, mmask, n, nmask = _tile(tile_ptr, I, BLOCK_M, BLOCK_N)
    gate, dst, copy = _source(w_ptr, slot, fill_ptr, row_ptr, addr_ptr, t, slot_elems, FILL)
    src = gate  # a fill's biases are read from the host: the copy programs may not have moved them yet
    n_gu = tl.cdiv(I, BLOCK_N)
    if FILL and tl.program_id(1) >= n_gu:  # the programs past the gate/up tiles copy a fill's down matrix
        if copy:
            _copy_down(gate, dst, down_off, tail, tl.program_id(1) - n_gu, COPY_PROGS, COPY_BLOCK)
        return
    if copy:  # a fill: this program's gate and up rows cross PCIe first, the products read the slot
        gate = _copy_rows(gate, dst, up_off, g_row, u_row, tl.program_id(1) * BLOCK_N, I, BLOCK_N, COPY_BLOCK)
    tok = tl.load(tok_ptr + first + m, mask=mmask, other=0).to(tl.int64)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < H
        xt = tl.load(x_ptr + tok[:, None] * H + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & nmask[None, :]  # [BLOCK_K, BLOCK_N]: the weight rows, transposed
        if FMT_G == _TYPED:
            g = tl.load(gate + n[None, :] * H + k[:, None], mask=wmask, other=0.0)
            u = tl.load(gate + up_off + n[None, :] * H + k[:, None], mask=wmask, other=0.0)
        else:  # decoded, then multiplied in the activations' dtype
            g = weights(gate, n[None, :], k[:, None], wmask, H, FMT_G, None).to(xt.dtype)
            u = weights(gate + up_off, n[None, :], k[:, None], wmask, H, FMT_U, None).to(xt.dtype)
        if UPCAST:
            xt, g, u = xt.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(xt, g, acc_g, input_precision=PREC)
        acc_u = tl.dot(xt, u, acc_u, input_precision=PREC)
    if BIAS:
        acc_g += _bias(src, gb_off, n, nmask)[None, :]
        acc_u += _bias(src, ub_off, n, nmask)[None, :]
    h = _act(acc_g, acc_u, CLAMP, alpha, limit)
    out = h_ptr + (first + m)[:, None].to(tl.int64) * I + n[None, :]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _gemm_down(h_ptr, w_ptr, tile_ptr, count_ptr, dst_ptr, wt_ptr, y_ptr, H, I, slot_elems, down_off,  # noqa: E741
               db_off, COUNT: tl.constexpr, BIAS: tl.constexpr, FMT_D: tl.constexpr, PREC: tl.constexpr,
               UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if COUNT:
        if tl.program_id(0) >= tl.load(count_ptr):
            return
    slot, first, m, mmask, n, nmask = _tile(tile_ptr, H, BLOCK_M, BLOCK_N)
    base = w_ptr + slot.to(tl.int64) * slot_elems  # fills are in their slots by now
    down = base + down_off
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < I
        ht = tl.load(h_ptr + (first + m)[:, None].to(tl.int64) * I + k[None, :], mask=mmask[:, None] & kmask[None, :],
                     other=0.0)
        wmask = kmask[:, None] & nmask[None, :]
        if FMT_D == _TYPED:
            d = tl.load(down + n[None, :] * I + k[:, None], mask=wmask, other=0.0)
        else:
            d = weights(down, n[None, :], k[:, None], wmask, I, FMT_D, None).to(ht.dtype)
        if UPCAST:
            ht, d = ht.to(tl.float32), d.to(tl.float32)
        acc = tl.dot(ht, d, acc, input_precision=PREC)
    if BIAS:
        acc += _bias(base, db_off, n, nmask)[None, :]
    wt = tl.load(wt_ptr + first + m, mask=mmask, other=0.0).to(tl.float32)
    dst = tl.load(dst_ptr + first + m, mask=mmask, other=0).to(tl.int64)
    out = y_ptr + dst[:, None] * H + n[None, :]
    tl.store(out, (acc * wt[:, None]).to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def gemm_tiles(segments: list[tuple[int, int]]) -> list[int]:
    """Flat (slot, first item, items) triples covering each (slot, items) segment of a work list
    sorted by expert, at most GEMM_M items per tile."""
    out, first = [], 0
    for slot, n in segments:
        for m0 in range(0, n, GEMM_M):
            out += [slot, first + m0, min(GEMM_M, n - m0)]
        first += n
    return out


def grouped_expert_gemm(x: torch.Tensor, slots: torch.Tensor, layout: SlotLayout, tiles: torch.Tensor,
                        tokens: torch.Tensor, dst: torch.Tensor, weights: torch.Tensor, y: torch.Tensor,
                        count: torch.Tensor | None = None,
                        fills: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                        copy_block: int = FILL_COPY) -> None:
    """y[dst[i]] = weights[i] * expert_{slot(i)}(x[tokens[i]]) for every item i of every valid tile.

    x [T, H]; slots [C, slot_bytes] uint8; tiles int32 [n * 3] from `gemm_tiles` (items sorted
    by expert); tokens, dst int32 [N] (dst: the row of y, distinct per item); weights [N]; y [R, H].
    count: None (every tile valid) or int32 [1] on the device, the valid number of tiles (the
    rest are skipped unread; y's rows of their items are untouched). `fills`: (flags int32 [n],
    rows int64 [n], addr int64 [rows]): a flagged tile reads its expert from the host address
    `addr[rows[t]]` and copies it into its slot on the way (`copy_block`: as the GEMV's). No host
    synchronisation either way.
    """
    w, esize = _slot_view(slots, layout)
    gate, up, down = layout.parts[:3]
    fn = _expert_fn(layout, esize)
    i_dim, h_dim = gate.shape
    n_tiles = tiles.numel() // 3
    if not n_tiles:
        return
    h = torch.empty((tokens.numel(), i_dim), dtype=x.dtype, device=x.device)
    slot_elems = layout.slot_bytes // esize
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 must stay exact enough to match the CPU
    # tl.dot takes one dtype: a float32 runtime over 16-bit slots multiplies in float32. Triton's
    # interpreter (CPU tests) multiplies 16-bit tiles wrongly in tl.dot (3.9): upcast there too.
    # Block slots are decoded into the activations' dtype.
    upcast = (esize > 1 and x.dtype != w.dtype) or (interpreting() and x.dtype != torch.float32)
    cfg = dict(COUNT=count is not None, PREC=prec, UPCAST=upcast)
    count = count if count is not None else tiles
    flag, rows, addr = fills if fills is not None else (tiles, tiles, tiles)
    # Reads over PCIe need many in flight: with fills, narrower gate/up tiles give each filled
    # expert as many reading programs as the GEMV's (a few fills per layer in an extend; at 128
    # columns each had 6 readers and 6 copiers, and the split moved its misses to the CPU)
    gu = dict(cfg, **gemm_tile(fn["FMT_G"], FILL_N if fills is not None else None))
    n_gu = triton.cdiv(i_dim, gu["BLOCK_N"])
    copy_progs = n_gu if fills is not None else 0  # as in the GEMV: the down third alongside gate/up
    x = x.contiguous()
    _gemm_gate_up[(n_tiles, n_gu + copy_progs)](x, w, tiles, tokens, count, flag, rows, addr, h, h_dim, i_dim,
                                                slot_elems, up.offset // esize, down.offset // esize, fn["tail"],
                                                fn["gb_off"], fn["ub_off"], fn["alpha"], fn["limit"], fn["g_row"],
                                                fn["u_row"], FILL=fills is not None, BIAS=fn["BIAS"],
                                                CLAMP=fn["CLAMP"], FMT_G=fn["FMT_G"], FMT_U=fn["FMT_U"],
                                                COPY_PROGS=max(copy_progs, 1), COPY_BLOCK=copy_block, **gu)
    dn = dict(cfg, **gemm_tile(fn["FMT_D"]))
    _gemm_down[(n_tiles, triton.cdiv(h_dim, dn["BLOCK_N"]))](h, w, tiles, count, dst, weights, y, h_dim, i_dim,
                                                             slot_elems, down.offset // esize, fn["db_off"],
                                                             BIAS=fn["BIAS"], FMT_D=fn["FMT_D"], **dn)
