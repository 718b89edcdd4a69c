"""An embedding table kept in its GGUF blocks on the GPU (FTW v3 stores a GGUF's dense tensors
so): the largest dense tensor a lookup reads one row of (Qwen3-30B-A3B's 151936 x 2048: 622 MB at
bfloat16, 175 MB as Q4_K_M's Q4_K), so only the rows a step looks up are decoded, each to what
dequantizing the table at load gave (kernels/dequant.py, bit for bit the gguf package's, cast to
the compute dtype).

lm_head stays dequantized: a product reads all of it every token, and decoding its blocks in
registers (kernels/triton/gemv.py's `block_gemv`) matched cuBLAS on bf16 only for Q4_K and Q8_0
(H100: 232 and 229 us against 220) and took 896 us on Q4_K_M's Q6_K (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ftkit.kernels.dequant import dequantize


@dataclass(frozen=True)
class BlockTable:
    """An embedding table as its stored GGUF rows; `rows` looks rows up."""

    raw: torch.Tensor  # uint8 [rows, bytes a row]: the rows in their blocks, as stored
    fmt: str  # the block format (ftkit.vocab.BLOCK_FORMATS)
    shape: tuple[int, int]  # the logical [rows, columns]
    dtype: torch.dtype  # what rows come out as: the compute dtype

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """F.embedding(ids, the dequantized table): only the rows asked for are decoded (a long
        prompt's a slice at a time: `dequantize`'s CHUNK_WEIGHTS)."""
        return dequantize(self.raw[ids], self.fmt, self.dtype)


def embed_rows(ids: torch.Tensor, table: torch.Tensor | BlockTable) -> torch.Tensor:
    """The rows of an embedding table, a float tensor or one kept in blocks."""
    return table.rows(ids) if isinstance(table, BlockTable) else F.embedding(ids, table)
