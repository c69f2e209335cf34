"""Rows of the worker's request-slot table, handed out to running requests."""

from __future__ import annotations


class ReqSlotTable:
    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {size}")
        self.size = size
        self._free = list(range(size - 1, -1, -1))  # pop() hands out low rows first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:  # out of range or already free
            raise ValueError(f"request slot {slot} is not in use (table size {self.size})")
        self._used.remove(slot)
        self._free.append(slot)
