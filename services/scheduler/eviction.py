"""Eviction policies of the radix cache, and the heap of leaves they order.

A policy scores a leaf (smallest evicted first; only locks protect). Scores pack
(major, clock) into one int, cheaper to compare than tuples, and must never decrease over
a node's life: a stale heap entry is then only too small, so pop re-files it lazily.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

CLOCK_SPAN = 1 << 64  # the logical clock stays below this; it packs (major, clock) into one int
_SEQ_SPAN = 1 << 48  # heap entries pack (score, sequence number) the same way


class ScoredNode(Protocol):
    last_access: int  # logical clock
    hit_count: int
    priority: int  # max priority of the requests that inserted or matched it
    heap_seq: int  # the node's live heap entry (-1: none)


N = TypeVar("N", bound=ScoredNode)


class EvictionPolicy(ABC):
    name: str = ""

    @abstractmethod
    def score(self, node: ScoredNode) -> int:
        """The smallest is evicted first; non-decreasing over the node's life."""

    @classmethod
    def create(cls, slru_protected_hits: int) -> EvictionPolicy:
        return cls()


_REGISTRY: dict[str, type[EvictionPolicy]] = {}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    _REGISTRY[cls.name] = cls
    return cls


@register_policy
class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def score(self, node: ScoredNode) -> int:
        return node.last_access


@register_policy
class LFUPolicy(EvictionPolicy):
    """Fewest hits first; among equals the least recently used."""

    name = "lfu"

    def score(self, node: ScoredNode) -> int:
        return node.hit_count * CLOCK_SPAN + node.last_access


@register_policy
class SLRUPolicy(EvictionPolicy):
    """Segmented LRU: the probationary segment (fewer than ``protected_hits`` hits) goes
    before the protected one; LRU inside each segment."""

    name = "slru"

    def __init__(self, slru_protected_hits: int = 2):
        if slru_protected_hits < 1:
            raise ValueError(f"slru_protected_hits must be >= 1, got {slru_protected_hits}")
        self.protected_hits = slru_protected_hits

    @classmethod
    def create(cls, slru_protected_hits: int) -> EvictionPolicy:
        return cls(slru_protected_hits)

    def score(self, node: ScoredNode) -> int:
        return (node.hit_count >= self.protected_hits) * CLOCK_SPAN + node.last_access


@register_policy
class PriorityPolicy(EvictionPolicy):
    """Lowest request priority first (a larger value is more important); then LRU."""

    name = "priority"

    def score(self, node: ScoredNode) -> int:
        return node.priority * CLOCK_SPAN + node.last_access


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(name: str, slru_protected_hits: int = 2) -> EvictionPolicy:
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {policy_names()}"
        ) from None
    return cls.create(slru_protected_hits)


class LeafHeap(Generic[N]):
    """Candidate leaves ordered by score. Entries are ints ``score * _SEQ_SPAN + seq``; a
    re-push orphans a node's older entry, which pop() skips (swept when they pile up)."""

    def __init__(self, score: Callable[[ScoredNode], int], seq_attr: str = "heap_seq"):
        self._score = score
        # A node may sit in two heaps (device and host tier), each with its own attribute.
        self._attr = seq_attr
        self._heap: list[int] = []
        self._nodes: dict[int, N] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: N) -> bool:
        return self._nodes.get(getattr(node, self._attr)) is node

    def push(self, node: N) -> None:
        self._nodes.pop(getattr(node, self._attr), None)
        self._seq += 1
        setattr(node, self._attr, self._seq)
        self._nodes[self._seq] = node
        heapq.heappush(self._heap, self._score(node) * _SEQ_SPAN + self._seq)
        if len(self._heap) > 2 * len(self._nodes) + 1024:
            self._heap = [k for k in self._heap if k % _SEQ_SPAN in self._nodes]
            heapq.heapify(self._heap)

    def discard(self, node: N) -> None:
        self._nodes.pop(getattr(node, self._attr), None)
        setattr(node, self._attr, -1)

    def pop(self, is_candidate: Callable[[N], bool]) -> N | None:
        """The lowest-scored node that is still a candidate, or None."""
        heap, nodes = self._heap, self._nodes
        while heap:
            score, seq = divmod(heapq.heappop(heap), _SEQ_SPAN)
            node = nodes.pop(seq, None)
            if node is None:
                continue
            setattr(node, self._attr, -1)
            if not is_candidate(node):
                continue  # locked or grew children: pushed again when it is a leaf again
            if self._score(node) != score:
                self.push(node)  # touched since filed: scores only grow, so re-file it
                continue
            return node
        return None

    def clear(self) -> None:
        self._heap.clear()
        self._nodes.clear()
