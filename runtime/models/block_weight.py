"""A dense weight kept in its GGUF blocks on the GPU (FTW v3 stores a GGUF's dense tensors so):
the embedding table and lm_head, the largest dense tensors of a model (two of 151936 x 2048 in
Qwen3-30B-A3B: 1.2 GB at bfloat16, 0.43 GB as Q4_K_M's Q4_K and Q6_K), decoded where they are
used instead of dequantized once at load.

The values are those of dequantizing (kernels/dequant.py, bit for bit the gguf package's): an
embedding row is dequantized and cast to the compute dtype, as loading a dequantized table gave;
one token's product decodes the blocks in registers (kernels/triton/gemv.py's `block_gemv`,
float32 weights and sums, one rounding); several tokens' products dequantize the weight a slice
of rows at a time, cast, and multiply with cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ftkit.kernels.dequant import dequantize
from ftkit.kernels.triton import optional

SLICE_WEIGHTS = 1 << 24  # weights dequantized at once by a many-token product: 64 MB of float32


@dataclass(frozen=True)
class BlockWeight:
    raw: torch.Tensor  # uint8 [rows, bytes a row]: the rows in their blocks, as stored
    fmt: str  # the block format (ftkit.vocab.BLOCK_FORMATS)
    shape: tuple[int, int]  # the logical [rows, columns]
    dtype: torch.dtype  # what rows and products come out as: the compute dtype

    def __post_init__(self) -> None:
        self.rows(torch.zeros(1, dtype=torch.long, device=self.device))  # what a decoder keeps a device
        # (IQ4's and e2m1's level tables) exists before a CUDA graph captures a lookup

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """F.embedding(ids, the dequantized table): only the rows asked for are decoded."""
        return dequantize(self.raw[ids], self.fmt).to(self.dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., columns] times the weight (plus bias), in x's dtype."""
        n, k = self.shape
        gemv = optional("gemv")
        if x.is_cuda and x.numel() == k and x.is_contiguous() and gemv is not None:
            return gemv.block_gemv(x, self.raw, self.fmt, n, k, bias)
        step = max(1, SLICE_WEIGHTS // k)
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
        for a in range(0, n, step):
            w = dequantize(self.raw[a : a + step], self.fmt).to(x.dtype)
            out[..., a : a + step] = F.linear(x, w, None if bias is None else bias[a : a + step])
        return out


def embed_rows(ids: torch.Tensor, table: torch.Tensor | BlockWeight) -> torch.Tensor:
    """The rows of an embedding table, a float tensor or one kept in blocks."""
    return table.rows(ids) if isinstance(table, BlockWeight) else F.embedding(ids, table)


def head_logits(h: torch.Tensor, head: torch.Tensor | BlockWeight) -> torch.Tensor:
    """The lm_head product: cuBLAS for a float weight (it streams lm_head at 4.1-4.2 TB/s, as the
    Triton GEMV does: kernels/triton/gemv.py), the blocks' own product otherwise."""
    return head.linear(h) if isinstance(head, BlockWeight) else F.linear(h, head)
