"""The host-memory tier behind the device KV pool (hierarchical cache): slot numbers only.

Device eviction copies a node to the host tier; a later match loads it back. Copies ride
on the next ForwardBatch and run before its forward, in order, so a demoted slot may be
reused at once. Device residency is prefix-closed (a node on the device has its parent
there too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from services.scheduler.allocator import KVSlotAllocator
from services.scheduler.eviction import EvictionPolicy, LeafHeap

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
SELECTIVE_HITS = 2  # write_through_selective copies a node to the host at its second hit


class Direction(IntEnum):
    """engine.proto KVCopy.Direction."""

    DEVICE_TO_HOST = 1
    HOST_TO_DEVICE = 2
    DEVICE_TO_STORAGE = 3  # storage_tier.py
    STORAGE_TO_HOST = 4
    STORAGE_CLEAR = 5


@dataclass
class Copy:
    direction: Direction
    src: list[int]
    dst: list[int]
    keys: list[bytes] = field(default_factory=list)  # storage pages, 16 bytes each
    load_id: int = 0  # STORAGE_TO_HOST: answered in the batch's result


@dataclass
class TierCounters:
    """Tokens moved, cumulative."""

    demoted: int = 0  # device -> host copies
    loaded: int = 0  # host -> device copies
    dropped: int = 0  # host copies evicted for good


@dataclass
class HostTier:
    allocator: KVSlotAllocator
    heap: LeafHeap
    write_policy: str = "write_back"
    copies: list[Copy] = field(default_factory=list)
    counters: TierCounters = field(default_factory=TierCounters)

    @classmethod
    def create(
        cls, num_slots: int, page_size: int, policy: EvictionPolicy, write_policy: str
    ) -> HostTier:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"--hicache-write-policy must be one of {', '.join(WRITE_POLICIES)}, "
                f"got {write_policy!r}"
            )
        heap: LeafHeap = LeafHeap(policy.score, seq_attr="host_seq")
        return cls(KVSlotAllocator(num_slots, page_size), heap, write_policy)

    @property
    def used(self) -> int:
        return self.allocator.total - self.allocator.num_free

    def copy(self, direction: Direction, src: list[int], dst: list[int]) -> None:
        self.copies.append(Copy(direction, list(src), list(dst)))
        if direction is Direction.DEVICE_TO_HOST:
            self.counters.demoted += len(src)
        elif direction is Direction.HOST_TO_DEVICE:
            self.counters.loaded += len(src)

    def take_copies(self) -> list[Copy]:
        out, self.copies = self.copies, []
        return out
