"""The device memory plan: dense weights + KV tokens + expert slots + the rest, against a budget.

Computed from the manifest before any weight is read (engine/resolve.py makes the plan a runtime's
options ask for), so a plan that cannot fit is refused with advice instead of failing half-way
through loading; the same check guards a cache rebuild. It is also what sizes the expert cache
under `--gpu-budget`: the slots get what everything else leaves.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ftkit.vocab import BLOCK_FORMATS, PLANE_FORMATS, human_bytes, stored_nbytes

from ..models import FAMILIES
from ..models.kv_size import DType, KVSize, kv_size, sliding_layers
from ..spec import ModelSpec

PREFILL_CHUNK = 8192  # tokens per prefill forward on a GPU
ANCHOR_SLOTS = 32  # the prefix cache's snapshots (recurrent states, sliding windows) by default


@dataclass(frozen=True)
class MemoryPlan:
    dense_bytes: int
    kv_tokens: int
    kv: KVSize  # what positions take: full layers per token, sliding layers up to their rings
    expert_slots: int
    slot_bytes: int
    budget_bytes: int | None  # None: unknown, not checked
    prefix_tokens: int = 0  # K/V rows the prefix cache may hold, on the same device
    graph_tokens: int = 0  # static K/V rows of CUDA graph decode (engine/graphs.py)
    workspace_bytes: int = 0  # a prefill chunk's transient activations (GPU: prefill_workspace_bytes)
    graph_state_bytes: int = 0  # graph decode's static recurrent states and their saved copy
    sequences: int = 1  # the most sequences the KV tokens are spread over (each has its rings)
    prefix_windows: int = 0  # sliding-layer windows the prefix cache may hold (its anchors)

    @property
    def prefix_bytes(self) -> int:
        """The radix tree's full-layer rows and the anchors' saved windows (sliding layers keep
        no rows in the tree: prefix_cache/cache.py)."""
        return self.prefix_tokens * self.kv.full + self.prefix_windows * self.kv.saved_bytes

    @property
    def graph_bytes(self) -> int:
        return self.kv.bytes(self.graph_tokens) + self.graph_state_bytes

    @property
    def kv_bytes(self) -> int:
        return self.kv.bytes(self.kv_tokens, self.sequences)

    @property
    def expert_bytes(self) -> int:
        return self.expert_slots * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b in self.terms())

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.total_bytes <= self.budget_bytes

    def with_sizes(self, expert_slots: int | None = None, kv_tokens: int | None = None) -> MemoryPlan:
        return replace(self, expert_slots=self.expert_slots if expert_slots is None else expert_slots,
                       kv_tokens=self.kv_tokens if kv_tokens is None else kv_tokens)

    def terms(self) -> list[tuple[str, int]]:
        """What the plan places on the device, labelled, zero terms left out."""
        terms = [("dense weights", self.dense_bytes), (f"KV {self.kv_tokens} tokens", self.kv_bytes),
                 (f"{self.expert_slots} expert slots", self.expert_bytes),
                 (f"prefix cache {self.prefix_tokens} tokens"
                  + (f" and {self.prefix_windows} windows" if self.prefix_windows and self.kv.saved else ""),
                  self.prefix_bytes),
                 (f"graph K/V {self.graph_tokens} tokens" + (" and states" if self.graph_state_bytes else ""),
                  self.graph_bytes),
                 ("prefill workspace", self.workspace_bytes)]
        return [(label, b) for label, b in terms if b or label == "dense weights"]

    def describe(self) -> str:
        budget = human_bytes(self.budget_bytes) if self.budget_bytes is not None else "unchecked"
        terms = " + ".join(f"{label} ({human_bytes(b)})" for label, b in self.terms())
        return f"memory plan: {terms} = {human_bytes(self.total_bytes)} of {budget}"

    def slots_fitting(self, budget: int) -> int:
        """The expert slots that `budget` holds beside everything else in the plan."""
        return max(0, budget - self.with_sizes(expert_slots=0).total_bytes) // self.slot_bytes

    def slots_within(self, budget: int, least: int) -> int:
        """`slots_fitting(budget)`; a ValueError that names each term when that is fewer than
        `least` (one layer's top-k)."""
        others = self.with_sizes(expert_slots=0)
        slots = self.slots_fitting(budget)
        if slots < least:
            terms = ", ".join(f"{label} {human_bytes(b)}" for label, b in others.terms())
            raise ValueError(
                f"--gpu-budget {human_bytes(budget)} leaves {human_bytes(max(budget - others.total_bytes, 0))} for experts "
                f"after {terms}; one layer's experts need {human_bytes(least * self.slot_bytes)} "
                f"(raise the budget, or lower --kv-tokens or --prefix-cache-tokens)")
        return slots

    def advice(self) -> str:
        """Why it does not fit and what would: the largest expert cache and KV that do."""
        assert self.budget_bytes is not None
        room = self.budget_bytes - (self.total_bytes - self.kv_bytes - self.expert_bytes)  # what KV and slots share
        if room <= 0 and self.prefix_bytes:
            return (f"dense weights and the prefix cache ({self.prefix_tokens} tokens) exceed the budget "
                    f"of {human_bytes(self.budget_bytes)}; lower --prefix-cache-tokens")
        if room <= 0:
            return (f"the dense weights alone ({human_bytes(self.dense_bytes)}) exceed the budget of "
                    f"{human_bytes(self.budget_bytes)}; use a smaller --dtype or a larger device")
        slots = max(0, (room - self.kv_bytes) // self.slot_bytes) if self.slot_bytes else 0
        kv = self.kv.tokens_within(room - self.expert_bytes, self.sequences)
        head = f"{human_bytes(self.total_bytes)} does not fit {human_bytes(self.budget_bytes)}: "
        ways = ([f"lower --cache-experts to {slots} or fewer (with {self.kv_tokens} KV tokens)"] if slots else []) + (
            [f"lower --kv-tokens to {kv} or fewer (with {self.expert_slots} slots)"] if kv else [])
        if not ways:
            return head + (f"{self.expert_slots} expert slots and {self.kv_tokens} KV tokens each fill it alone; "
                           f"lower both --cache-experts and --kv-tokens")
        return head + ", or ".join(ways)


def longest_request(spec: ModelSpec, kv_tokens: int) -> int:
    """The longest sequence a KV budget admits: graph decode's static K/V rows (so every request
    that fits decodes through graphs) and the context a prefill chunk may sit behind."""
    return min(kv_tokens, spec.max_position_embeddings)


def prefill_workspace_bytes(spec: ModelSpec, context: int, dtype: DType, chunk: int = PREFILL_CHUNK,
                            flash: bool = False) -> int:
    """The transient activations of the largest prefill step on a GPU: a prompt of up to
    `context` tokens run layer by layer in pieces of up to `chunk` (MoEDecoder.forward), the
    last ending at position `context`. Pieces and layers run one after another, so the peak is
    the whole prompt's residual stream, a piece's temporaries and the largest of one piece's
    attention and its MLP or experts, plus every piece's routing of a layer (read back together,
    ExpertStore.expect). A sliding layer's piece attends over a copy of its window's older keys
    and its own (KVCache.append: up to window - 1 + chunk rows of K and V), counted on top of
    the attention's workspace at the whole context (a bound: the full layers' is the larger).
    `flash`: a piece behind cached keys runs flash attention (models.layers.flash_behind_cache)."""
    b, t, h = dtype.itemsize, min(chunk, context), spec.hidden_size
    items = t * spec.top_k
    # the router's float32 logits, the sorted work lists, the grouped GEMM's intermediate rows
    # and one output row per (token, expert) item before the weighted sum
    experts = t * spec.num_experts * 4 + items * (3 * 8 + b) + items * (spec.moe_intermediate_size + h) * b
    experts += 3 * t * spec.shared_expert_intermediate_size * b
    mlp = 3 * t * spec.intermediate_size * b if len(spec.moe_layers) < spec.num_layers else 0
    attention = FAMILIES[spec.family].attention_workspace(spec, t, context, b, flash)
    kv = kv_size(spec, dtype)
    if kv.sliding:
        attention += (kv.saved + t) * kv.sliding // len(sliding_layers(spec))
    routes = context * spec.top_k * (3 * 8 + b)  # ids, weights, their sort and its copy, every piece
    return (context + 3 * t) * h * b + routes + max(experts, mlp, attention)


CPU_PRODUCTS = re.compile(r"lm_head\.weight|layers\.\d+\.attn\.[qkvo]\.weight")  # read only through `linear`


def device_blocks(formats: Mapping[str, str], cuda: bool, cpu_products: bool = False,
                  gpu_products: bool = False, shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, str]:
    """{name: format} of the dense tensors kept in their GGUF blocks (models/block_table.py),
    given every dense tensor's stored format: the embedding table where it is blocks and not also
    lm_head (which every token reads whole) on a GPU, or on a CPU with `cpu_products` (a 16-bit
    run with the compiled CPU kernel), which then keeps the attention projections and lm_head in
    blocks too (`CPU_PRODUCTS`: the CPU kernel multiplies them as stored); on a GPU with
    `gpu_products` (a 16-bit run with Triton) lm_head too where its format is one of
    PLANE_FORMATS and its rows (`shapes`) split into 256s (the block GEMV's). The rest is
    dequantized at load."""
    embed, tied = formats.get("embed.weight"), "lm_head.weight" not in formats
    out = {"embed.weight": embed} if (cuda or cpu_products) and not tied and embed in BLOCK_FORMATS else {}
    if cpu_products and not cuda:
        out |= {n: f for n, f in formats.items() if f in BLOCK_FORMATS and CPU_PRODUCTS.fullmatch(n)}
    head = formats.get("lm_head.weight")
    rows = (shapes or {}).get("lm_head.weight")
    if gpu_products and cuda and head in PLANE_FORMATS and rows and rows[-1] % 256 == 0:
        out["lm_head.weight"] = head
    return out


def dense_device_bytes(shapes: Mapping[str, Sequence[int]], dtype: DType, family: str,
                       blocks: Mapping[str, str] | None = None) -> int:
    """The dense tensors' bytes on the device at `dtype`, the family's float32-kept ones at 4 bytes
    (as the loader keeps them), those in `blocks` (`device_blocks`) at their stored bytes."""
    keep, blocks = FAMILIES[family].float32_suffixes, blocks or {}
    return sum(stored_nbytes(blocks[name], tuple(shape)) if name in blocks
               else math.prod(shape) * (4 if name.endswith(keep) else dtype.itemsize) for name, shape in shapes.items())


def base_plan(spec: ModelSpec, dense_bytes: int, slot_bytes: int, dtype: DType, kv_tokens: int,
              budget_bytes: int | None = None, prefix_tokens: int = 0, cuda: bool = False,
              graphs: bool = False, chunk: int = PREFILL_CHUNK, flash: bool = False, sequences: int = 1,
              prefix_windows: int = 0) -> MemoryPlan:
    """Every term of a plan but the expert slots: on CUDA the graph K/V (with `graphs`) and the
    workspace of a `chunk`-token prefill forward, both sized by the longest request `kv_tokens`
    admits; `flash`: that GPU runs a chunk behind cached keys with flash attention
    (models.layers.flash_behind_cache); `sequences`: how many running sequences share the
    `kv_tokens` (each keeps its own sliding-layer rings); `prefix_windows`: the prefix cache's
    anchor slots (each may save a window of the sliding layers). Torch-free: a header-only
    check plans with it too."""
    longest = longest_request(spec, kv_tokens)
    graph = graphs and cuda
    return MemoryPlan(dense_bytes, kv_tokens, kv_size(spec, dtype), 0, slot_bytes, budget_bytes,
                      prefix_tokens, longest if graph else 0,
                      prefill_workspace_bytes(spec, longest, dtype, chunk, flash)
                      if cuda else 0,
                      2 * FAMILIES[spec.family].recurrent_state_bytes(spec, dtype) if graph else 0,
                      max(1, sequences), prefix_windows if prefix_tokens else 0)

