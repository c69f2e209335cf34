"""Stop strings and stop regexes over streamed text.

Text that could still start a stop string (or a partial regex match) is held back, so a
client never sees part of one; on a match the text is cut just before it. Regexes also see
the last STOP_REGEX_LOOKBACK characters shown, and run on the ``regex`` package because it
finds partial matches and can time out: a pattern that backtracks too long ends its request
(StopRegexTimeout) instead of stalling the event loop. With min_tokens, as in vLLM, a match
may not end within the text of the first min_tokens tokens.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence

import regex

STOP_REGEX_LOOKBACK = 1024  # characters of shown text a regex match may start in
STOP_REGEX_MAX_HELD = 1024  # characters of a partial regex match held back at most
STOP_REGEX_BUDGET_S = 0.05  # regex search time allowed for one piece, all patterns together


class StopRegexTimeout(Exception):
    """A stop regex took longer than STOP_REGEX_BUDGET_S on one piece of text."""

    def __init__(self, index: int, pattern: str) -> None:
        super().__init__(
            f"matching the pattern {pattern!r} took over {STOP_REGEX_BUDGET_S * 1000:g} ms "
            "on one piece of output (it backtracks too much); simplify it"
        )
        self.index = index


def compile_stop_regex(pattern: str) -> regex.Pattern[str]:
    """The pattern as the matcher runs it; ValueError saying why it cannot be one."""
    try:
        re.compile(pattern)  # the contract is Python's re syntax...
        compiled = regex.compile(pattern)  # ...run by regex (VERSION0: re's semantics)
    except (re.error, regex.error) as e:
        raise ValueError(f"is not a valid regular expression: {e}") from None
    if compiled.fullmatch("") is not None:
        raise ValueError("matches the empty string, so it would stop before any output")
    return compiled


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
    def __init__(self, stops: Sequence[str], regexes: Sequence[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self._patterns = list(regexes)
        self._regexes = [compile_stop_regex(p) for p in self._patterns]
        self._held = ""
        self._shown = 0  # characters shown so far: where _held starts in the whole text
        self._floor_end = 0  # no match may end at or before this index of the whole text
        self._tail = ""  # the last STOP_REGEX_LOOKBACK characters shown (regexes only)
        self.matched: str | None = None  # the stop string, or the pattern, that matched

    @property
    def active(self) -> bool:
        return bool(self.stops or self._regexes)

    def feed(self, text: str, floor_chars: int = 0) -> str:
        """Adds new text; returns what may be shown now. After a match, ``matched`` is set.
        No match may end in the first ``floor_chars`` characters of ``text``."""
        if self.matched is not None:
            return ""
        if not self.stops and not self._regexes:
            return text
        buf = self._held + text
        if floor_chars:  # held text under the floor stays under it
            self._floor_end = self._shown + len(self._held) + floor_chars
        floor = max(0, self._floor_end - self._shown)  # in buf
        deadline = time.monotonic() + STOP_REGEX_BUDGET_S
        hits = self._string_hits(buf, floor) + self._regex_hits(buf, deadline)
        if hits:
            pos, matched = min(hits, key=lambda h: h[0])
            self.matched, self._held = matched, ""
            return buf[:pos]
        keep = max(_held_suffix_len(buf, self.stops), self._regex_hold(buf, deadline))
        return self._show(buf, keep)

    def flush(self) -> str:
        """At the end without a match: the held text was not a stop string after all."""
        out, self._held = self._held, ""
        return "" if self.matched is not None else out

    def _string_hits(self, buf: str, floor: int) -> list[tuple[int, str]]:
        found = ((buf.find(s, max(0, floor - len(s) + 1)), s) for s in self.stops)
        return [(pos, s) for pos, s in found if pos >= 0]

    # Searched in ctx = _tail + buf: index i of ctx is _shown - len(_tail) + i of the whole
    # text, and buf starts at len(_tail). Once the tail has lost the text's start, searches
    # begin at ctx[1], so that ^ and \A never match at a cut (they need the real start).

    def _ctx(self, buf: str) -> tuple[str, int]:
        start = 1 if self._shown > len(self._tail) else 0
        return self._tail + buf, start

    def _regex_hits(self, buf: str, deadline: float) -> list[tuple[int, str]]:
        """(where in buf to cut, pattern) of each pattern's earliest match that ends past
        the floor; a match that starts in shown text cuts at buf's start."""
        if not self._regexes:
            return []
        ctx, start = self._ctx(buf)
        floor = self._floor_end - (self._shown - len(self._tail))  # in ctx
        hits = []
        for i in range(len(self._regexes)):
            m = self._first(i, ctx, start, deadline, lambda m: m.end() > floor)
            if m is not None:
                hits.append((max(0, m.start() - len(self._tail)), self._patterns[i]))
        return hits

    def _regex_hold(self, buf: str, deadline: float) -> int:
        """Characters at buf's end that a later piece could make the start of a match."""
        if not self._regexes:
            return 0
        ctx, start = self._ctx(buf)
        keep = 0
        for i in range(len(self._regexes)):
            m = self._first(i, ctx, start, deadline, lambda m: m.partial, partial=True)
            if m is not None:
                keep = max(keep, len(ctx) - max(m.start(), len(self._tail)))
        return min(keep, STOP_REGEX_MAX_HELD)

    def _first(
        self,
        i: int,
        ctx: str,
        start: int,
        deadline: float,
        want: Callable[[regex.Match[str]], bool],
        partial: bool = False,
    ) -> regex.Match[str] | None:
        """Pattern i's first match in ctx (overlapping; with ``partial`` also one left open
        at the end) that ``want`` takes, within the piece's time budget."""
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            found = self._regexes[i].finditer(
                ctx, start, overlapped=True, partial=partial, timeout=left
            )
            return next((m for m in found if want(m)), None)
        except TimeoutError:
            raise StopRegexTimeout(i, self._patterns[i]) from None

    def _show(self, buf: str, keep: int) -> str:
        shown = buf[: len(buf) - keep]
        self._held = buf[len(buf) - keep :]
        self._shown += len(shown)
        if self._regexes:
            self._tail = (self._tail + shown)[-STOP_REGEX_LOOKBACK:]
        return shown


def feed_tokens(
    stops: StopStringMatcher,
    decode: Callable[[Sequence[int]], str],
    ids: Sequence[int],
    done_before: int,
    min_tokens: int,
) -> str:
    """``ids`` through ``decode`` into ``stops``; those within the first min_tokens end no stop."""
    under = max(0, min(len(ids), min_tokens - done_before))
    if not under:
        return stops.feed(decode(ids))
    head = decode(ids[:under])
    return stops.feed(head + decode(ids[under:]), floor_chars=len(head))
