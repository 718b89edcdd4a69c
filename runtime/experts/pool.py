"""The host expert pool: every routed expert in host memory, read from FTW. The source of truth."""

from __future__ import annotations

import torch

from ftkit.kernels.dequant import dequantize
from ftkit.vocab import BLOCK_FORMATS, ClampedSwiGLU, ExpertLayout, SlotLayout

from ..ftw.reader import FTWModel, HostBanks
from ..spec import ModelSpec


class HostPool:
    def __init__(self, spec: ModelSpec, banks: HostBanks):
        self.spec, self.banks = spec, banks
        self.layout: ExpertLayout = banks.layout  # each layer's slot layout, one slot size
        self._slots: dict[int, torch.Tensor] = {}  # row -> its view, made once (a slice costs microseconds)

    @classmethod
    def from_ftw(cls, model: FTWModel, pin: bool | None = None, threads: int = 8) -> HostPool:
        return cls(model.spec, model.read_banks(threads=threads, pin=pin))

    @property
    def pinned(self) -> bool:
        return self.banks.pinned

    @property
    def nbytes(self) -> int:
        return self.banks.nbytes

    def row(self, layer: int, expert: int) -> int:
        """`row = moe_index * E + expert` for model layer `layer`."""
        return self.spec.moe_index(layer) * self.spec.num_experts + expert

    def slot(self, row: int) -> torch.Tensor:
        """The uint8 bytes of one expert: what a fill copies."""
        view = self._slots.get(row)
        if view is None:
            view = self._slots[row] = self.banks.slot(row)
        return view


def expert_weights(layout: SlotLayout, slot: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The slot's parts in layout order (gate, up, down, then any biases) as `dtype` tensors;
    views when no conversion is needed."""
    out = []
    for p in layout.parts:
        t = p.view(slot)
        if p.dtype in BLOCK_FORMATS:  # exact, as the CPU kernel's float32 weights
            t = dequantize(t, p.dtype).reshape(p.shape)
        out.append(t if t.dtype == dtype else t.to(dtype))
    return tuple(out)


def expert_forward(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                   activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """One expert on x: down(act(x gate^T + gate_bias, x up^T + up_bias)) + down_bias, the
    biases where `weights` (expert_weights') has them, act SwiGLU or the clamped form. One
    function for every tier, so a result never depends on where the expert ran."""
    gate, up, down, *bias = weights
    g, u = x @ gate.T, x @ up.T
    if bias:
        g, u = g + bias[0], u + bias[1]
    if activation is None:
        h = torch.nn.functional.silu(g) * u
    else:
        g, u = g.clamp(max=activation.limit), u.clamp(-activation.limit, activation.limit)
        h = (u + 1) * (g * torch.sigmoid(g * activation.alpha))
    return torch.nn.functional.linear(h, down, bias[2] if bias else None)
