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


def kv_rows(spec: ModelSpec) -> tuple[tuple[int, int], tuple[int, int]]:
    """(heads, width) of one position's K row and V row in an attention layer. Latent attention
    (MLA, a spec with `extra["kv_lora_rank"]`) keeps one row per position, the compressed latent
    then the rotated rope key (kv_lora_rank + head_dim values), which serves as key and, its
    latent part, as value (deepseek_v3_forward.py): its V row is empty."""
    latent = spec.extra.get("kv_lora_rank")
    if latent:
        return (1, latent + spec.head_dim), (1, 0)
    return (spec.num_kv_heads, spec.head_dim), (spec.num_kv_heads, spec.head_dim)


def kv_bytes_per_token(spec: ModelSpec, dtype: DType) -> int:
    """K and V bytes one position takes in every softmax-attention layer, as KVCache allocates
    them (sliding-window layers too: the cache is not windowed)."""
    (kh, kw), (vh, vw) = kv_rows(spec)
    return len(attention_layers(spec)) * (kh * kw + vh * vw) * dtype.itemsize
