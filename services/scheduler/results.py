"""What a ForwardResult does to its requests: settle grammars and storage loads, commit
prefill KV, free rejected drafts, append tokens, stop or stream. Also the one place a
request ends (``finish``), for the admission paths as well.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from radixserve.internal.v1 import engine_pb2
from services.scheduler import prompt_logprobs, request_spans
from services.scheduler.batch import Item
from services.scheduler.grammar_gate import GrammarGate
from services.scheduler.kv_manager import KVManager
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.outbox import Outbox
from services.scheduler.req_queues import ReqQueues
from services.scheduler.request import Req
from services.scheduler.speculative import Speculator

log = logging.getLogger("radixserve.scheduler")


@dataclass(eq=False)
class ResultApplier:
    queues: ReqQueues
    spec: Speculator
    metrics: SchedulerMetrics
    outbox: Outbox
    grammars: GrammarGate
    max_model_len: int
    cache_prefills: bool  # prefill chunks go to the tree (off with --disable-radix-cache)

    @property
    def kv(self) -> KVManager:
        return self.queues.kv

    # -- a batch came back ------------------------------------------------------------
    def apply(self, items: list[Item], result: engine_pb2.ForwardResult) -> None:
        self._settle_grammars(result.grammars)
        self._settle_storage(result)
        if result.error:
            self._fail(items, result)
            return
        now = time.time()
        for it, tok in zip(items, result.tokens, strict=True):
            if not it.req.finished:  # finished (or aborted) while this step was queued
                self._apply_item(it, tok, result.batch_id, now)

    def _apply_item(
        self, it: Item, tok: engine_pb2.SampledToken, batch_id: int, now: float
    ) -> None:
        req = it.req
        if req.lookahead == batch_id:
            req.lookahead = 0  # no step of it in flight any more (a later one may be)
        if it.is_prefill:
            request_spans.on_prefill_chunk(req, it.n)
            prompt_logprobs.collect(req, list(tok.prompt_logprobs))
            if self.cache_prefills:
                self.kv.commit(req, it.start + it.n)
        if len(tok.extra_token_ids) > len(it.drafts):  # never from a sound worker
            self.end_running(
                req,
                "INTERNAL",
                f"the worker committed {len(tok.extra_token_ids)} tokens past the first of a "
                f"step with {len(it.drafts)} drafts",
            )
            return
        if it.drafts:
            self._verified(it, tok)
        if it.sample:
            self._append_token(req, tok, now)
        elif req.prefill_only and it.start + it.n == req.seq_len:
            req.finish_reason = "length"
            self.queues.leave_running(req, cache_it=True)
            self.finish(req)

    def _verified(self, it: Item, tok: engine_pb2.SampledToken) -> None:
        """Frees the KV of a verify step's rejected drafts at once."""
        req = it.req
        accepted = len(tok.extra_token_ids)
        self.kv.shrink(req, len(it.drafts) - accepted)
        req.draft_slots = 0
        self.spec.verified(req, len(it.drafts), accepted)

    def _append_token(self, req: Req, tok: engine_pb2.SampledToken, now: float) -> None:
        """Appends the accepted drafts and the sampled token, checking the stop conditions
        after each: nothing after a stop is kept."""
        if tok.grammar_error:
            # A dead end is the constraint's fault; anything else is never expected.
            code = "INVALID_ARGUMENT" if tok.grammar_dead_end else "INTERNAL"
            message = f"constrained decoding failed after {len(req.output_ids)} tokens"
            self.end_running(req, code, f"{message}: {tok.grammar_error}")
            return
        tokens = [tok.token_id, *tok.extra_token_ids]
        logprobs = [tok.logprob, *tok.extra_logprobs] if tok.HasField("logprob") else []
        if not req.first_token_time:
            req.first_token_time = now
            request_spans.on_first_token(req)
        for j, token in enumerate(tokens):
            req.output_ids.append(token)
            if logprobs:
                req.logprobs.append(logprobs[j])
            reason, matched = req.stop_reason(token, self.max_model_len)
            if not reason and tok.grammar_terminated and j == len(tokens) - 1:
                reason = "stop"  # the grammar is complete
            if reason:
                # Accepted drafts past the stop: their KV is not the output's.
                self.kv.shrink(req, len(tokens) - 1 - j)
                req.finish_reason, req.matched_stop_token = reason, matched
                self.queues.leave_running(req, cache_it=True)
                self.finish(req)
                return
        self.emit(req)

    def _settle_storage(self, result: engine_pb2.ForwardResult) -> None:
        """Answered (or lost: found nothing) storage loads free their requests."""
        storage = self.kv.cache.storage
        if storage is None:
            return
        answers = {s.load_id: s.pages for s in result.storage_loads}
        for load_id in storage.unanswered(result.batch_id):
            if load_id not in answers:  # its batch failed: nothing was loaded
                answers[load_id] = 0
                storage.counters.failed_loads += 1
        for load_id, pages in answers.items():
            req = self.kv.cache.storage_answer(load_id, pages)
            if isinstance(req, Req):
                req.storage_wait = False

    def _settle_grammars(self, statuses: Iterable[engine_pb2.GrammarStatus]) -> None:
        """Refused grammars end their (waiting) request."""
        for req, st in self.grammars.settle(list(statuses)):
            self.queues.waiting.discard(req)
            req.finish_reason, req.error_code = "abort", st.error_code or "INVALID_ARGUMENT"
            req.finish_message = st.error
            self.finish(req)

    def _fail(self, items: list[Item], result: engine_pb2.ForwardResult) -> None:
        log.error("worker failed batch %d: %s", result.batch_id, result.error)
        for it in items:
            req = it.req
            if req.finished:
                continue
            if req in self.queues.running:
                self.queues.leave_running(req, cache_it=False)
            req.finish_reason, req.error_code = "abort", "INTERNAL"
            req.finish_message = f"the worker failed this batch: {result.error}"
            self.finish(req)

    # -- ending requests --------------------------------------------------------------
    def end_running(self, req: Req, code: str, message: str) -> None:
        """A running request ends alone with an error (its batch goes on)."""
        log.error("request %s: %s", req.rid, message)
        self.queues.leave_running(req, cache_it=True)
        req.finish_reason, req.error_code, req.finish_message = "abort", code, message
        self.finish(req)

    def finish(self, req: Req) -> None:
        """A request ends (its KV already given back)."""
        req.finish_time = time.time()
        self.spec.finished(req)
        self.queues.forget(req)
        self.metrics.on_finish(req)
        request_spans.on_finish(req)
        self.emit(req)

    def emit(self, req: Req) -> None:
        self.outbox.add(req)
