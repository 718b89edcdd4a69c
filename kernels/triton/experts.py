"""Grouped expert GEMV over cache slots (Triton): every (token, expert) item of a decode step in
two launches, reading each expert's weights straight from its slot.

Decode runs a handful of tokens through a handful of experts per layer; one launch per matrix
per expert would spend more time launching than reading weights. Item i computes
    y[i] = weight[i] * down_s (silu(gate_s x_t) * (up_s x_t)),   s = slot[i], t = token[i]
with float32 accumulation. The work list has a fixed capacity and a valid count, so the same
launch shapes serve every step (a prerequisite for capturing decode in a CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftkit.runtime.ftw.manifest import SlotLayout

TORCH_FLOAT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@triton.jit
def _gate_up(x_ptr, w_ptr, slot_ptr, tok_ptr, count_ptr, h_ptr, H, I, slot_elems, up_off,  # noqa: E741 (I: the FFN width)
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    i = tl.program_id(0)
    if i >= tl.load(count_ptr):
        return
    s = tl.load(slot_ptr + i).to(tl.int64)
    t = tl.load(tok_ptr + i).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    gate = w_ptr + s * slot_elems
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < H
        xv = tl.load(x_ptr + t * H + k, mask=kmask, other=0.0).to(tl.float32)
        offs = n[:, None] * H + k[None, :]
        m2 = nmask[:, None] & kmask[None, :]
        g = tl.load(gate + offs, mask=m2, other=0.0).to(tl.float32)
        u = tl.load(gate + up_off + offs, mask=m2, other=0.0).to(tl.float32)
        acc_g += tl.sum(g * xv[None, :], axis=1)
        acc_u += tl.sum(u * xv[None, :], axis=1)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + i * I + n, h, mask=nmask)


@triton.jit
def _down(h_ptr, w_ptr, slot_ptr, wt_ptr, count_ptr, y_ptr, H, I, slot_elems, down_off,  # noqa: E741
          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    i = tl.program_id(0)
    if i >= tl.load(count_ptr):
        return
    s = tl.load(slot_ptr + i).to(tl.int64)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < H
    down = w_ptr + s * slot_elems + down_off
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < I
        hv = tl.load(h_ptr + i * I + k, mask=kmask, other=0.0)
        d = tl.load(down + m[:, None] * I + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(d.to(tl.float32) * hv[None, :], axis=1)
    w = tl.load(wt_ptr + i).to(tl.float32)
    tl.store(y_ptr + i * H + m, (acc * w).to(y_ptr.dtype.element_ty), mask=mmask)


def grouped_expert_gemv(
    x: torch.Tensor,
    slots: torch.Tensor,
    layout: SlotLayout,
    slot_ids: torch.Tensor,
    token_ids: torch.Tensor,
    weights: torch.Tensor,
    count: torch.Tensor,
) -> torch.Tensor:
    """Weighted expert outputs [N, H] for work items 0..count-1 (rows past `count` untouched).

    x [T, H]; slots [C, slot_bytes] uint8; slot_ids, token_ids int32 [N]; weights [N];
    count: int32 [1] on the device (the valid number of items).
    """
    if layout.dtype not in TORCH_FLOAT:
        raise ValueError(f"grouped GEMV reads float slots, not {layout.dtype}")
    dt = TORCH_FLOAT[layout.dtype]
    esize = torch.empty((), dtype=dt).element_size()
    gate, up, down = layout.parts
    i_dim, h_dim = gate.shape
    w = slots.view(dt)  # [C, slot_bytes / esize]
    n = slot_ids.numel()
    h = torch.empty((n, i_dim), dtype=torch.float32, device=x.device)
    y = torch.empty((n, h_dim), dtype=x.dtype, device=x.device)
    x = x.contiguous()
    slot_elems = layout.slot_bytes // esize
    grid = (n, triton.cdiv(i_dim, 32))
    _gate_up[grid](x, w, slot_ids, token_ids, count, h, h_dim, i_dim, slot_elems, up.offset // esize,
                   BLOCK_N=32, BLOCK_K=128)
    grid = (n, triton.cdiv(h_dim, 32))
    _down[grid](h, w, slot_ids, weights, count, y, h_dim, i_dim, slot_elems, down.offset // esize,
                BLOCK_M=32, BLOCK_K=128)
    return y
