"""Where each request is: waiting for admission, or running with a table row and KV.
Both queues keep their order and answer membership and removal in O(1).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from services.scheduler.kv_manager import KVManager
from services.scheduler.req_slots import ReqSlotTable
from services.scheduler.request import Req


class ReqQueue:
    """Requests in order (a Req hashes by identity), and the prompt tokens they hold."""

    __slots__ = ("_reqs", "tokens")

    def __init__(self) -> None:
        # An insertion-ordered set; the value is what was counted into ``tokens``.
        self._reqs: dict[Req, int] = {}
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._reqs)

    def __contains__(self, req: object) -> bool:
        return req in self._reqs

    def append(self, req: Req) -> None:
        if req not in self._reqs:
            self._reqs[req] = n = len(req.input_ids)
            self.tokens += n

    def push_front(self, req: Req) -> None:
        self.discard(req)
        n = len(req.input_ids)
        self._reqs = {req: n, **self._reqs}  # O(n), but only on a retraction
        self.tokens += n

    def discard(self, req: Req) -> None:
        self.tokens -= self._reqs.pop(req, 0)


class ReqQueues:
    def __init__(self, kv: KVManager, table: ReqSlotTable, cache_finished: bool):
        self.waiting = ReqQueue()
        self.running = ReqQueue()
        self.by_rid: dict[str, Req] = {}  # every request not finished yet
        self.kv = kv
        self.table = table
        self._cache_finished = cache_finished  # False with --disable-radix-cache

    def add(self, req: Req) -> None:
        self.by_rid[req.rid] = req
        self.waiting.append(req)

    def assign_row(self, req: Req) -> None:
        req.req_slot = self.table.alloc()

    def start(self, admitted: Iterable[Req]) -> None:
        for req in admitted:
            self.waiting.discard(req)
            self.running.append(req)

    def leave_running(self, req: Req, cache_it: bool) -> None:
        """Its KV goes to the tree (cache_it) or is freed; its table row is given back."""
        self.running.discard(req)
        if req.lookahead:
            # The queued step computes a token nobody will read: give back its slot (the
            # worker runs batches in order, so the slot's next owner writes after it).
            self.kv.shrink(req, 1)
            req.lookahead = 0
        if req.draft_slots:  # a verify step's drafts (never beside a lookahead): alike
            self.kv.shrink(req, req.draft_slots)
            req.draft_slots = 0
        self.kv.release(req, cache_it=cache_it and self._cache_finished)
        if req.req_slot is not None:
            self.table.free(req.req_slot)
            req.req_slot = None

    def retract(self, req: Req) -> None:
        """Back to the front of the waiting queue; what it computed stays in the tree."""
        self.leave_running(req, cache_it=True)
        req.num_retractions += 1
        self.waiting.push_front(req)

    def forget(self, req: Req) -> None:
        self.by_rid.pop(req.rid, None)
