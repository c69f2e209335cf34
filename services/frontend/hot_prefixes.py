"""Prefixes that many different prompts continue: worth copying to every engine.

A system prompt that every conversation opens with, on one engine only, would pull every
new conversation there: matched tokens alone cannot tell it from one conversation's own
history. What tells them apart is how prompts go on after it: a conversation's turns only
extend its history (each of its blocks is followed by the same next block), while after a
shared prefix the prompts fork. A block that ``forks`` different next blocks followed ends
a hot prefix: routing counts it as held by every engine (router.py), so requests behind it
spread by load, and each engine computes it once.

Memory: keys are kept as their first 8 bytes (an int), a block followed by one next block
as one int, and sets (of at most ``forks`` ints) only where prompts fork; bounded by
generations (past ``max_keys`` blocks the older generation goes). About 100 bytes a block
where prompts rarely fork (~10 MB at the bound), ~1.3 KB for a block that forked ``forks``
ways: ~130 MB if every block did.
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
