"""Block formats to float32 in torch: the exact reference every faster path is checked against."""

from __future__ import annotations

import torch

from ftkit.vocab import FORMATS, Q8_0


def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Raw q8_0 rows `[..., nblocks * 34]` (uint8) to float32 `[..., nblocks * 32]` (exact)."""
    lead = raw.shape[:-1]
    blocks = raw.reshape(-1, FORMATS[Q8_0].block_bytes)
    scale = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return (q * scale).reshape(*lead, -1)
