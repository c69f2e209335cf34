"""Stop strings over streamed text.

Text that could still turn out to be the start of a stop string is held back until the
next pieces decide it, so a client never sees part of a stop string; on a match the text
is cut just before it.

With min_tokens, as in vLLM, a stop string must end in the text of a token after the first
min_tokens: ``feed`` takes how many leading characters of its text are still under that
floor (a match may start in them, never end there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def _held_suffix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class StopStringMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self._held_floor = 0  # leading characters of _held under the min_tokens floor
        self.matched: str | None = None

    def feed(self, text: str, floor_chars: int = 0) -> str:
        """Adds new text; returns what may be shown now. After a match, ``matched`` is set.
        No match may end in the first ``floor_chars`` characters of ``text``."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        # No match ends before ``floor`` (held text under the floor stays under it).
        floor = len(self._held) + floor_chars if floor_chars else self._held_floor
        found = ((buf.find(s, max(0, floor - len(s) + 1)), i) for i, s in enumerate(self.stops))
        hits = [(pos, i) for pos, i in found if pos >= 0]
        if hits:
            pos, i = min(hits)
            self.matched, self._held = self.stops[i], ""
            return buf[:pos]
        keep = _held_suffix_len(buf, self.stops)
        self._held = buf[len(buf) - keep :] if keep else ""
        self._held_floor = max(0, floor - (len(buf) - keep))
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end without a match: the held text was not a stop string after all."""
        out, self._held = self._held, ""
        return "" if self.matched is not None else out


def feed_tokens(
    stops: StopStringMatcher,
    decode: Callable[[Sequence[int]], str],
    ids: Sequence[int],
    done_before: int,
    min_tokens: int,
) -> str:
    """``ids`` (output tokens done_before.. of a request) through ``decode`` into ``stops``:
    the text of those still within the first min_tokens cannot end a stop string."""
    under = max(0, min(len(ids), min_tokens - done_before))
    if not under:
        return stops.feed(decode(ids))
    head = decode(ids[:under])
    return stops.feed(head + decode(ids[under:]), floor_chars=len(head))
