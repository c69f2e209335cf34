"""The radix tree's blocks as the frontends' routers see them (engine.proto CacheEvents).

A block is ``block_tokens`` consecutive tokens from a sequence's start; its key hashes the
seed, the namespace and every token up to its end (services/common/page_keys.py), so a
router that hashes a prompt the same way learns how much of it this engine holds. Each tree
node keeps the keys of the blocks that end inside it, with their end offsets, so a new leaf
hashes only its own blocks (chained from the nearest ancestor's last key), a split divides
them and a node leaving the tree reports them without walking its path.

Changes are gathered between two publishes into one set per step: a key stored and removed
within one step is reported once, as what it ended as. A node counts as held while it has
KV on the device or in the host tier (a host hit is a copy, not a prefill); the storage tier
is shared and not per engine.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from radixserve.internal.v1 import engine_pb2
from services.common.page_keys import block_keys, chain, root_key


class TreeNode(Protocol):
    """What the events read of radix_cache.TreeNode (it sets ``blocks``)."""

    blocks: Sequence[tuple[int, bytes]]

    @property
    def key(self) -> Sequence[int]: ...
    @property
    def parent(self) -> TreeNode | None: ...
    @property
    def anchor(self) -> bool: ...
    @property
    def children(self) -> Mapping[Any, TreeNode]: ...


DEFAULT_BLOCK_TOKENS = 16


def block_tokens_for(asked: int, page_size: int) -> int:
    """The events' block: --cache-event-block-tokens rounded up to whole KV pages. A block
    inside a page could end in two nodes at once (two sequences sharing part of a page sit
    in sibling nodes), and one node's eviction would then unlist what the other holds."""
    if asked < 1:
        raise ValueError(f"--cache-event-block-tokens must be >= 1, got {asked}")
    return -(-asked // page_size) * page_size


def route_seed(model_id: str) -> bytes:
    """The chain's seed: what a router needs besides the tokens (one model per frontend)."""
    return f"radixserve-route1|{model_id}".encode()


class TreeEvents:
    def __init__(self, block_tokens: int, seed: bytes):
        if block_tokens < 1:
            raise ValueError(f"--cache-event-block-tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.seed = seed
        self.instance_id = uuid.uuid4().hex
        self.seq = 0
        self._changes: dict[bytes, bool] = {}  # key -> held, since the last publish
        self._cleared = False

    # -- the tree's hooks (radix_cache.py) -------------------------------------------------
    def added(self, node: TreeNode, namespace: str, tokens: Sequence[int], pos: int) -> None:
        """node now holds tokens[pos:pos + len(node.key)] of a sequence (tokens from its
        start): its blocks are those that end inside it."""
        b, end = self.block_tokens, pos + len(node.key)
        first, last = pos // b, end // b
        if first >= last:
            node.blocks = []
            return
        prev = self._key_before(node, namespace, first)
        keys = (
            chain(prev, tokens, first, last, b)
            if prev is not None
            else block_keys(self.seed, namespace, tokens, first, last, b)
        )
        node.blocks = [((first + i + 1) * b - pos, k) for i, k in enumerate(keys)]
        for k in keys:
            self._changes[k] = True

    def _key_before(self, node: TreeNode, namespace: str, first: int) -> bytes | None:
        """The key of block first-1: the last block of the nearest ancestor that has one
        (None: hash from the start, e.g. a block that was never keyed)."""
        if first == 0:
            return root_key(self.seed, namespace)
        n = node.parent
        while n is not None and not n.anchor:
            if n.blocks:
                return n.blocks[-1][1]
            n = n.parent
        return None

    @staticmethod
    def split(new: TreeNode, child: TreeNode, n: int) -> None:
        """child was cut after n tokens, new taking the first n: the blocks ending there
        move to new."""
        blocks = child.blocks
        new.blocks = [(off, k) for off, k in blocks if off <= n]
        child.blocks = [(off - n, k) for off, k in blocks if off > n]

    def removed(self, node: TreeNode) -> None:
        """node leaves the tree, and everything below it."""
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            for _, k in n.blocks:
                self._changes[k] = False

    def cleared(self) -> None:
        self._changes.clear()
        self._cleared = self.seq > 0  # before the first message nobody holds anything

    # -- what goes on the wire -----------------------------------------------------------
    def take(self) -> engine_pb2.CacheEvents | None:
        """The changes since the last call as one message (None: nothing changed)."""
        if not self._changes and not self._cleared:
            return None
        self.seq += 1
        msg = self._message(cleared=self._cleared)
        msg.stored = b"".join(k for k, held in self._changes.items() if held)
        msg.removed = b"".join(k for k, held in self._changes.items() if not held)
        self._changes.clear()
        self._cleared = False
        return msg

    def heartbeat(self) -> engine_pb2.CacheEvents:
        return self._message()

    def snapshot(self, root: TreeNode) -> engine_pb2.CacheEvents:
        """Every key the tree holds, at the current seq (call right after ``take``)."""
        keys: list[bytes] = []
        stack = list(root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            keys.extend(k for _, k in n.blocks)
        msg = self._message(snapshot=True)
        msg.stored = b"".join(keys)
        return msg

    def _message(self, cleared: bool = False, snapshot: bool = False) -> engine_pb2.CacheEvents:
        return engine_pb2.CacheEvents(
            instance_id=self.instance_id,
            seq=self.seq,
            block_tokens=self.block_tokens,
            seed=self.seed,
            cleared=cleared,
            snapshot=snapshot,
        )
