"""The radix tree of cached KV: token runs -> KV slot numbers (RadixAttention).

A node holds a run of tokens (``key``) and their slots (``value``); children are filed
under their first token, or first page when page_size > 1 (only whole pages are cached).
The root has one anchor child per namespace, so namespaces never share a node. Requests
lock paths (reference counts); evictable and protected counts are kept incrementally,
and unlocked leaves wait in a lazily invalidated heap (eviction.py): evict never scans.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from itertools import chain
from typing import Any, NamedTuple

from services.scheduler.allocator import KVSlotAllocator
from services.scheduler.cache_events import TreeEvents
from services.scheduler.cache_integrity import (
    CacheIntegrityError,
    SlotLeakError,
    check_slot_integrity,
    recount_tree,
)
from services.scheduler.eviction import LeafHeap, make_policy
from services.scheduler.host_tier import SELECTIVE_HITS, Copy, Direction, HostTier
from services.scheduler.storage_tier import MAX_LOAD_PAGES, PendingLoad, StorageTier, page_keys
from services.scheduler.tokens import Tokens, as_tokens

__all__ = [
    "BasePrefixCache",
    "CacheIntegrityError",
    "CacheLockError",
    "DisabledCache",
    "InsertResult",
    "MatchResult",
    "RadixCache",
    "SizeInfo",
    "SlotLeakError",
    "TreeNode",
    "check_slot_integrity",
    "common_prefix_len",
    "create_prefix_cache",
]


class CacheLockError(RuntimeError):
    """Unlocking an unlocked node, locking an evicted one, or flushing a locked tree."""


class TreeNode:
    __slots__ = (
        "key",
        "value",
        "children",
        "parent",
        "lock_ref",
        "last_access",
        "hit_count",
        "priority",
        "heap_seq",
        "anchor",
        "host",
        "host_seq",
        "stored",
        "blocks",
    )

    def __init__(
        self, key: Tokens, value: list[int], parent: TreeNode | None, anchor: bool = False
    ):
        self.key = key  # an int32 array (tokens.py)
        self.value = value  # their KV slots, same length
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent  # None once evicted (or for the root)
        self.lock_ref = 0  # in-flight requests whose path runs through here
        self.last_access = 0  # logical clock; this and the next two feed the policy
        self.hit_count = 0
        self.priority = 0  # max priority of requests that used it
        self.heap_seq = -1
        self.anchor = anchor  # the root or a namespace root: holds no tokens
        # Host-tier slots of the same tokens, or None; ``value`` empty: host-only.
        self.host: list[int] | None = None
        self.host_seq = -1
        self.stored = False  # the storage tier has the pages that end inside this node
        # (end offset, key) of the routers' blocks ending inside this node (cache_events.py).
        self.blocks: Sequence[tuple[int, bytes]] = ()

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock={self.lock_ref}, children={len(self.children)})"


class MatchResult(NamedTuple):
    slots: list[int]  # KV slots of the matched prefix; len(slots) == matched tokens
    node: TreeNode  # lock this node to keep the match alive


class InsertResult(NamedTuple):
    prefix_len: int  # tokens that were already in the tree (their given slots are duplicates)
    node: TreeNode  # the node ending at the last inserted token


class SizeInfo(NamedTuple):
    evictable: int  # tokens in unlocked nodes
    protected: int  # tokens in locked nodes


class BasePrefixCache(ABC):
    page_size: int
    root: TreeNode
    last_loaded: int = 0  # tokens the last (non-peek) match loaded from the host tier
    host: HostTier | None = None
    storage: StorageTier | None = None
    events: TreeEvents | None = None

    def match_prefix(
        self,
        tokens: Sequence[int],
        namespace: str = "",
        priority: int = 0,
        *,
        peek: bool = False,
    ) -> MatchResult:
        """Longest cached prefix (whole pages only); with ``peek`` not counted as a use."""
        tokens = as_tokens(tokens)
        return self._match(tokens, len(tokens), namespace, priority, peek)

    def match_prompt(
        self,
        prompt: Sequence[int],
        namespace: str = "",
        priority: int = 0,
        *,
        peek: bool = False,
    ) -> MatchResult:
        """match_prefix(prompt[:-1]): the last prompt token is always computed (its logits)."""
        prompt = as_tokens(prompt)  # no prompt[:-1] copy: the walk stops one token short
        return self._match(prompt, max(0, len(prompt) - 1), namespace, priority, peek)

    def insert_prefix(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        namespace: str = "",
        priority: int = 0,
        *,
        start: TreeNode | None = None,
    ) -> InsertResult:
        """Caches tokens -> slots (whole pages only). Slots at positions [0, prefix_len) were
        already cached: the caller frees those it owns, and any tail beyond the whole pages.

        ``start``: a node whose path is ``tokens[:k]`` (the caller guarantees it), where the
        walk resumes instead of re-comparing the cached prefix; same result as without."""
        tokens, slots = as_tokens(tokens), _as_list(slots)
        if len(tokens) != len(slots):
            raise ValueError(f"insert_prefix: {len(tokens)} tokens but {len(slots)} slots")
        return self._insert(tokens, slots, namespace, priority, start)

    def path_slots(self, node: TreeNode) -> list[int]:
        """The KV slots of node's path from its anchor: what a match ending at node returns."""
        parts: list[list[int]] = []
        while not node.anchor:
            parts.append(node.value)
            parent = node.parent
            if parent is None:
                raise CacheLockError(f"{node!r} is no longer in the tree (evicted or flushed)")
            node = parent
        slots: list[int] = []
        for value in reversed(parts):
            slots += value
        return slots

    @abstractmethod
    def _match(
        self, tokens: Tokens, end: int, namespace: str, priority: int, peek: bool
    ) -> MatchResult:
        """match_prefix of tokens[:end], without copying that slice."""

    @abstractmethod
    def _insert(
        self,
        tokens: Tokens,
        slots: list[int],
        namespace: str,
        priority: int,
        start: TreeNode | None,
    ) -> InsertResult:
        """insert_prefix with a token array and a slot list of one length."""

    @abstractmethod
    def lock(self, node: TreeNode) -> None:
        """Locks node's path against eviction; counted (one unlock each); root: no-op."""

    @abstractmethod
    def unlock(self, node: TreeNode) -> None:
        """Undoes one lock(node); raises CacheLockError if node is not locked."""

    @abstractmethod
    def evict(self, n: int) -> int:
        """Frees at least n tokens' slots to the allocator when possible; returns how many."""

    def take_copies(self) -> list:
        """KV copies between tiers decided since the last call, for the next batch."""
        return []

    def ask_storage(self, prompt: Sequence[int], namespace: str, req: object = None) -> bool:
        """Queues a storage load of what prompt needs past the tree; False if none."""
        return False

    def storage_answer(self, load_id: int, pages: int) -> object:
        """Settles a storage load; the request that waited on it, if any."""
        return None

    def clear_storage(self) -> bool:
        """Queues the deletion of every page of the storage tier; False without one."""
        return False

    @abstractmethod
    def reset(self) -> None:
        """Flush: every cached slot back to the allocator; raises if anything is locked."""

    @abstractmethod
    def size_info(self) -> SizeInfo: ...

    @abstractmethod
    def check_integrity(self) -> None: ...


