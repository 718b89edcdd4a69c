"""The tiered expert store: host pool (source of truth), device slot cache, planner, CPU executor.

A family calls `ExpertStore.run(layer, hidden, topk_ids, topk_weights)` and never learns where
an expert lives; the strategies live entirely behind that call.
"""

from .store import ExpertStore

__all__ = ["ExpertStore"]
