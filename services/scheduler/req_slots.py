"""Rows of the worker's request-slot table, handed out to running requests."""

from __future__ import annotations


class ReqSlotTable:
    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {size}")
        self.size = size
        self._free = list(range(size - 1, -1, -1))  # pop() hands out low rows first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.size or slot in self._free:
            raise ValueError(f"request slot {slot} is not in use (table size {self.size})")
        self._free.append(slot)