class RadixCache(BasePrefixCache):
    def __init__(
        self,
        allocator: KVSlotAllocator,
        page_size: int = 1,
        policy: str = "lru",
        slru_protected_hits: int = 2,
        host_slots: int = 0,
        write_policy: str = "write_back",
        storage: StorageTier | None = None,
        events: TreeEvents | None = None,
    ):
        if page_size != allocator.page_size:
            raise ValueError(
                f"cache page_size {page_size} != allocator page_size {allocator.page_size}"
            )
        self.allocator = allocator
        self.page_size = page_size
        self.policy = make_policy(policy, slru_protected_hits)
        self.root = TreeNode(as_tokens(()), [], None, anchor=True)
        self._evictable = 0
        self._protected = 0
        self._clock = 0
        self._leaves: LeafHeap[TreeNode] = LeafHeap(self.policy.score)
        self.host = (
            HostTier.create(host_slots, page_size, self.policy, write_policy)
            if host_slots > 0
            else None
        )
        if storage is not None and (self.host is None or storage.page_tokens % page_size):
            raise ValueError(
                "the storage tier needs the host tier, and its pages "
                f"({storage.page_tokens} tokens) must be whole KV pages of {page_size}"
            )
        self.storage = storage
        self.events = events

    # -- match ------------------------------------------------------------------------
    def _match(
        self, tokens: Tokens, end: int, namespace: str, priority: int, peek: bool
    ) -> MatchResult:
        if not peek:
            self.last_loaded = 0
        anchor = self.root.children.get(namespace)
        if anchor is None:
            return MatchResult([], self.root)
        node, _, path = self._walk(anchor, tokens, end - end % self.page_size)
        if self.host is not None:
            path = self._resident(path, load=not peek)
            node = path[-1] if path else anchor
        slots: list[int] = []
        for n in path:
            slots += n.value
        if not peek and path:
            self._clock += 1
            clock = self._clock
            for n in path:
                n.last_access = clock
                n.hit_count += 1
                if priority > n.priority:
                    n.priority = priority
            if self.host is not None and self.host.write_policy == "write_through_selective":
                for n in path:
                    if n.host is None and n.hit_count >= SELECTIVE_HITS:
                        self._copy_to_host(n)
        return MatchResult(slots, node)

    def _walk(
        self, node: TreeNode, tokens: Tokens, end: int, pos: int = 0
    ) -> tuple[TreeNode, int, list[TreeNode]]:
        """Follows tokens[pos:end] down from node (whose path is tokens[:pos]), splitting
        where the match ends inside a node: (last node, matched length, path below node)."""
        ps = self.page_size
        path: list[TreeNode] = []
        while pos < end:
            child = node.children.get(tokens[pos] if ps == 1 else tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            n = common_prefix_len(child.key, tokens, pos, end)
            if ps > 1:
                n -= n % ps
            if n < len(child.key):
                child = self._split(child, n)
                path.append(child)
                return child, pos + n, path
            path.append(child)
            node = child
            pos += n
        return node, pos, path

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """A new parent takes child's first n tokens; child survives (requests hold it)."""
        parent = child.parent
        assert parent is not None
        new = TreeNode(child.key[:n], child.value[:n], parent)
        if child.host is not None:
            new.host, child.host = child.host[:n], child.host[n:]
        new.lock_ref = child.lock_ref
        new.last_access = child.last_access
        new.hit_count = child.hit_count
        new.priority = child.priority
        new.stored = child.stored
        if child.blocks:
            TreeEvents.split(new, child, n)
        parent.children[self._child_key(new.key)] = new
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = new
        new.children[self._child_key(child.key)] = child
        return new

    def _child_key(self, key: Tokens) -> Any:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    # -- insert -----------------------------------------------------------------------
    def _insert(
        self,
        tokens: Tokens,
        slots: list[int],
        namespace: str,
        priority: int,
        start: TreeNode | None,
    ) -> InsertResult:
        end = len(tokens) - len(tokens) % self.page_size
        anchor = self._anchor(namespace) if end else self.root.children.get(namespace, self.root)
        if not end:
            return InsertResult(0, anchor)
        self._clock += 1
        node, depth = anchor, 0
        if start is not None and not start.anchor:
            depth = self._path_len(start, anchor)
            if depth <= end:
                node = start
                self._touch_path(start, priority)
            else:
                depth = 0  # start lies beyond these tokens: walk from the anchor
        node, pos, path = self._walk(node, tokens, end, depth)
        clock = self._clock
        for n in path:
            n.last_access = clock
            if priority > n.priority:
                n.priority = priority
        known = pos
        if self.host is not None:
            known = self._adopt(path, slots, pos)
        if pos < end:
            if self.page_size > 1:
                _check_pages(slots, pos, end, self.page_size)
            node = self._add_leaf(node, tokens[pos:end], slots[pos:end], priority)
            if self.events is not None:
                self.events.added(node, namespace, tokens, pos)
        return InsertResult(known, node)

    def _path_len(self, node: TreeNode, anchor: TreeNode) -> int:
        """Tokens from anchor down to node; raises if node is not in anchor's subtree."""
        depth, n = 0, self._lockable(node)
        while n is not None and not n.anchor:
            depth += len(n.key)
            n = n.parent
        if n is not anchor:
            raise ValueError("insert_prefix: start is not a node of this namespace")
        return depth

    def _touch_path(self, node: TreeNode | None, priority: int) -> None:
        clock = self._clock
        while node is not None and not node.anchor:
            node.last_access = clock
            if priority > node.priority:
                node.priority = priority
            node = node.parent

    def _anchor(self, namespace: str) -> TreeNode:
        anchor = self.root.children.get(namespace)
        if anchor is None:
            if not isinstance(namespace, str):
                raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
            anchor = TreeNode(as_tokens(()), [], self.root, anchor=True)
            self.root.children[namespace] = anchor
        return anchor

    def _add_leaf(self, parent: TreeNode, key: Tokens, value: list[int], priority: int) -> TreeNode:
        leaf = TreeNode(key, value, parent)
        leaf.last_access = self._clock
        leaf.priority = priority
        parent.children[self._child_key(key)] = leaf
        self._evictable += len(key)
        self._leaves.push(leaf)
        if self.host is not None and self.host.write_policy == "write_through":
            self._copy_to_host(leaf)
        return leaf

    # -- locking ----------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        n = self._lockable(node)
        while n is not None and not n.anchor:
            if n.lock_ref == 0:
                k = len(n.value)  # device slots: a host-only node holds none
                self._evictable -= k
                self._protected += k
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: TreeNode) -> None:
        n = self._lockable(node)
        if n is not None and n.lock_ref <= 0:
            raise CacheLockError(f"unlock of {node!r}, which is not locked")
        while n is not None and not n.anchor:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                k = len(n.value)
                self._protected -= k
                self._evictable += k
                if self.host is not None:
                    self._file_tiered(n)
                elif not n.children:
                    self._leaves.push(n)
            n = n.parent

    @staticmethod
    def _lockable(node: TreeNode) -> TreeNode | None:
        """node, or None for an anchor (holds nothing); raises if node left the tree."""
        if node.anchor:
            return None
        if node.parent is None:
            raise CacheLockError(f"{node!r} is no longer in the tree (evicted or flushed)")
        return node

    # -- eviction ---------------------------------------------------------------------
    def evict(self, n: int) -> int:
        if n < 0:
            raise ValueError(f"evict: cannot free a negative number of tokens ({n})")
        # Values are whole pages, so one slot per page names the page for the allocator.
        step = self.page_size
        freed: list[list[int]] = []
        count = 0
        is_leaf = _is_evictable_leaf if self.host is None else _is_device_leaf
        while count < n:
            node = self._leaves.pop(is_leaf)
            if node is None:
                break  # everything left is locked
            count += len(node.value)
            freed.append(node.value if step == 1 else node.value[::step])
            if self.host is None or not self._demote(node):
                self._remove_leaf(node)
        if freed:
            self.allocator.free(freed[0] if len(freed) == 1 else list(chain.from_iterable(freed)))
        return count

    def _remove_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None  # a leaf in the heap is in the tree
        if self.events is not None:
            self.events.removed(node)
        del parent.children[self._child_key(node.key)]
        node.parent = None
        self._leaves.discard(node)
        self._evictable -= len(node.value)
        if self.host is not None:
            self._drop_host_subtree(node)
            if parent.host is not None:
                self.host.heap.push(parent)  # may have lost its last child with a copy
        if parent.anchor:
            if not parent.children and parent is not self.root:
                self._drop_anchor(parent)
        elif self.host is not None:
            if parent.lock_ref == 0:
                self._file_tiered(parent)
        elif not parent.children and parent.lock_ref == 0:
            self._leaves.push(parent)

    # -- the host tier (host_tier.py) -------------------------------------------------
    def take_copies(self) -> list:
        return self.host.take_copies() if self.host is not None else []

    def _file_tiered(self, n: TreeNode) -> None:
        assert self.host is not None
        if n.value and not any(c.value for c in n.children.values()):
            self._leaves.push(n)
        if n.host is not None and not any(c.host is not None for c in n.children.values()):
            self.host.heap.push(n)

    def _resident(self, path: list[TreeNode], load: bool) -> list[TreeNode]:
        """The path's device part, after loading (``load``) what of its host part fits."""
        k = next((i for i, n in enumerate(path) if not n.value), len(path))
        if k == len(path) or not load:
            return path[:k]
        assert self.host is not None
        end = path[-1]
        self.lock(end)  # the whole path stays (either tier) while slots are found below
        loaded = k
        try:
            for n in path[k:]:
                assert n.host is not None  # a node holds its KV somewhere
                slots = self._alloc(self.allocator, len(n.key), self.evict)
                if slots is None:
                    break
                self.host.copy(Direction.HOST_TO_DEVICE, n.host, slots)
                n.value = slots
                self._protected += len(slots)  # locked above; unlock() moves it
                self.last_loaded += len(slots)
                loaded += 1
        finally:
            self.unlock(end)
        return path[:loaded]

    def _adopt(self, path: list[TreeNode], slots: list[int], end: int) -> int:
        """Host-only nodes an insert walked through take the request's own device slots;
        returns where the tree's device KV of this path ended before (its prefix_len)."""
        pos = end - sum(len(n.key) for n in path)
        known = end
        for n in path:
            k = len(n.key)
            if not n.value:
                if known == end:
                    known = pos
                if self.page_size > 1:
                    _check_pages(slots, pos, pos + k, self.page_size)
                n.value = slots[pos : pos + k]
                if n.lock_ref:
                    self._protected += k
                else:
                    self._evictable += k
                    self._file_tiered(n)
            pos += k
        return known

    def _demote(self, node: TreeNode) -> bool:
        """A device leaf moves to the host tier; False when it has no room (drop it)."""
        assert self.host is not None
        self._store(node)  # the last moment its whole path is on the device
        if node.host is None:
            host = self._alloc(self.host.allocator, len(node.value), self._evict_host)
            if host is None:
                return False
            self.host.copy(Direction.DEVICE_TO_HOST, node.value, host)
            node.host = host
        self._evictable -= len(node.value)
        node.value = []
        self._leaves.discard(node)
        parent = node.parent
        if parent is not None and not parent.anchor and parent.lock_ref == 0:
            self._file_tiered(parent)
        self._file_tiered(node)
        return True

    def _copy_to_host(self, node: TreeNode) -> None:
        """write_through: a host copy now, while the node stays on the device."""
        assert self.host is not None
        self._store(node)
        if node.host is not None or not node.value:
            return
        host = self._alloc(self.host.allocator, len(node.value), self._evict_host)
        if host is not None:
            self.host.copy(Direction.DEVICE_TO_HOST, node.value, host)
            node.host = host
            if node.lock_ref == 0:
                self._file_tiered(node)

    def _alloc(self, allocator: KVSlotAllocator, n: int, evict) -> list[int] | None:
        need = allocator.slots_needed(n)
        if need > allocator.num_free:
            evict(need - allocator.num_free)
        return allocator.alloc(n)

    def _evict_host(self, n: int) -> int:
        assert self.host is not None
        count = 0
        while count < n:
            node = self.host.heap.pop(_is_host_leaf)
            if node is None:
                break
            count += len(node.host or ())
            self._drop_host(node)
        return count

    def _drop_host(self, node: TreeNode) -> None:
        """Frees node's host copy; a node that was in the host tier only leaves the tree."""
        assert self.host is not None and node.host is not None
        self.host.allocator.free(node.host[:: self.page_size])
        self.host.counters.dropped += len(node.host)
        node.host = None
        self.host.heap.discard(node)
        parent = node.parent
        if not node.value:
            self._remove_leaf(node)  # none of its children had a copy: it has none
        elif parent is not None and parent.host is not None and parent.lock_ref == 0:
            self._file_tiered(parent)

    def _drop_host_subtree(self, node: TreeNode) -> None:
        """A node leaves the tree: its host copy and its (host-only) descendants go too."""
        assert self.host is not None
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not node:
                n.parent = None
            if n.host is not None:
                self.host.allocator.free(n.host[:: self.page_size])
                self.host.counters.dropped += len(n.host)
                n.host = None
                self.host.heap.discard(n)
        node.children = {}

    # -- the storage tier (storage_tier.py) ----------------------------------------------
    def _store(self, node: TreeNode) -> None:
        """Writes the pages ending inside node to storage while its whole path is on device."""
        st = self.storage
        if st is None or node.stored or not node.value:
            return
        assert self.host is not None
        node.stored = True
        namespace, path = self._path_of(node)
        p = st.page_tokens
        end = sum(len(n.key) for n in path)
        first, last = (end - len(node.key)) // p, end // p
        if first >= last:
            return
        tokens = as_tokens(list(chain.from_iterable(n.key for n in path)))
        slots = list(chain.from_iterable(n.value for n in path))[first * p : last * p]
        keys = page_keys(st.seed, namespace, tokens, first, last, p)
        self.host.copies.append(Copy(Direction.DEVICE_TO_STORAGE, slots, [], keys))
        st.counters.stored += len(slots)

    def _path_of(self, node: TreeNode) -> tuple[str, list[TreeNode]]:
        """node's namespace and its path from below the anchor down to node."""
        path = []
        n: TreeNode | None = node
        while n is not None and not n.anchor:
            path.append(n)
            n = n.parent
        namespace = next((ns for ns, a in self.root.children.items() if a is n), "")
        return namespace, path[::-1]

    def ask_storage(self, prompt: Sequence[int], namespace: str, req: object = None) -> bool:
        """Loads prompt's pages past the tree into fresh host slots; True when queued."""
        st = self.storage
        if st is None:
            return False
        assert self.host is not None
        tokens = as_tokens(prompt)
        end = len(tokens) - 1  # the last prompt token is always computed
        anchor = self.root.children.get(namespace)
        node, matched = anchor, 0
        if anchor is not None:
            node, matched, _ = self._walk(anchor, tokens, end - end % self.page_size)
        p = st.page_tokens
        first = matched // p
        last = min(end // p, first + MAX_LOAD_PAGES)
        if first >= last:
            return False
        held = node if node is not None and not node.anchor else None
        if held is not None:
            self.lock(held)  # what matched stays while host slots are found
        try:
            host = self._alloc(self.host.allocator, (last - first) * p, self._evict_host)
        finally:
            if held is not None:
                self.unlock(held)
        if host is None:
            return False
        keys = page_keys(st.seed, namespace, tokens, first, last, p)
        load = PendingLoad(namespace, tokens[: last * p], first * p, host, req)
        load_id = st.add(load)
        self.host.copies.append(Copy(Direction.STORAGE_TO_HOST, [], host, keys, load_id))
        return True

    def clear_storage(self) -> bool:
        if self.storage is None:
            return False
        assert self.host is not None
        self.host.copies.append(Copy(Direction.STORAGE_CLEAR, [], []))
        return True

    def storage_answer(self, load_id: int, pages: int) -> object:
        """Its first ``pages`` pages join the tree as host-only nodes, the rest of its host
        slots are freed; returns the waiting request (None for an unknown load)."""
        st = self.storage
        load = st.pending.pop(load_id, None) if st is not None else None
        if load is None:
            return None
        assert self.host is not None and st is not None
        p = st.page_tokens
        pages = max(0, min(pages, len(load.host) // p))
        st.counters.loaded += pages * p
        st.counters.missed += len(load.host) - pages * p
        keep = self._attach_loaded(load, load.start + pages * p) if pages else (0, 0)
        if load.req is not None:
            load.req.storage_tokens = keep[1] - keep[0]  # type: ignore[attr-defined]
        free = load.host[: keep[0]] + load.host[keep[1] :]
        if free:
            self.host.allocator.free(free[:: self.page_size])
        return load.req

    def _attach_loaded(self, load: PendingLoad, end: int) -> tuple[int, int]:
        """Hangs a load's tokens up to end under the tree's match of them; returns the range
        of load.host kept ((0, 0): none, the tree lost the pages before them)."""
        anchor = self.root.children.get(load.namespace)
        if anchor is None:
            if load.start:
                return (0, 0)
            anchor = self._anchor(load.namespace)
        node, pos, _ = self._walk(anchor, load.tokens, end)
        if pos < load.start or pos >= end:
            return (0, 0)
        leaf = TreeNode(load.tokens[pos:end], [], node)
        leaf.host = load.host[pos - load.start : end - load.start]
        leaf.stored = True
        self._clock += 1
        leaf.last_access = self._clock
        node.children[self._child_key(leaf.key)] = leaf
        self._file_tiered(leaf)
        if self.events is not None:
            self.events.added(leaf, load.namespace, load.tokens, pos)
        return (pos - load.start, end - load.start)

    def _drop_anchor(self, anchor: TreeNode) -> None:
        for ns, a in self.root.children.items():
            if a is anchor:
                del self.root.children[ns]
                return

    def reset(self) -> None:
        if self._protected:
            raise CacheLockError(
                f"cannot flush the cache: {self._protected} cached tokens are locked by "
                "in-flight requests"
            )
        slots: list[int] = []
        host: list[int] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            slots += node.value[:: self.page_size]  # one slot per page names the page
            host += (node.host or [])[:: self.page_size]
            node.parent, node.host = None, None
        self.root.children.clear()
        self._leaves.clear()
        self._evictable = 0
        if self.events is not None:
            self.events.cleared()
        if slots:
            self.allocator.free(slots)
        if self.host is not None:
            self.host.heap.clear()
            if host:
                self.host.allocator.free(host)

    # -- sizes and checks -------------------------------------------------------------
    def size_info(self) -> SizeInfo:
        return SizeInfo(self._evictable, self._protected)

    def check_integrity(self) -> None:
        host_alloc = self.host.allocator if self.host is not None else None
        held = self.storage.held_host_slots() if self.storage is not None else None
        evictable, protected = recount_tree(
            self.root, self.page_size, self.allocator, host_alloc, held
        )
        if (evictable, protected) != (self._evictable, self._protected):
            raise CacheIntegrityError(
                f"counters say evictable {self._evictable}, protected {self._protected}; "
                f"a recount finds evictable {evictable}, protected {protected}"
            )
        leaves = _evictable_leaves(self.root, self.host is not None)
        missing = sum(1 for leaf in leaves if leaf not in self._leaves)
        if missing:
            raise CacheIntegrityError(
                f"{missing} evictable leaves are missing from the eviction heap"
            )


class DisabledCache(BasePrefixCache):
    """--disable-radix-cache: matches nothing and keeps nothing (the caller frees every slot)."""

    def __init__(self, allocator: KVSlotAllocator, page_size: int = 1):
        self.allocator = allocator
        self.page_size = page_size
        self.root = TreeNode(as_tokens(()), [], None, anchor=True)

    def _match(
        self, tokens: Tokens, end: int, namespace: str, priority: int, peek: bool
    ) -> MatchResult:
        return MatchResult([], self.root)

    def _insert(
        self,
        tokens: Tokens,
        slots: list[int],
        namespace: str,
        priority: int,
        start: TreeNode | None,
    ) -> InsertResult:
        return InsertResult(0, self.root)

    def lock(self, node: TreeNode) -> None:
        self._check_root(node)

    def unlock(self, node: TreeNode) -> None:
        self._check_root(node)

    def _check_root(self, node: TreeNode) -> None:
        if node is not self.root:
            raise CacheLockError("the disabled cache only hands out its root")

    def evict(self, n: int) -> int:
        if n < 0:
            raise ValueError(f"evict: cannot free a negative number of tokens ({n})")
        return 0

    def reset(self) -> None:
        return None

    def size_info(self) -> SizeInfo:
        return SizeInfo(0, 0)

    def check_integrity(self) -> None:
        if self.root.children or self.root.lock_ref:
            raise CacheIntegrityError("the disabled cache's root grew children or locks")


def create_prefix_cache(
    allocator: KVSlotAllocator,
    page_size: int,
    disable: bool,
    policy: str,
    slru_protected_hits: int,
    host_slots: int = 0,
    write_policy: str = "write_back",
    storage: StorageTier | None = None,
    events: TreeEvents | None = None,
) -> BasePrefixCache:
    if disable:
        return DisabledCache(allocator, page_size)
    return RadixCache(
        allocator, page_size, policy, slru_protected_hits, host_slots, write_policy, storage,
        events,
    )  # fmt: skip


# -- helpers ----------------------------------------------------------------------------
def _as_list(seq: Sequence[int]) -> list[int]:
    if type(seq) is list:
        return seq
    tolist = getattr(seq, "tolist", None)  # numpy arrays and tensors: plain ints, not scalars
    return tolist() if tolist is not None else list(seq)


def common_prefix_len(
    key: Sequence[int], tokens: Sequence[int], start: int = 0, end: int | None = None
) -> int:
    """Length of the common prefix of key and tokens[start:end]. Both must be of one
    type (an array never equals a list); slice comparisons keep the work in C."""
    n = min(len(key), (len(tokens) if end is None else end) - start)
    if (key if n == len(key) else key[:n]) == tokens[start : start + n]:
        return n
    lo, hi = 0, n  # key[:lo] matches; the first mismatch lies in [lo, hi)
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if key[lo:mid] == tokens[start + lo : start + mid]:
            lo = mid
        else:
            hi = mid
    while key[lo] == tokens[start + lo]:
        lo += 1
    return lo


def _check_pages(slots: list[int], start: int, end: int, ps: int) -> None:
    """Guards that slots[start:end] are whole pages (eviction names one by its first slot)."""
    firsts, lasts = slots[start:end:ps], slots[start + ps - 1 : end : ps]
    for first, last in zip(firsts, lasts, strict=True):
        if first % ps or last != first + ps - 1:
            raise ValueError(
                f"insert_prefix: slots {first}..{last} are not one whole page of {ps} slots; "
                "the slots of a sequence must come from KVSlotAllocator.alloc in order"
            )


def _is_evictable_leaf(node: TreeNode) -> bool:
    return node.parent is not None and node.lock_ref == 0 and not node.children


def _is_device_leaf(node: TreeNode) -> bool:
    """With a host tier: an unlocked node on the device none of whose children is."""
    return (
        node.parent is not None
        and node.lock_ref == 0
        and bool(node.value)
        and not any(c.value for c in node.children.values())
    )


def _is_host_leaf(node: TreeNode) -> bool:
    """An unlocked node with a host copy none of whose children has one."""
    return (
        node.parent is not None
        and node.lock_ref == 0
        and node.host is not None
        and not any(c.host is not None for c in node.children.values())
    )


def _evictable_leaves(root: TreeNode, tiered: bool = False) -> list[TreeNode]:
    is_leaf = _is_device_leaf if tiered else _is_evictable_leaf
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if not node.anchor and is_leaf(node):
            out.append(node)
    return out
