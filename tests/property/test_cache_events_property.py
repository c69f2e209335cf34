"""Property test of the cache events (issue 37): the radix and hierarchical cache machines
run with a TreeEvents attached, and after every step a router's index, fed only by the
published messages, holds exactly the keys of the blocks the tree holds (recomputed from
every node's path from scratch), and a snapshot says the same."""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import invariant

from services.common.page_keys import block_keys, split_keys
from services.scheduler.cache_events import TreeEvents, block_tokens_for
from services.scheduler.radix_cache import TreeNode
from tests.property.test_hicache_property import TieredCacheMachine
from tests.property.test_radix_cache_property import CacheMachine

BLOCK = 2  # page size 1: blocks straddle nodes; at page size 16, block_tokens_for -> 16
SEED = b"test-seed"


def tree_keys(root: TreeNode, page_size: int) -> set[bytes]:
    """Every block that ends inside a node of the tree, hashed from its path."""
    out: set[bytes] = set()
    for ns, anchor in root.children.items():
        stack: list[tuple[TreeNode, list[int]]] = [(c, []) for c in anchor.children.values()]
        while stack:
            node, above = stack.pop()
            path = above + [int(t) for t in node.key]
            b = block_tokens_for(BLOCK, page_size)
            first, last = len(above) // b, len(path) // b
            out |= set(block_keys(SEED, ns, path, first, last, b))
            stack.extend((c, path) for c in node.children.values())
    return out


class _Watched:
    """Mixed into a cache machine: events on from its first check (right after setup, on
    an empty tree), and a router's index checked after every step."""

    @invariant()
    def the_index_is_the_tree(self) -> None:
        cache = getattr(self, "cache", None)
        if cache is None:
            return
        if cache.events is None:
            assert not tree_keys(cache.root, cache.page_size), "attached to a tree with blocks"
            cache.events = TreeEvents(block_tokens_for(BLOCK, cache.page_size), SEED)
            self.index: set[bytes] = set()
            self.last_seq = 0
        msg = cache.events.take()
        if msg is not None:
            assert msg.seq == self.last_seq + 1
            self.last_seq = msg.seq
            stored, removed = set(split_keys(msg.stored)), set(split_keys(msg.removed))
            assert not stored & removed
            if msg.cleared:
                self.index.clear()
            self.index -= removed
            self.index |= stored
        truth = tree_keys(cache.root, cache.page_size)
        assert self.index == truth
        snap = cache.events.snapshot(cache.root)
        assert snap.snapshot and snap.seq == self.last_seq
        assert set(split_keys(snap.stored)) == truth


class EventsCacheMachine(_Watched, CacheMachine):
    pass


class EventsCacheMachinePage16(_Watched, CacheMachine):
    page_size = 16
    pool_pages = 6


class EventsTieredMachine(_Watched, TieredCacheMachine):
    pass


_SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestEventsRadix = EventsCacheMachine.TestCase
TestEventsRadix.settings = _SETTINGS
TestEventsRadixPage16 = EventsCacheMachinePage16.TestCase
TestEventsRadixPage16.settings = _SETTINGS
TestEventsTiered = EventsTieredMachine.TestCase
TestEventsTiered.settings = _SETTINGS
