"""The radix tree's blocks as the frontends' routers see them (engine.proto CacheEvents).

A block's key chains seed, namespace and every token up to its end (page_keys.py), so a
router hashing a prompt alike learns how much of it this engine holds. Each node keeps the
keys of the blocks ending inside it, so a new leaf hashes only its own. Changes per step
are net (stored then removed reports once); host-tier KV counts as held, storage does not.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from radixserve.internal.v1 import engine_pb2
from services.common.page_keys import block_keys, chain, root_key


class TreeNode(Protocol):
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
    """--cache-event-block-tokens rounded up to whole KV pages: a block inside a page could
    end in two sibling nodes, and one's eviction would unlist what the other holds."""
    if asked < 1:
        raise ValueError(f"--cache-event-block-tokens must be >= 1, got {asked}")
    return -(-asked // page_size) * page_size


def route_seed(model_id: str) -> bytes:
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
        """node now holds tokens[pos:pos + len(node.key)] of a sequence."""
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
        """The key of block first-1 from the nearest keyed ancestor (None: hash from the start)."""
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
        blocks = child.blocks
        new.blocks = [(off, k) for off, k in blocks if off <= n]
        child.blocks = [(off - n, k) for off, k in blocks if off > n]

    def removed(self, node: TreeNode) -> None:
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
        """The changes since the last call (None: nothing changed)."""
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
        """Every key the tree holds (call right after ``take``)."""
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
