"""Integrity checks of the KV bookkeeping: the slot invariant and a full recount of a tree.
Run when idle and by the tests; they walk everything, so never on the hot path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from services.scheduler.allocator import KVSlotAllocator


class _TokenCounts(Protocol):
    @property
    def evictable(self) -> int: ...
    @property
    def protected(self) -> int: ...


class _CountingCache(Protocol):
    """A protocol, not BasePrefixCache: radix_cache re-exports this module."""

    def size_info(self) -> _TokenCounts: ...


class SlotLeakError(RuntimeError):
    """free + evictable + protected + held-by-requests != total."""


class CacheIntegrityError(RuntimeError):
    """The radix tree disagrees with itself (counters, lock counts, keys vs values)."""


def check_slot_integrity(
    allocator: KVSlotAllocator, cache: _CountingCache, held_by_requests: int
) -> None:
    info = cache.size_info()
    free, total = allocator.num_free, allocator.total
    seen = free + info.evictable + info.protected + held_by_requests
    if seen != total:
        raise SlotLeakError(
            f"KV slots do not add up: free {free} + evictable {info.evictable} + protected "
            f"{info.protected} + held by requests {held_by_requests} = {seen}, but total is "
            f"{total} ({'leaked' if seen < total else 'counted twice'}: {abs(total - seen)})"
        )


def recount_tree(
    root: Any,
    page_size: int,
    allocator: KVSlotAllocator | None,
    host_allocator: KVSlotAllocator | None = None,
    host_held: list[int] | None = None,
) -> tuple[int, int]:
    """Checks every node; returns the recounted (evictable, protected) device tokens.
    ``host_held``: host slots reserved by storage loads not yet answered."""
    evictable = protected = 0
    slots: set[int] = set()
    n_slots = 0
    host: set[int] = set()
    n_host = 0
    stack = [(anchor, ns) for ns, anchor in root.children.items()]
    for anchor, ns in stack:
        if not anchor.anchor or anchor.parent is not root or anchor.key:
            raise CacheIntegrityError(f"namespace anchor {ns!r} is malformed")
    while stack:
        node, _ = stack.pop()
        child_locks = 0
        for ckey, child in node.children.items():
            _check_node(child, ckey, node, page_size)
            if child.value and not node.anchor and not node.value:
                raise CacheIntegrityError("a node on the device has a parent that is not")
            child_locks += child.lock_ref
            n = len(child.value)
            if child.lock_ref:
                protected += n
            else:
                evictable += n
            slots.update(child.value)
            n_slots += n
            copy = getattr(child, "host", None)
            if copy is not None:
                host.update(copy)
                n_host += len(copy)
            stack.append((child, ckey))
        if not node.anchor and node.lock_ref < child_locks:
            raise CacheIntegrityError(
                f"node lock count {node.lock_ref} is below its children's total {child_locks}"
            )
    if host_held:
        host.update(host_held)
        n_host += len(host_held)
    if len(slots) != n_slots:
        raise CacheIntegrityError(f"{n_slots - len(slots)} slots appear twice in the tree")
    if len(host) != n_host:
        raise CacheIntegrityError(f"{n_host - len(host)} host slots appear twice in the tree")
    if host_allocator is not None:
        used = host_allocator.total - host_allocator.num_free
        if used != n_host or any(host_allocator.is_free(s) for s in host):
            raise CacheIntegrityError(
                f"the host tier has {used} slots in use but the tree holds {n_host}"
            )
    elif n_host:
        raise CacheIntegrityError(f"{n_host} host slots in a tree without a host tier")
    if allocator is not None:
        free_in_tree = [s for s in slots if allocator.is_free(s)]
        if free_in_tree:
            raise CacheIntegrityError(
                f"tree holds slots the allocator calls free: {free_in_tree[:8]}"
            )
    return evictable, protected


def _check_node(node: Any, ckey: Any, parent: Any, page_size: int) -> None:
    n = len(node.key)
    if node.parent is not parent:
        raise CacheIntegrityError("a child's parent link does not point at its parent")
    copy = getattr(node, "host", None)
    if copy is not None and len(copy) != n:
        raise CacheIntegrityError(f"node has {n} key tokens but {len(copy)} host slots")
    if n == 0 or n != len(node.value) and not (copy is not None and not node.value):
        raise CacheIntegrityError(f"node has {n} key tokens but {len(node.value)} slots")
    if n % page_size:
        raise CacheIntegrityError(f"node of {n} tokens is not whole pages of {page_size}")
    want = node.key[0] if page_size == 1 else tuple(node.key[:page_size])
    if ckey != want:
        raise CacheIntegrityError(f"child filed under {ckey!r} but its key starts {want!r}")
    if page_size > 1 and node.value:
        for i in range(0, n, page_size):
            first = node.value[i]
            if first % page_size or node.value[i : i + page_size] != list(
                range(first, first + page_size)
            ):
                raise CacheIntegrityError(
                    f"slots {node.value[i : i + page_size]} are not one whole page"
                )
    if node.lock_ref < 0:
        raise CacheIntegrityError(f"negative lock count {node.lock_ref}")
