"""Constrained requests wait for their grammar before they take any KV.

The worker compiles grammars (this process has no torch): the next batch asks for it, and
the request is skipped by admission (``Req.grammar_wait``) until a result settles it.
"""

from __future__ import annotations

from radixserve.internal.v1 import engine_pb2
from services.scheduler.request import Req


class GrammarGate:
    def __init__(self) -> None:
        self._unsent: list[Req] = []  # not asked of the worker yet
        self._compiling: dict[str, Req] = {}  # asked, not settled, by rid

    def add(self, req: Req) -> None:
        if req.sampling.HasField("constraint"):
            req.grammar_wait = True
            self._unsent.append(req)

    def waiting(self) -> bool:
        return bool(self._unsent or self._compiling)

    def num_waiting(self) -> int:
        """Requests waiting on a grammar (an aborted one counts until its grammar settles)."""
        return len(self._unsent) + len(self._compiling)

    def take_requests(self) -> list[engine_pb2.GrammarCompile]:
        """The compiles for the next batch (each asked for once)."""
        out = []
        for req in self._unsent:
            if not req.finished:
                out.append(
                    engine_pb2.GrammarCompile(rid=req.rid, constraint=req.sampling.constraint)
                )
                self._compiling[req.rid] = req
        self._unsent = []
        return out

    def settle(
        self, statuses: list[engine_pb2.GrammarStatus]
    ) -> list[tuple[Req, engine_pb2.GrammarStatus]]:
        """Ready grammars free their requests for admission; returns the refused ones."""
        refused = []
        for st in statuses:
            req = self._compiling.pop(st.rid, None)
            if req is None or req.finished:
                continue  # aborted while it compiled
            if st.error:
                refused.append((req, st))
            else:
                req.grammar_wait = False
        return refused
