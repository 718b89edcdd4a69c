"""FTW + resolved runtime options -> a ready runtime: dense weights, host pool, expert store, decoder."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ftkit.kernels.cpu import load
from ftkit.kernels.triton import optional

from ..experts.pool import HostPool
from ..experts.store import ExpertStore
from ..ftw.manifest import FTWError
from ..ftw.reader import FTWModel
from ..models.block_table import BlockLinear, BlockTable, PlaneLinear
from ..models.kv import KVCache
from ..models.stored import ftw_family
from ..prefix_cache.boundaries import Boundaries
from ..prefix_cache.cache import PrefixCache
from .graphs import GraphDecode, unsupported
from .memory import ANCHOR_SLOTS, PREFILL_CHUNK, longest_request
from .resolve import Resolved, resolve
from .step import Step
from .tokenizer import Tokenizer


@dataclass
class RuntimeOptions:
    strategy: str = "auto"
    cache_experts: int | None = None  # device cache size in expert slots
    cache_bytes: int | None = None  # ... or in bytes
    gpu_budget: int | None = None  # ... or what this many device bytes leave (engine/memory.py)
    kv_tokens: int = 8192  # KV tokens the runtime is sized for: reserved by a gpu_budget, graph K/V rows
    device: str | None = "cpu"  # None: cuda when a GPU is present, else cpu (the CLI's default)
    threads: int | None = None
    profile: Path | None = None
    find_profile: bool = False  # no profile nor ratio given: ft-calibrate's for this GPU (the CLI's default)
    bandwidth_ratio: float | None = None  # B_P / B_H without a profile file
    dtype: str | None = None  # compute dtype; default: the dense weights' dtype
    trace_stats: bool = False
    verify: bool = False  # check every FTW checksum before loading (reads every byte twice)
    prefix_cache: bool = True  # reuse K/V (and recurrent anchors) across requests
    anchors: bool = True  # recurrent-state snapshots at semantic boundaries (else prompt tails only)
    prefix_cache_tokens: int | None = None  # radix tree budget in tokens (default: the context)
    anchor_slots: int = ANCHOR_SLOTS  # snapshots kept: recurrent states, sliding windows (those families only)
    graphs: bool = True  # CUDA: batch-1 decode through CUDA graphs with device-side expert planning
    stream_prefill: bool | None = None  # whole-layer double buffering in prefill (None: on CUDA)
    prefill_chunk: int = PREFILL_CHUNK  # GPU: tokens per prefill piece at most (a piece's activations)


class Runtime:
    def __init__(self, model: Path | FTWModel, opts: RuntimeOptions | Resolved):
        """`opts`: the user's options, resolved here, or options already resolved for this model
        (ft-run serve resolves them first, to check its memory plan before loading)."""
        t0 = time.perf_counter()
        self.ftw = model if isinstance(model, FTWModel) else FTWModel(Path(model))
        self.path = self.ftw.path
        self.resolved = r = opts if isinstance(opts, Resolved) else resolve(self.ftw, opts)
        self.opts = opts = r.options
        if opts.verify and (problems := self.ftw.verify()):
            raise FTWError(f"{self.path}: {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
        self.spec = self.ftw.spec
        self.family = ftw_family(self.ftw)
        self.device, self.dtype = r.device, r.dtype
        keep = self.family.float32_suffixes  # what the reference computes in float32 whatever the dtype

        def dtype(name: str) -> torch.dtype:
            return torch.float32 if name.endswith(keep) else self.dtype

        # each tensor cast as it is read, blocks dequantized a slice at a time into their dtype: the
        # host never holds the dense tensors' float32 values at once (q4km cut to two layers, loaded
        # at bf16 on the dev box: peak RSS 4.28 GB with all of them at once, 2.48 GB so)
        weights = {k: self._blocks(k, v, r) if k in r.blocks else v.to(self.device, dtype(k))
                   for k, v in self.ftw.dense_tensors(r.blocks, dtype)}
        if r.cpu_products:  # each router's 16-bit rows multiplied by the CPU kernel too (models/block_table.py);
            fmt = str(self.dtype).removeprefix("torch.")  # a family's float32-kept routers stay tensors
            routers = (f"layers.{i}.router.weight" for i in self.spec.moe_layers)
            weights |= {k: BlockLinear(weights[k].view(torch.uint8), fmt, tuple(weights[k].shape), self.dtype, load(),
                                       r.threads) for k in routers if weights[k].dtype == self.dtype}
        self.pool = HostPool.from_ftw(self.ftw, pin=self.device.type == "cuda", threads=opts.threads or 8)
        self.store = ExpertStore(
            self.spec, self.pool, r.strategy, r.cache_slots, self.device, r.threads, r.ratio, self.dtype,
            opts.stream_prefill,
        )
        self.store.stats.trace = opts.trace_stats
        self.decoder = self.family.decoder(self.spec, weights, self.store)
        self.step = Step(self.decoder, self._graphs() if opts.graphs and self.device.type == "cuda" else None)
        self.tokenizer = Tokenizer(self.path) if (self.path / "tokenizer.json").is_file() else None
        # On CPU every prefill is cut on this grid, cache on or off, so reuse is bitwise exact.
        # On a GPU (results agree to rounding, not bitwise) a prompt is one forward, run layer by
        # layer in pieces of opts.prefill_chunk tokens that also end at anchors, so a streamed
        # expert layer crosses PCIe once for the whole prompt.
        self.grid = Boundaries.for_tokenizer(self.tokenizer)
        self.prefill_chunk = opts.prefill_chunk if self.device.type != "cpu" else None
        self.prefix_cache = PrefixCache(
            self.spec, self.grid, opts.prefix_cache_tokens or self.spec.max_position_embeddings,
            opts.anchors, opts.anchor_slots,
        ) if opts.prefix_cache else None
        self.load_seconds = time.perf_counter() - t0

    def _blocks(self, name: str, raw: torch.Tensor, r: Resolved) -> BlockTable | BlockLinear | PlaneLinear:
        """A dense tensor the plan keeps in its GGUF blocks (`Resolved.blocks`): the embedding
        table, or a projection multiplied as stored: on a GPU its blocks split into planes for the
        block GEMV, on a CPU by the CPU kernel."""
        shape, fmt = self.ftw.dense_refs[name].shape, r.blocks[name]
        if name == "embed.weight":
            return BlockTable(raw.to(self.device), fmt, shape, self.dtype)
        if self.device.type == "cuda":
            return PlaneLinear(optional("block_gemv").pack(raw.to(self.device), fmt, *shape), self.dtype)
        return BlockLinear(raw.contiguous(), fmt, shape, self.dtype, load(), r.threads)

    def _graphs(self) -> GraphDecode | None:
        """CUDA graph decode for this model, or None (said in one line why)."""
        reason = unsupported(self.decoder, self.store)
        if reason:
            print(f"ftkit: decoding without CUDA graphs: {reason}", file=sys.stderr)
            return None
        return GraphDecode(self.decoder, self.store, longest_request(self.spec, self.opts.kv_tokens))

    def new_kv(self, max_tokens: int) -> KVCache:
        return KVCache(self.spec, max_tokens, self.dtype, self.device)

    @property
    def eos_ids(self) -> set[int]:
        ids = set(self.spec.eos_token_ids)
        if self.tokenizer:
            tid = self.tokenizer.token_id(self.tokenizer.special_token("eos_token"))
            if tid is not None:
                ids.add(tid)
        return ids

    def close(self) -> None:
        self.store.close()
