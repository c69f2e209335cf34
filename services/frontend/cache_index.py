"""What each engine's radix tree holds, as the router sees it: the keys of its blocks.

A prompt's blocks hash the same way (page_keys.py), so how much of a prompt an engine holds
is the longest leading run of the prompt's keys in its set. Keys this frontend sent but no
event has confirmed yet count as held for PENDING_TTL_S, so a burst sharing a new prefix
converges on one engine before it has computed it (docs/routing.md).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from services.common import page_keys

PENDING_TTL_S = 5.0

Clock = Callable[[], float]


class PromptKeys:
    """One prompt's block keys, hashed once per (seed, block_tokens) the engines use."""

    def __init__(self, namespace: str, ids: Sequence[int] | np.ndarray) -> None:
        self.namespace = namespace
        self.ids = ids
        self._by_geometry: dict[tuple[bytes, int], list[bytes]] = {}

    def keys(self, seed: bytes, block_tokens: int) -> list[bytes]:
        """Keys of every whole block of the prompt (a partial last block is never cached)."""
        geometry = (seed, block_tokens)
        keys = self._by_geometry.get(geometry)
        if keys is None:
            n_blocks = len(self.ids) // block_tokens
            keys = page_keys.block_keys(seed, self.namespace, self.ids, 0, n_blocks, block_tokens)
            self._by_geometry[geometry] = keys
        return keys


class CacheIndex:
    """One engine's block keys: what its events say it holds, plus what we sent it.

    ``block_tokens`` 0 means nothing is known yet (no snapshot): nothing matches and nothing
    sent is recorded, since the keys cannot be computed without the engine's geometry.
    """

    def __init__(self, pending_ttl_s: float = PENDING_TTL_S, clock: Clock = time.monotonic):
        self.keys: set[bytes] = set()
        self.block_tokens = 0
        self.seed = b""
        self._ttl, self._clock = pending_ttl_s, clock
        self._pending: dict[bytes, float] = {}  # key -> when it stops counting
        # In the order sent (deadlines rise along it): expiry pops from the front.
        self._sent: deque[tuple[float, list[bytes]]] = deque()

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def pending(self) -> int:
        self._expire()
        return len(self._pending)

    def clear(self) -> None:
        """Forgets everything, geometry and pending keys included."""
        self.keys = set()
        self.block_tokens, self.seed = 0, b""
        self._pending.clear()
        self._sent.clear()

    def replace(self, block_tokens: int, seed: bytes, stored: bytes) -> None:
        """A snapshot; pending keys stay (it may predate what we sent) unless geometry changed."""
        if (block_tokens, seed) != (self.block_tokens, self.seed):
            self.clear()
            self.block_tokens, self.seed = block_tokens, seed
        self.keys = set(page_keys.split_keys(stored))
        self._confirm(self.keys)

    def apply(self, cleared: bool, stored: bytes, removed: bytes) -> None:
        """One message of the stream: ``cleared`` first, then the disjoint stored/removed."""
        if cleared:
            self.keys = set()
            self._pending.clear()
            self._sent.clear()
        added = page_keys.split_keys(stored)
        gone = page_keys.split_keys(removed)
        self.keys.update(added)
        self.keys.difference_update(gone)
        self._confirm(added)
        self._confirm(gone)

    def _confirm(self, keys: Sequence[bytes] | set[bytes]) -> None:
        if self._pending:
            for k in keys:
                self._pending.pop(k, None)

    def note_sent(self, prompt: PromptKeys) -> None:
        """The prompt went to this engine: its blocks count as held for a while."""
        if not self.block_tokens:
            return
        keys = prompt.keys(self.seed, self.block_tokens)
        if not keys:
            return
        self._expire()
        deadline = self._clock() + self._ttl
        fresh = [k for k in keys if k not in self.keys]
        for k in fresh:
            self._pending[k] = deadline
        if fresh:
            self._sent.append((deadline, fresh))

    def _expire(self) -> None:
        now = self._clock()
        while self._sent and self._sent[0][0] <= now:
            deadline, keys = self._sent.popleft()
            for k in keys:
                if self._pending.get(k) == deadline:  # not sent again since
                    del self._pending[k]

    def match_tokens(self, keys: Sequence[bytes]) -> int:
        """Tokens of the longest leading run of ``keys`` this engine holds (or was sent)."""
        self._expire()
        held, pending = self.keys, self._pending
        n = 0
        for k in keys:
            if k not in held and k not in pending:
                break
            n += 1
        return n * self.block_tokens

    def match_prompt(self, prompt: PromptKeys) -> int:
        """match_tokens of the prompt's keys in this engine's geometry (0: none known)."""
        if not self.block_tokens:
            return 0
        return self.match_tokens(prompt.keys(self.seed, self.block_tokens))
