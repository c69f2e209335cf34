"""Stop strings over streamed text.

Text that could still turn out to be the start of a stop string is held back until the
next pieces decide it, so a client never sees part of a stop string; on a match the text
is cut just before it.
"""

from __future__ import annotations

from collections.abc import Sequence


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
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Adds new text; returns what may be shown now. After a match, ``matched`` is set."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        # Held text is a prefix of some stop, so the earliest match lies inside ``buf``.
        hits = [(buf.find(s), i) for i, s in enumerate(self.stops) if s in buf]
        if hits:
            pos, i = min(hits)
            self.matched, self._held = self.stops[i], ""
            return buf[:pos]
        keep = _held_suffix_len(buf, self.stops)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end without a match: the held text was not a stop string after all."""
        out, self._held = self._held, ""
        return "" if self.matched is not None else out
