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
  A router's rows there too, as their 16-bit values (the loader): torch's bf16 product of a
  128 x 2048 router took 96-150 us a call between the kernel's calls against ~40 on the kernel
  (dev box, 2 cores; the 3-layer file's routing 0.51-0.67 -> 0.25-0.29 ms a token).

- On a GPU computing in 16 bits, lm_head in Q4_K, Q6_K or Q8_0 (`PlaneLinear`): its blocks split
  into planes at load and multiplied by kernels/triton/block_gemv.py. Every token reads lm_head
  whole; Qwen3-30B-A3B's (151936 x 2048) as Q4_K_M's Q6_K on an H100, inside a CUDA graph:
  152.5 us against cuBLAS's 204.8 on bf16 (the old byte-gathering kernel: 896). The attention
  projections stay dequantized there: at their sizes the block GEMV is latency-bound and no
  faster than the bf16 GEMV (Q/K/V 7.7-9.6 us against 9.2, output projection 8.4-10.4 against
  7.6).
A float32 run keeps them dequantized everywhere: it is the exact reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ftkit.kernels.cpu import Kernel
from ftkit.kernels.dequant import dequantize
from ftkit.kernels.triton import optional

if TYPE_CHECKING:
    from ftkit.kernels.triton.block_gemv import Planes


@dataclass(frozen=True)
class Blocks:
    """A dense tensor [rows, columns] as its stored GGUF rows (a CPU router's: its 16-bit values)."""

    raw: torch.Tensor  # uint8 [rows, bytes a row]: the rows in their blocks, as stored
    fmt: str  # the block format (ftkit.vocab.BLOCK_FORMATS), or bfloat16 / float16 (a CPU router)
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


@dataclass(frozen=True)
class PlaneLinear:
    """A GPU projection's weight [N, K] in GGUF blocks split into planes (`block_gemv.pack`);
    `product` multiplies by it."""

    planes: Planes
    dtype: torch.dtype  # what comes out: the compute dtype
    ROWS = 16384  # rows dequantized at once for a product of many tokens (128 MB of float32 at K 2048)

    @property
    def device(self) -> torch.device:
        return self.planes.device

    @property
    def shape(self) -> tuple[int, int]:
        return self.planes.n, self.planes.k

    @property
    def nbytes(self) -> int:
        return self.planes.nbytes

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for x [..., K]: up to `block_gemv.MAX_TOKENS` tokens through the block GEMV,
        more (a prompt's every position) against the weight dequantized ROWS rows at a time."""
        kernels = optional("block_gemv")
        n, k = self.shape
        flat = x.reshape(-1, k).contiguous()
        if flat.shape[0] <= kernels.MAX_TOKENS:
            y = kernels.block_gemv(flat, self.planes)
        else:
            y = torch.cat([F.linear(flat, kernels.dequantized(self.planes.rows(a, min(n, a + self.ROWS)), x.dtype))
                           for a in range(0, n, self.ROWS)], dim=-1)
        return y.reshape(*x.shape[:-1], n)


def embed_rows(ids: torch.Tensor, table: torch.Tensor | BlockTable) -> torch.Tensor:
    """The rows of an embedding table, a float tensor or one kept in blocks."""
    return table.rows(ids) if isinstance(table, BlockTable) else F.embedding(ids, table)
