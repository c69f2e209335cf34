"""Decode steps (with drafts under speculation), the overlap schedule's lookahead step,
and retraction when the KV pool runs dry."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from radixserve.internal.v1 import engine_pb2
from services.scheduler.batch import Item
from services.scheduler.batch_log import BatchLog
from services.scheduler.kv_manager import KVManager
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.prefill import NewTokenRatio
from services.scheduler.req_queues import ReqQueues
from services.scheduler.request import Req
from services.scheduler.speculative import Speculator
from services.scheduler.worker_link import WorkerError

log = logging.getLogger("radixserve.scheduler")


@dataclass(eq=False)
class DecodeBuilder:
    queues: ReqQueues
    ratio: NewTokenRatio
    max_model_len: int
    metrics: SchedulerMetrics
    batch_log: BatchLog
    spec: Speculator

    @property
    def kv(self) -> KVManager:
        return self.queues.kv

    # -- the plain step ---------------------------------------------------------------
    def any_decoding(self) -> bool:
        return any(not r.in_prefill for r in self.queues.running)

    def build(self) -> list[Item]:
        """One decode step of every running request, retracting others if KV runs out
        (a request's drafts are dropped first)."""
        running = self.queues.running
        decoding = [r for r in running if not r.in_prefill]
        spec = self.spec
        step_drafts = spec.step_drafts(decoding, self.max_model_len) if spec.enabled else {}
        items: list[Item] = []
        for req in decoding:
            if req not in running:  # retracted below
                continue
            drafts = step_drafts.get(req, [])
            while self.kv.grow(req, 1 + len(drafts)) is None:
                if drafts:
                    drafts = []
                    continue
                if not self._retract_one(keep=req):
                    raise WorkerError(
                        "decode cannot get one KV slot even after retracting every other request"
                    )
            req.draft_slots = len(drafts)
            items.append(Item.decode(req, drafts=tuple(drafts)))
        # A request retracted after it got its slot this step must not run.
        return [it for it in items if it.req in running]

    def after_step(self, n_reqs: int, n_tokens: int, result: engine_pb2.ForwardResult) -> None:
        """Counts a decode step of n_reqs requests that came back with n_tokens tokens."""
        self.ratio.decay()
        running = self.queues.running
        self.batch_log.decode(
            n_tokens,
            len(running),
            sum(r.kv_len for r in running),
            self.kv.usage,
            result.cuda_graph,
            len(self.queues.waiting),
            n_reqs,
        )

    # -- the overlap schedule ---------------------------------------------------------
    def lookahead(self, current: list[Item], batch_id: int) -> list[Item]:
        """The decode step after ``current`` (to go as batch ``batch_id``), built before its
        tokens are known. [] when a chunked prefill runs next, the pool runs short, or
        speculation wants the next step."""
        if self.spec.enabled and self._speculating_next(current):
            return []
        sampling = {it.req for it in current if it.sample}
        items: list[Item] = []
        for req in self.queues.running:
            if req.in_prefill:
                return self._take_back(items)
            from_last = req in sampling
            if not self._can_run_ahead(req, from_last):
                continue
            if self.kv.grow(req, 1) is None:
                return self._take_back(items)
            req.lookahead = batch_id
            items.append(Item.decode(req, from_last=from_last))
        return items

    def _speculating_next(self, current: list[Item]) -> bool:
        """A verify step is in flight, or some request would draft in the next step."""
        if any(it.drafts for it in current):
            return True
        decoding = [r for r in self.queues.running if not r.in_prefill]
        return self.spec.would_verify(decoding, self.max_model_len)

    def _can_run_ahead(self, req: Req, sampled_in_current: bool) -> bool:
        if not sampled_in_current:
            # Its input is a token it already has, or it is not in a decode step at all.
            return req.kv_len == req.seq_len - 1
        # Its input is the token current samples. Its length stop is known now; a dirty
        # table row needs the full output ids, which the worker's row does not have yet.
        return not (
            req.table_dirty
            or len(req.output_ids) + 1 >= req.max_new_tokens
            or req.seq_len + 1 >= self.max_model_len
        )

    def _take_back(self, items: list[Item]) -> list[Item]:
        for it in items:
            self.kv.shrink(it.req, 1)
            it.req.lookahead = 0
        return []

    # -- retraction -------------------------------------------------------------------
    def _retract_one(self, keep: Req) -> bool:
        victim = self._pick_victim(keep)
        if victim is None:
            return False
        grown = victim.kv_len - (victim.seq_len - 1)  # this step's slot (and its drafts')
        if not victim.in_prefill and grown > 0:
            self.kv.shrink(victim, grown)
            victim.draft_slots = 0
        self.queues.retract(victim)
        old = self.ratio.value
        self.ratio.raise_after_retract()
        self.metrics.on_retract()
        log.warning(
            "Retract requests. #retracted-reqs: 1, rid: %s, #decoded: %d, "
            "#new-token-ratio: %.4f -> %.4f, #running-req: %d, #queue-req: %d",
            victim.rid,
            len(victim.output_ids),
            old,
            self.ratio.value,
            len(self.queues.running),
            len(self.queues.waiting),
        )
        return True

    def _pick_victim(self, keep: Req) -> Req | None:
        """Decoding requests first, then fewest tokens decoded, then longest prompt."""
        running = self.queues.running
        victims = [r for r in running if r is not keep and not r.in_prefill]
        victims = victims or [r for r in running if r is not keep]
        if not victims:
            return None
        return min(victims, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
