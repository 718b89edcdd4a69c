"""Qwen3.5-MoE's forward pass: Qwen3-Next's (qwen3_next_forward.py) with the DeltaNet's b and a
projected apart and, for a llama.cpp GGUF, the value heads in tiled order (qwen3_5_moe.py
describes both)."""

from __future__ import annotations

import torch

from .qwen3_5_moe import TILED
from .qwen3_next_forward import Qwen3NextDecoder


class Qwen3_5MoeDecoder(Qwen3NextDecoder):
    def __init__(self, spec, weights, experts):
        super().__init__(spec, weights, experts)
        self.tiled = spec.extra.get("linear_value_order") == TILED

    def _projections(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q|k|v channels [T, 2*Kd + Vd], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        p, t = f"layers.{i}.linear_attn.", x.shape[0]
        z = self.linear(p + "in_proj_z", x).view(t, self.hv, self.dv)
        return self.linear(p + "in_proj_qkv", x), z, self.linear(p + "in_proj_b", x), self.linear(p + "in_proj_a", x)

    def key_heads_per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiled:  # value head j*Hk + k reads key head k
            return x.repeat(1, self.hv // self.hk, 1)
        return super().key_heads_per_value_head(x)

    def step_kernels(self, x: torch.Tensor):
        # The fused step kernel maps value heads to key heads grouped; tiled ones take the torch ops.
        return None if self.tiled else super().step_kernels(x)
