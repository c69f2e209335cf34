"""The scheduler loop: one thread owns the radix cache, the allocator and the queues.

Each turn: take what the frontends sent, build one batch (a prefill batch when requests
wait and fit, else a decode step of every running request; while requests decode, one
mixed batch of both), have the worker run it, apply the sampled tokens, stream them back,
and hand finished KV to the tree. When the loop goes idle it checks that no KV slot leaked.

The loop only wires these together (one job per module):

    prefill.py      prefill batches: chunks of long prompts, admission, new-token ratio
    step_costs.py   the worker's decode-step and prefill-token times: mixed batch budgets
    decode.py       decode steps, the lookahead step (overlap schedule), retraction
    speculative.py  speculative decoding: drafts per request, what a verify step commits
    worker_link.py  batches to the worker and results back, in order (ZeroMQ)
    req_queues.py   the waiting and running requests and what a running one holds
    kv_manager.py   one request's KV: match, grow, commit to the tree, release
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

import zmq

from radixserve.internal.v1 import engine_pb2
from services.common.config import SchedulerConfig
from services.common.transport import unpack_i32
from services.scheduler import prompt_logprobs, request_spans
from services.scheduler.admission import QueueLimits
from services.scheduler.batch import Item
from services.scheduler.batch_log import BatchLog
from services.scheduler.cache_events import TreeEvents, block_tokens_for, route_seed
from services.scheduler.decode import DecodeBuilder
from services.scheduler.grammar_gate import GrammarGate
from services.scheduler.kv_manager import KVManager
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.outbox import Outbox
from services.scheduler.prefill import NewTokenRatio, PrefillBuilder, max_prefill_tokens
from services.scheduler.radix_cache import check_slot_integrity
from services.scheduler.req_queues import ReqQueues
from services.scheduler.req_slots import ReqSlotTable
from services.scheduler.request import Req
from services.scheduler.request_checks import request_problem
from services.scheduler.speculative import Speculator
from services.scheduler.step_costs import StepCosts
from services.scheduler.storage_tier import StorageTier, engine_seed
from services.scheduler.tokens import tokens_from_wire
from services.scheduler.worker_link import WorkerLink

log = logging.getLogger("radixserve.scheduler")
T = TypeVar("T")


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        worker_sock: zmq.Socket,
        info: engine_pb2.WorkerInfo,
        metrics: SchedulerMetrics | None = None,
        worker_lost: Callable[[], str] | None = None,
    ):
        self.cfg = cfg
        self.metrics = metrics or SchedulerMetrics.disabled()
        self.worker_lost = worker_lost or (lambda: "")
        self.outbox = Outbox()
        self.commands: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self.snapshot = engine_pb2.SchedulerStats()
        # The routers' view of the tree; it outlives the trees of restarted workers.
        self.events = (
            TreeEvents(
                block_tokens_for(cfg.cache_event_block_tokens, cfg.page_size),
                route_seed(info.model_id),
            )
            if cfg.cache_events_port >= 0
            else None
        )
        self.events_port = 0  # where EventPublisher publishes them (main.py)
        # Drafts come from text, not KV: the draft index outlives a restarted worker's pool.
        self.spec = Speculator.of(cfg, self.metrics)
        self.attach_worker(worker_sock, info)

    def attach_worker(self, worker_sock: zmq.Socket, info: engine_pb2.WorkerInfo) -> None:
        """Everything sized by the worker's pool, built anew: a (re)started worker has a new,
        empty pool, so the old tree's slots mean nothing. Call with no request left."""
        cfg = self.cfg
        self.info = info
        self.max_model_len = info.max_model_len
        storage = None
        if info.storage_page_tokens > 0:
            seed = engine_seed(
                info.model_id, info.weights_fingerprint, info.dtype, info.num_layers,
                info.num_key_value_heads, info.head_dim,
            )  # fmt: skip
            storage = StorageTier(int(info.storage_page_tokens), seed)
        if self.events is not None:
            self.events.cleared()  # a new pool: whatever the old tree held is gone
        self.kv = KVManager.for_pool(
            int(info.max_total_num_tokens), cfg, int(info.host_total_num_tokens), storage,
            self.events,
        )  # fmt: skip
        max_running = min(cfg.max_running_requests, info.max_running_requests)
        table = ReqSlotTable(max_running)
        self.queues = ReqQueues(self.kv, table, cache_finished=not cfg.disable_radix_cache)
        ratio = NewTokenRatio()
        batch_log = BatchLog(cfg.decode_log_interval, speculative=self.spec.enabled)
        max_prefill = max_prefill_tokens(cfg.max_prefill_tokens, info.device)
        self.prefill = PrefillBuilder(
            cfg, self.queues, ratio, max_running, self.metrics, batch_log, max_prefill
        )
        self.decode = DecodeBuilder(
            self.queues, ratio, self.max_model_len, self.metrics, batch_log, self.spec
        )
        timeout = cfg.worker_result_timeout
        self.link = WorkerLink(worker_sock, info, self.metrics, self.worker_lost, timeout)
        self.grammars = GrammarGate()
        self.limits = QueueLimits.of(cfg, max_running, self.kv.total)
        self.in_burst = False  # admitting a burst of arrivals (_mixed_budget)
        self.costs = StepCosts()  # the worker's decode-step and prefill-token times
        self.dirty_since_check = False  # work done since the idle slot check
        self.tree_unchecked = False  # work done since the idle whole-tree recount
        self.publish_stats()

    # ------------------------------------------------------------------ the loop --
    def step(self) -> bool:
        """Runs one batch if there is work; returns False when idle.

        Overlap schedule: while the worker runs batch N, the next decode step N+1 is built
        and queued behind it (its requests' input is the token the worker samples in N), so
        the scheduler's own work hides behind the forward. Stop conditions are then seen one
        step late; the extra step's token of a request that finished is dropped. It pauses
        while speculation is live (speculative.py: a verify step's tokens decide where the
        next step starts).
        """
        if self.limits.max_wait_s:
            self._expire_waiting()
        if self.in_burst and not self.queues.waiting:  # lookahead steps skip _mixed_budget
            self.in_burst = any(r.in_prefill for r in self.queues.running)
        if not self.link.in_flight:
            items = self._next_batch()
            if not items and not self.grammars.waiting() and not self.kv.has_copies():
                return False
            self.dirty_since_check = True
            # No items: a batch that only waits on grammars or carries copies between tiers.
            self._send(items)
        current = self.link.in_flight[0]
        if not self.cfg.disable_overlap_schedule and not self._admissible_waiting():
            ahead = self.decode.lookahead(current.items, self.link.next_batch_id)
            if ahead:
                self._send(ahead)
        self._apply(current.items, self.link.recv())
        # Before this step's outputs go out, so a client that just got its last token
        # reads gauges that already count the KV its request left behind.
        self.publish_stats()
        return True

    def _send(self, items: list[Item]) -> None:
        self.link.send(items, self.grammars.take_requests(), self.kv.take_copies())
        storage = self.kv.cache.storage
        if storage is not None:
            storage.mark_sent(self.link.next_batch_id - 1)

    def _held_back(self) -> int:
        """Waiting requests not admissible yet: their grammar compiles, or the storage tier
        has not answered (an aborted one counts until then)."""
        storage = self.kv.cache.storage
        return self.grammars.num_waiting() + (len(storage.pending) if storage else 0)

    def _next_batch(self) -> list[Item]:
        """With nothing decoding (or --mixed-prefill-tokens 0, or chunking off), a prefill
        batch if one is due, else a decode step. While requests decode, a mixed batch: every
        decoding request's next token (slots taken first, retracting if the pool runs dry)
        plus at most --mixed-prefill-tokens of prefill, so a long prompt arriving costs the
        running streams a slightly longer step instead of a stall.

        Mixed batches are built only with nothing in flight (the overlap schedule queues no
        lookahead while a prefill is due), so every decode item's input token is known."""
        mixed = self.cfg.mixed_prefill_tokens
        if mixed <= 0 or self.cfg.chunked_prefill_size <= 0 or not self.decode.any_decoding():
            return self.prefill.build() or self.decode.build()
        budget = self._mixed_budget()  # counted before decode.build() can retract anyone
        decode = self.decode.build()
        return self.prefill.build(budget) + decode

    def _mixed_budget(self) -> int:
        """Prefill tokens of the next mixed batch. Few arrivals beside many decoding
        streams get --mixed-prefill-tokens a step, fewer where that would make the step
        more than --mixed-step-slowdown decode steps long (step_costs.py: the streams'
        inter-token latency is what matters); a burst, as many requests waiting for a
        first token as decoding, gets --mixed-burst-tokens, since then the burst's time
        to first token is what matters: at --mixed-prefill-tokens a step, a burst admitted
        beside its own first request would trickle in over dozens of steps."""
        cfg = self.cfg
        running = self.queues.running
        decoding = sum(not r.in_prefill for r in running)
        first = len(running) - decoding + len(self.queues.waiting) - self._held_back()
        # A burst lasts until all of it is admitted: its tail (fewer left waiting than
        # already decoding) is part of it, not a few late arrivals.
        if first <= 0:
            self.in_burst = False
        elif first >= decoding:
            self.in_burst = True
        if self.in_burst:
            budget = max(cfg.mixed_burst_tokens, cfg.mixed_prefill_tokens)
        else:
            budget = self.costs.mixed_budget(cfg.mixed_step_slowdown, cfg.mixed_prefill_tokens)
        return min(budget, self.prefill.max_prefill)

    def _admissible_waiting(self) -> bool:
        """Whether a waiting request may be admitted next (one whose grammar still compiles
        may not: the lookahead step need not make way for it)."""
        return len(self.queues.waiting) > self._held_back()

    def has_requests(self) -> bool:
        return bool(self.queues.running or self.queues.waiting)

    def num_requests(self) -> int:
        """Running + waiting: the load routers balance on (as GetStats reports it)."""
        return len(self.queues.running) + len(self.queues.waiting)

    # ------------------------------------------------------------------ admission --
    def add_request(self, identity: bytes, msg: engine_pb2.TokenizedRequest) -> None:
        req = self._new_req(identity, msg)
        invalid = request_problem(msg, unpack_i32(msg.input_ids), self.info.vocab_size)
        problem = "" if invalid else self._reject_reason(req)
        if invalid or problem or req.rid in self.queues.by_rid:
            code = (
                "INVALID_ARGUMENT"
                if invalid
                else "RESOURCE_EXHAUSTED"
                if problem
                else "ALREADY_EXISTS"
            )
            req.error_code, req.finish_reason = code, "abort"
            req.finish_message = invalid or problem or f"request_id {req.rid!r} is already running"
            self._emit(req)
            return
        overload = self.limits.overload(self.queues.waiting, len(req.input_ids), self.costs.token_s)
        if overload is not None:
            req.error_code, req.finish_reason = "RESOURCE_EXHAUSTED", "abort"
            req.finish_message, req.retry_after = overload.message, overload.retry_after
            self.metrics.on_refused("overloaded")
            self._emit(req)
            return
        self.queues.add(req)
        self.grammars.add(req)
        self.metrics.on_arrival(req)
        request_spans.on_arrival(req)

    def _expire_waiting(self) -> None:
        """Waiting requests past --max-queue-time end DEADLINE_EXCEEDED (they hold no KV)."""
        for req in self.limits.expired(self.queues.waiting, time.monotonic()):
            self.queues.waiting.discard(req)  # a grammar it waits on is dropped when it settles
            req.finish_reason, req.error_code = "abort", "DEADLINE_EXCEEDED"
            req.finish_message = (
                f"waited {self.limits.max_wait_s:g} s for admission (--max-queue-time); "
                "the engine is overloaded"
            )
            self.metrics.on_refused("queue_time")
            self._finish(req)

    def _new_req(self, identity: bytes, msg: engine_pb2.TokenizedRequest) -> Req:
        return Req(
            rid=msg.rid,
            identity=identity,
            input_ids=tokens_from_wire(msg.input_ids),
            sampling=msg.sampling,
            priority=msg.priority,
            namespace=msg.cache_salt,
            eos_token_ids=frozenset(msg.eos_token_ids) | frozenset(self.info.eos_token_ids),
            arrival_time=msg.arrival_time or time.time(),
            trace_context=dict(msg.trace_context),
        )

    def _reject_reason(self, req: Req) -> str:
        if not req.input_ids:
            return "input_ids is empty"
        prompt = len(req.input_ids)
        need = prompt + req.max_new_tokens
        if need > self.kv.total:
            return (
                f"prompt ({prompt} tokens) + max_tokens ({req.max_new_tokens}) needs "
                f"{need} KV slots; this engine's pool holds {self.kv.total}"
            )
        if prompt >= self.max_model_len:
            return f"prompt has {prompt} tokens; max_model_len is {self.max_model_len}"
        return ""

    def refuse(self, identity: bytes, msg: engine_pb2.TokenizedRequest, message: str) -> None:
        """Answers a new request UNAVAILABLE at once (no worker, or shutting down)."""
        req = self._new_req(identity, msg)
        req.error_code, req.finish_reason, req.finish_message = "UNAVAILABLE", "abort", message
        self._emit(req)

    def fail_all(self, message: str) -> int:
        """Every request ends UNAVAILABLE with ``message`` and gives back what it holds (the
        worker is gone, or the shutdown grace ran out); returns how many ended."""
        ended = [*self.queues.running, *self.queues.waiting]
        for req in ended:
            if req in self.queues.running:
                self.queues.leave_running(req, cache_it=False)  # its KV may be unwritten
            self.queues.waiting.discard(req)
            req.finish_reason, req.error_code, req.finish_message = "abort", "UNAVAILABLE", message
            self._finish(req)
        self.link.in_flight.clear()
        self.grammars = GrammarGate()  # compiles asked for ended requests: nobody waits
        self.dirty_since_check = True
        self.publish_stats()
        return len(ended)

    def abort(self, rid: str, reason: str) -> None:
        req = self.queues.by_rid.get(rid)
        if req is None or req.finished:
            return
        if req in self.queues.waiting:
            self.queues.waiting.discard(req)
        else:
            self.queues.leave_running(req, cache_it=True)
        req.finish_reason, req.finish_message = "abort", reason or "aborted by the client"
        self._finish(req)

    # ------------------------------------------------------------------ results --
    def _apply(self, items: list[Item], result: engine_pb2.ForwardResult) -> None:
        """A batch came back: append each sampled token, stop or stream, cache prefills."""
        self._settle_grammars(result.grammars)
        self._settle_storage(result)
        if result.error:
            self._fail(items, result)
            return
        now = time.time()
        for it, tok in zip(items, result.tokens, strict=True):
            if not it.req.finished:  # finished (or aborted) while this step was queued
                self._apply_item(it, tok, result.batch_id, now)
        decoded = sum(not it.is_prefill for it in items)
        prefilled = sum(it.n for it in items if it.is_prefill)
        self.costs.observe(decoded, prefilled, result.forward_time)
        if decoded:  # a decode step, or a mixed batch's decode part
            tokens = sum(
                1 + len(tok.extra_token_ids)
                for it, tok in zip(items, result.tokens, strict=True)
                if not it.is_prefill
            )
            self.decode.after_step(decoded, tokens, result)

    def _apply_item(
        self, it: Item, tok: engine_pb2.SampledToken, batch_id: int, now: float
    ) -> None:
        req = it.req
        if req.lookahead == batch_id:
            req.lookahead = 0  # no step of it in flight any more (a later one may be)
        if it.is_prefill:
            request_spans.on_prefill_chunk(req, it.n)
            prompt_logprobs.collect(req, list(tok.prompt_logprobs))
            if not self.cfg.disable_radix_cache:
                self.kv.commit(req, it.start + it.n)
        if len(tok.extra_token_ids) > len(it.drafts):  # never from a sound worker
            self._end_running(
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
            # Prefill only: the prompt's KV goes to the tree, nothing is sampled.
            req.finish_reason = "length"
            self.queues.leave_running(req, cache_it=True)
            self._finish(req)

    def _verified(self, it: Item, tok: engine_pb2.SampledToken) -> None:
        """A verify step came back: the KV of its rejected drafts is freed at once (what
        it holds after this: the last token's and the accepted drafts')."""
        req = it.req
        accepted = len(tok.extra_token_ids)
        self.kv.shrink(req, len(it.drafts) - accepted)
        req.draft_slots = 0
        self.spec.verified(req, len(it.drafts), accepted)

    def _append_token(self, req: Req, tok: engine_pb2.SampledToken, now: float) -> None:
        """Appends the sampled token (a verify step: the accepted drafts, then the target's
        token), checking the stop conditions after each: nothing after a stop is kept."""
        if tok.grammar_error:
            # A dead end is the constraint's (a grammar that stops accepting anything mid-way);
            # anything else is never expected: the mask allows only what the grammar does.
            code = "INVALID_ARGUMENT" if tok.grammar_dead_end else "INTERNAL"
            message = f"constrained decoding failed after {len(req.output_ids)} tokens"
            self._end_running(req, code, f"{message}: {tok.grammar_error}")
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
                reason = "stop"  # the grammar is complete (its end, not a stop token, ended it)
            if reason:
                # Accepted drafts past the stop: their KV is not the output's.
                self.kv.shrink(req, len(tokens) - 1 - j)
                req.finish_reason, req.matched_stop_token = reason, matched
                self.queues.leave_running(req, cache_it=True)
                self._finish(req)
                return
        self._emit(req)

    def _settle_storage(self, result: engine_pb2.ForwardResult) -> None:
        """Storage loads answered (or lost with a failed batch: they found nothing) free
        their requests for admission."""
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
        """Grammars the worker finished compiling: refused ones end their (waiting) request."""
        for req, st in self.grammars.settle(list(statuses)):
            self.queues.waiting.discard(req)
            req.finish_reason, req.error_code = "abort", st.error_code or "INVALID_ARGUMENT"
            req.finish_message = st.error
            self._finish(req)

    def _end_running(self, req: Req, code: str, message: str) -> None:
        """A running request ends alone with an error (the rest of its batch goes on)."""
        log.error("request %s: %s", req.rid, message)
        self.queues.leave_running(req, cache_it=True)
        req.finish_reason, req.error_code, req.finish_message = "abort", code, message
        self._finish(req)

    def _fail(self, items: list[Item], result: engine_pb2.ForwardResult) -> None:
        """The worker could not run the batch: its requests end with INTERNAL."""
        log.error("worker failed batch %d: %s", result.batch_id, result.error)
        for it in items:
            req = it.req
            if req.finished:
                continue
            if req in self.queues.running:
                self.queues.leave_running(req, cache_it=False)
            req.finish_reason, req.error_code = "abort", "INTERNAL"
            req.finish_message = f"the worker failed this batch: {result.error}"
            self._finish(req)

    # ------------------------------------------------------------------ output --
    def _finish(self, req: Req) -> None:
        req.finish_time = time.time()
        self.spec.finished(req)
        self.queues.forget(req)
        self.metrics.on_finish(req)
        request_spans.on_finish(req)
        self._emit(req)

    def _emit(self, req: Req) -> None:
        self.outbox.add(req)

    def flush_outbox(self, sock: zmq.Socket) -> None:
        for rid in self.outbox.flush(sock):
            self.abort(rid, "frontend disconnected")

    # ------------------------------------------------------------------ control --
    @staticmethod
    def busy_flush_reply(running: int, waiting: int) -> engine_pb2.FlushReply:
        return engine_pb2.FlushReply(
            flushed=False,
            message=(
                f"Cache not flushed: {running} request(s) running and {waiting} waiting; "
                "flush when the engine is idle."
            ),
        )

    def flush_cache(self, storage: bool = False) -> engine_pb2.FlushReply:
        if self.has_requests():
            return self.busy_flush_reply(len(self.queues.running), len(self.queues.waiting))
        self.kv.flush()
        self.spec.reset()  # what drafts come from goes with it
        message = "Cache flushed."
        if storage:
            if not self.kv.cache.clear_storage():
                return engine_pb2.FlushReply(
                    flushed=False,
                    message="Cache flushed, but this engine has no storage tier to flush "
                    "(--hicache-storage-dir).",
                )
            message = "Cache flushed, storage tier included."
        self.publish_stats()
        log.info(message)
        return engine_pb2.FlushReply(flushed=True, message=message)

    def publish_stats(self) -> None:
        """Refreshes the snapshot that control calls and gauges read without waiting for
        the loop."""
        self.snapshot = self.stats()
        self.metrics.update_gauges(self.snapshot)

    def stats(self) -> engine_pb2.SchedulerStats:
        size = self.kv.cache.size_info()
        free = self.kv.allocator.num_free
        return engine_pb2.SchedulerStats(
            max_total_num_tokens=self.kv.total,
            available_tokens=free,
            evictable_tokens=size.evictable,
            protected_tokens=size.protected,
            used_tokens=self.kv.total - free - size.evictable,
            num_running_reqs=len(self.queues.running),
            num_queue_reqs=len(self.queues.waiting),
            page_size=self.cfg.page_size,
            worker=self.info,
            cache_events_port=self.events_port,
            **self._tier_stats(),
        )

    def _tier_stats(self) -> dict[str, int]:
        host = self.kv.cache.host
        if host is None:
            return {}
        c = host.counters
        stats = {
            "host_total_tokens": host.allocator.total,
            "host_used_tokens": host.used,
            "host_demoted_tokens": c.demoted,
            "host_loaded_tokens": c.loaded,
            "host_dropped_tokens": c.dropped,
        }
        storage = self.kv.cache.storage
        if storage is not None:
            s = storage.counters
            stats |= {
                "storage_stored_tokens": s.stored,
                "storage_loaded_tokens": s.loaded,
                "storage_missed_tokens": s.missed,
                "storage_failed_loads": s.failed_loads,
            }
        return stats

    def run_commands(self) -> None:
        """Runs control calls (from the gRPC thread) between batches, on the loop's thread."""
        while True:
            try:
                fn, fut = self.commands.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn())
            except Exception as e:  # the caller gets the error; the loop keeps serving
                fut.set_exception(e)

    def call(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """From another thread: run fn on the loop's thread and wait for its result."""
        fut: Future[T] = Future()
        self.commands.put((fn, fut))
        return fut.result(timeout)

    def check_idle(self, full: bool = True) -> None:
        """The invariant when nothing runs: every slot is free or evictable; nothing locked.

        The slot counts are checked at once (O(requests)). The recount of the whole tree
        (O(cached tokens): ~100 ms at 100k tokens on one busy core) runs only when ``full``:
        the loop passes it once the engine has stayed idle a while, so the walk never sits
        between the arrivals of a burst."""
        if self.dirty_since_check:
            self.dirty_since_check = False
            self.tree_unchecked = True
            check_slot_integrity(self.kv.allocator, self.kv.cache, self.kv.held_by_requests())
            size = self.kv.cache.size_info()
            if size.protected or self.kv.held_by_requests():
                raise AssertionError(
                    f"idle engine still holds KV: protected={size.protected}, "
                    f"held_by_requests={self.kv.held_by_requests()}"
                )
            self.publish_stats()
        if full and self.tree_unchecked:
            self.tree_unchecked = False
            self.kv.check()
