"""The host-memory tier behind the device KV pool (hierarchical cache): slot numbers only.

A tree node's KV may sit in the device pool (``node.value``), in the host tier
(``node.host``), or both. Evicting a node from the device copies it to the host tier
instead of dropping it (unless a host copy already exists); a later match loads it back
into fresh device slots. The worker does the copies: each one the tree decides is queued
here and rides on the next ForwardBatch, which the worker runs before that batch's
forward, in order. So a slot freed by a demotion may be handed out at once (whatever
writes it next runs after the copy), and loaded KV is readable by the same batch.

    device residency is prefix-closed (a node on the device has its parent there too):
    anchor -- [A dev+host] -- [B dev] -- [C host] -- [D host]
                                  \\-- [E dev]
    device eviction: leaves of the device part (B has C below it, but C is host-only)
    host eviction: nodes with a host copy and no child with one (D, then C); a host-only
    node leaves the tree with its copy, a resident one keeps its device slots
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
    """Tokens moved, cumulative (Prometheus counters read the differences)."""

    demoted: int = 0  # device -> host copies
    loaded: int = 0  # host -> device copies (cache hits served from the host tier)
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
        """The copies for the next batch to carry, in the order they were decided."""
        out, self.copies = self.copies, []
        return out
