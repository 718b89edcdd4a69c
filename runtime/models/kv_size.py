"""The K/V bytes of a position, from the spec alone (no torch: the memory plan of a header-only
check reads them); `kv.KVCache` allocates exactly these."""

from __future__ import annotations

from typing import Protocol

from ..spec import FULL_ATTENTION, SLIDING_ATTENTION, ModelSpec


class DType(Protocol):
    """A dtype as the plans use it: its bytes per element (a torch.dtype is one)."""

    @property
    def itemsize(self) -> int: ...


def attention_layers(spec: ModelSpec) -> list[int]:
    """The softmax-attention layers (full or sliding): those that keep K/V rows."""
    return [i for i, kind in enumerate(spec.layer_kinds) if kind in (FULL_ATTENTION, SLIDING_ATTENTION)]


def kv_bytes_per_token(spec: ModelSpec, dtype: DType) -> int:
    """K and V bytes one position takes in every softmax-attention layer, as KVCache allocates
    them (sliding-window layers too: the cache is not windowed)."""
    return 2 * len(attention_layers(spec)) * spec.num_kv_heads * spec.head_dim * dtype.itemsize
