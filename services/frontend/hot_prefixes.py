"""Prefixes that many different prompts continue: worth copying to every engine.

A conversation's turns only extend its history, while after a shared prefix (a system
prompt) prompts fork. A block followed by ``forks`` different next blocks ends a hot prefix,
which routing counts as held by every engine (docs/routing.md). Keys are kept as 8-byte
ints, and memory is bounded by two generations of ``max_keys`` blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_FORKS = 16
MAX_KEYS = 50_000

Nexts = int | set[int]  # the one next block seen after a block, or the distinct ones


def _short(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


def _count(nexts: Nexts | None) -> int:
    if nexts is None:
        return 0
    return len(nexts) if isinstance(nexts, set) else 1


class HotPrefixes:
    def __init__(self, forks: int = DEFAULT_FORKS, max_keys: int = MAX_KEYS) -> None:
        self.forks, self.max_keys = forks, max_keys
        self._new: dict[int, Nexts] = {}
        self._old: dict[int, Nexts] = {}

    def hot_blocks(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of a prompt that end in or before a hot block (0: none)."""
        if self.forks <= 0:
            return 0
        for i in range(len(keys) - 1, -1, -1):
            if _count(self._seen(_short(keys[i]))) >= self.forks:
                return i + 1
        return 0

    def note(self, keys: Sequence[bytes]) -> None:
        """A prompt was routed: each block's continuation counts."""
        if self.forks <= 0:
            return
        short = [_short(k) for k in keys]
        for key, after in zip(short, short[1:], strict=False):
            nexts = self._seen(key)
            if nexts is None:
                self._new[key] = after
            elif isinstance(nexts, set):
                if len(nexts) < self.forks:
                    nexts.add(after)
                self._new[key] = nexts
            elif nexts != after:
                self._new[key] = {nexts, after}
            else:
                self._new[key] = nexts
        if len(self._new) > self.max_keys:
            self._old, self._new = self._new, {}

    def _seen(self, key: int) -> Nexts | None:
        found = self._new.get(key)
        return self._old.get(key) if found is None else found
