"""The device slot cache: one LRU over all MoE layers, keyed by `row = layer * E + expert`.

The device tier is a parameter: on `cuda` slots live in VRAM and fills cross PCIe; on `cpu`
(CI) they are a second host tensor and the same code runs, so LRU and split logic are tested
without a GPU.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch


class SlotCache:
    def __init__(self, capacity: int, slot_bytes: int, num_rows: int, device: torch.device):
        self.capacity = max(0, capacity)
        self.device = device
        self.slots = torch.empty((self.capacity, slot_bytes), dtype=torch.uint8, device=device)
        # Residency table: row -> slot (-1 = not resident); kept as a tensor for device-side control.
        self.table = torch.full((num_rows,), -1, dtype=torch.int32)
        self._table = self.table.numpy()  # the same memory: an element write without torch's ~5 us
        self.lru: OrderedDict[int, int] = OrderedDict()  # row -> slot, least recent first
        self.free = list(range(self.capacity - 1, -1, -1))
        self.kept: frozenset[int] = frozenset()  # rows no claim may evict (see `hold`)

    def __len__(self) -> int:
        return len(self.lru)

    def lookup(self, row: int) -> int | None:
        slot = self.lru.get(row)
        if slot is not None:
            self.lru.move_to_end(row)
        return slot

    def claim(self, row: int, protected: set[int]) -> int | None:
        """A slot for `row`: a free one, else the least recently used row not in `protected`."""
        slots = self.claim_many([row], protected)
        return slots[0] if slots else None

    def claim_many(self, rows: list[int], protected: set[int]) -> list[int]:
        """`claim` for each of `rows` (none resident) in turn, each claimed row protected from
        the next: their slots, in order, up to the first row that finds none. One pass over the
        LRU finds all the victims (a prefill layer claims ~100 slots at once; a scan from the
        front for each took 1.5 ms of host time a layer on the dev box)."""
        need = len(rows) - len(self.free)
        victims = iter(list(itertools.islice(
            (r for r in self.lru if r not in protected and r not in self.kept), max(0, need))))
        slots = []
        for row in rows:
            if self.free:
                slot = self.free.pop()
            elif (victim := next(victims, None)) is not None:
                slot = self.lru.pop(victim)
                self._table[victim] = -1
            else:
                break
            self.lru[row] = slot
            self._table[row] = slot
            slots.append(slot)
        return slots

    def unclaim(self, row: int, slot: int) -> None:
        """Give back a slot just claimed for `row` and not filled (`row` was never resident)."""
        del self.lru[row]
        self._table[row] = -1
        self.free.append(slot)

    def hold(self, n: int) -> None:
        """Keep the `n` most recently used rows resident until `release` (a long prefill chunk
        streams every expert through the cache; without this it would evict the decode's
        hottest experts, which the next turn needs again)."""
        self.kept = frozenset(list(self.lru)[max(0, len(self.lru) - n):]) if n > 0 else frozenset()

    def release(self) -> None:
        self.kept = frozenset()

    def fill(self, slot: int, src: torch.Tensor) -> None:
        """Copy one expert's bytes in (asynchronously from pinned memory on CUDA)."""
        self.slots[slot].copy_(src, non_blocking=True)

    def clear(self) -> None:
        self.lru.clear()
        self.kept = frozenset()
        self.table.fill_(-1)
        self.free = list(range(self.capacity - 1, -1, -1))
