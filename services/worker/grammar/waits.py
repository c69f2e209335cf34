"""Requests waiting for their grammar, by request id, and what to tell the scheduler.

A wait settles ready, refused (INVALID_ARGUMENT) or timed out (DEADLINE_EXCEEDED). A
timed-out compile is not cancelled: it finishes and is cached, so a timeout never marks a
grammar invalid.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

import xgrammar as xgr

from services.worker.batch import Constraint, GrammarStatus
from services.worker.grammar.compiler import GrammarCompiler, GrammarError


class CompileWaits:
    def __init__(self, compiler: GrammarCompiler, timeout_s: float):
        self.compiler = compiler
        self.timeout_s = timeout_s
        self._waits: dict[str, tuple[Future[xgr.CompiledGrammar], float]] = {}

    def add(self, rid: str, c: Constraint) -> None:
        self._waits[rid] = (self.compiler.submit(c), time.monotonic() + self.timeout_s)

    def __len__(self) -> int:
        return len(self._waits)

    def clear(self) -> None:
        """Forgets every wait; compiles go on and stay cached."""
        self._waits.clear()

    def settled(self, wait_s: float = 0.0) -> list[GrammarStatus]:
        """Statuses of newly settled waits; blocks up to ``wait_s`` for a first one."""
        if wait_s > 0 and self._waits and not self._any_settled():
            deadline = min(d for _, d in self._waits.values())
            timeout = max(0.0, min(wait_s, deadline - time.monotonic()))
            wait([f for f, _ in self._waits.values()], timeout, FIRST_COMPLETED)
        now = time.monotonic()
        out: list[GrammarStatus] = []
        for rid, (fut, deadline) in list(self._waits.items()):
            status = _status(rid, fut) if fut.done() else None
            if status is None and now >= deadline:
                status = GrammarStatus(
                    rid,
                    f"the grammar did not compile within --grammar-compile-timeout "
                    f"({self.timeout_s:g} s); it keeps compiling and a later request with "
                    "the same constraint may find it ready",
                    "DEADLINE_EXCEEDED",
                )
            if status is not None:
                del self._waits[rid]
                out.append(status)
        return out

    def _any_settled(self) -> bool:
        now = time.monotonic()
        return any(f.done() or now >= d for f, d in self._waits.values())


def _status(rid: str, fut: Future[xgr.CompiledGrammar]) -> GrammarStatus:
    e = fut.exception()
    if e is None:
        return GrammarStatus(rid)
    code = "INVALID_ARGUMENT" if isinstance(e, GrammarError) else "INTERNAL"
    return GrammarStatus(rid, str(e), code)
