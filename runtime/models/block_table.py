"""Dense tensors kept in their GGUF blocks (FTW v3 stores a GGUF's dense tensors so).

- An embedding table (`BlockTable`), on a GPU or a CPU: the largest dense tensor a lookup reads
  one row of (Qwen3-30B-A3B's 151936 x 2048: 622 MB at bfloat16, 175 MB as Q4_K_M's Q4_K), so
  only the rows a step looks up are decoded, each to what dequantizing the table at load gave
  (kernels/dequant.py, bit for bit the gguf package's, cast to the compute dtype).
- On a CPU computing in 16 bits, the attention projections and lm_head too (`BlockLinear`): the
  CPU kernel multiplies their blocks as stored, on int8 activations where the format has them,
  as the experts' int8 path (kernels/cpu). CPU decode reads every dense byte each token, and
  dequantized they were 2-4x the bytes: a Qwen3-30B-A3B shape cut to 3 layers (vocab 4096) as
  llama-quantize's Q4_K_M, cpu strategy at bfloat16 on the dev box's 2 cores, decoded 51-53 tok/s
  with them dequantized, 86-90 in blocks (llama.cpp: 264 on the same file; docs/benchmarks.md).

On a GPU lm_head and attention stay dequantized: decoding their blocks in registers
(kernels/triton/gemv.py's `block_gemv`) matched cuBLAS on bf16 only for Q4_K and Q8_0 (H100: 232
and 229 us against 220) and took 896 us on Q4_K_M's Q6_K (docs/benchmarks.md). A float32 run
keeps them dequantized everywhere: it is the exact reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ftkit.kernels.cpu import Kernel
from ftkit.kernels.dequant import dequantize


@dataclass(frozen=True)
class Blocks:
    """A dense tensor [rows, columns] as its stored GGUF rows."""

    raw: torch.Tensor  # uint8 [rows, bytes a row]: the rows in their blocks, as stored
    fmt: str  # the block format (ftkit.vocab.BLOCK_FORMATS)
    shape: tuple[int, int]  # the logical [rows, columns]
    dtype: torch.dtype  # what comes out: the compute dtype

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        return self.raw.numel()


@dataclass(frozen=True)
class BlockTable(Blocks):
    """An embedding table; `rows` looks rows up."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """F.embedding(ids, the dequantized table): only the rows asked for are decoded (a long
        prompt's a slice at a time: `dequantize`'s CHUNK_WEIGHTS)."""
        return dequantize(self.raw[ids], self.fmt, self.dtype)


@dataclass(frozen=True)
class BlockLinear(Blocks):
    """A CPU projection's weight [N, K]; `product` multiplies by it on the CPU kernel's
    `threads`."""

    kernel: Kernel | None = None
    threads: int = 1

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for x [..., K]: float32 sums on int8 activations where the format has them,
        one rounding to the compute dtype."""
        k = self.shape[1]
        y = self.kernel.linear(self.raw, self.fmt, self.shape, x.reshape(-1, k), self.threads, int8=True)
        return y.to(self.dtype).reshape(*x.shape[:-1], self.shape[0])


def embed_rows(ids: torch.Tensor, table: torch.Tensor | BlockTable) -> torch.Tensor:
    """The rows of an embedding table, a float tensor or one kept in blocks."""
    return table.rows(ids) if isinstance(table, BlockTable) else F.embedding(ids, table)
