"""The scheduler loop: one thread owns the radix cache, the allocator and the queues.

Each turn builds one batch (prefill, decode, or both mixed), has the worker run it and
applies the result; the work itself lives in prefill.py, decode.py, speculative.py,
results.py, worker_link.py, req_queues.py and kv_manager.py. When idle it checks for
leaked KV slots.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import zmq

from radixserve.internal.v1 import engine_pb2
from services.common.config import SchedulerConfig
from services.common.transport import unpack_i32
from services.scheduler import request_spans
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
from services.scheduler.results import ResultApplier
from services.scheduler.spec_gate import StepKind
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
        # Outlives the trees of restarted workers.
        self.events = (
            TreeEvents(
                block_tokens_for(cfg.cache_event_block_tokens, cfg.page_size),
                route_seed(info.model_id),
            )
            if cfg.cache_events_port >= 0
            else None
        )
        self.events_port = 0  # set by main.py
        # Drafts come from text, not KV: the draft index outlives a restarted worker's pool.
        self.spec = Speculator.of(cfg, self.metrics)
        self.attach_worker(worker_sock, info)

    @property
    def grammars(self) -> GrammarGate:
        """Requests waiting for their grammar (one gate, the result applier's)."""
        return self.results.grammars

    def attach_worker(self, worker_sock: zmq.Socket, info: engine_pb2.WorkerInfo) -> None:
        """Rebuilds everything sized by the worker's pool (a restarted worker's is new and
        empty). Call with no request left."""
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
        self.results = ResultApplier(
            self.queues, self.spec, self.metrics, self.outbox, GrammarGate(),
            self.max_model_len, cache_prefills=not cfg.disable_radix_cache,
        )  # fmt: skip
        self.limits = QueueLimits.of(cfg, max_running, self.kv.total)
        self.in_burst = False  # admitting a burst of arrivals (_mixed_budget)
        self.costs = StepCosts()
        self.dirty_since_check = False  # work done since the idle slot check
        self.tree_unchecked = False  # work done since the idle whole-tree recount
        self.publish_stats()

    # ------------------------------------------------------------------ the loop --
    def step(self) -> bool:
        """Runs one batch if there is work; returns False when idle.

        Overlap schedule: the next decode step is queued behind the one the worker runs, so
        stops are seen a step late (the extra token is dropped); paused while speculating.
        """
        if self.limits.max_wait_s:
            self._expire_waiting()
        if self.in_burst and not self.queues.waiting:  # lookahead steps skip _mixed_budget
            self.in_burst = any(r.in_prefill for r in self.queues.running)
        if not self.link.in_flight:
            items = self._next_batch()
            if not items and not self.grammars.waiting() and not self.kv.has_copies():
                self.spec.idle()
                return False
            self.dirty_since_check = True
            self._send(items)
        current = self.link.in_flight[0]
        if not self.cfg.disable_overlap_schedule and not self._admissible_waiting():
            ahead = self.decode.lookahead(current.items, self.link.next_batch_id)
            if ahead:
                self._send(ahead)
        self.spec.upkeep(self.queues.running)  # while the worker computes: off the step's path
        self._apply(current.items, self.link.recv())
        # Before the outputs go out: a client's last token never precedes its gauges.
        self.publish_stats()
        return True

    def _send(self, items: list[Item]) -> None:
        self.link.send(items, self.grammars.take_requests(), self.kv.take_copies())
        storage = self.kv.cache.storage
        if storage is not None:
            storage.mark_sent(self.link.next_batch_id - 1)

    def _held_back(self) -> int:
        """Waiting requests held back by a grammar compile or a storage load."""
        storage = self.kv.cache.storage
        return self.grammars.num_waiting() + (len(storage.pending) if storage else 0)

    def _next_batch(self) -> list[Item]:
        """A prefill batch if due, else a decode step; while requests decode, one mixed
        batch, so a long prompt costs the streams a longer step instead of a stall. Built
        only with nothing in flight, so every decode item's input token is known."""
        mixed = self.cfg.mixed_prefill_tokens
        if mixed <= 0 or self.cfg.chunked_prefill_size <= 0 or not self.decode.any_decoding():
            return self.prefill.build() or self.decode.build()
        budget = self._mixed_budget()  # counted before decode.build() can retract anyone
        decode = self.decode.build()
        return self.prefill.build(budget) + decode

    def _mixed_budget(self) -> int:
        """Prefill tokens of the next mixed batch: capped by --mixed-step-slowdown (the
        streams' inter-token latency matters), or --mixed-burst-tokens during a burst (as
        many awaiting a first token as decoding: then time to first token matters)."""
        cfg = self.cfg
        running = self.queues.running
        decoding = sum(not r.in_prefill for r in running)
        first = len(running) - decoding + len(self.queues.waiting) - self._held_back()
        # A burst lasts until all of it is admitted, its tail included.
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
        """Whether a waiting request may be admitted next (the lookahead makes way)."""
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
            self.results.emit(req)
            return
        overload = self.limits.overload(self.queues.waiting, len(req.input_ids), self.costs.token_s)
        if overload is not None:
            req.error_code, req.finish_reason = "RESOURCE_EXHAUSTED", "abort"
            req.finish_message, req.retry_after = overload.message, overload.retry_after
            self.metrics.on_refused("overloaded")
            self.results.emit(req)
            return
        self.queues.add(req)
        self.grammars.add(req)
        self.metrics.on_arrival(req)
        request_spans.on_arrival(req)

    def _expire_waiting(self) -> None:
        for req in self.limits.expired(self.queues.waiting, time.monotonic()):
            self.queues.waiting.discard(req)  # a grammar it waits on is dropped when it settles
            req.finish_reason, req.error_code = "abort", "DEADLINE_EXCEEDED"
            req.finish_message = (
                f"waited {self.limits.max_wait_s:g} s for admission (--max-queue-time); "
                "the engine is overloaded"
            )
            self.metrics.on_refused("queue_time")
            self.results.finish(req)

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
        self.results.emit(req)

    def fail_all(self, message: str) -> int:
        """Every request ends UNAVAILABLE with ``message``; returns how many ended."""
        ended = [*self.queues.running, *self.queues.waiting]
        for req in ended:
            if req in self.queues.running:
                self.queues.leave_running(req, cache_it=False)  # its KV may be unwritten
            self.queues.waiting.discard(req)
            req.finish_reason, req.error_code, req.finish_message = "abort", "UNAVAILABLE", message
            self.results.finish(req)
        self.link.in_flight.clear()
        self.results.grammars = GrammarGate()
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
        self.results.finish(req)

    # ------------------------------------------------------------------ results --
    def _apply(self, items: list[Item], result: engine_pb2.ForwardResult) -> None:
        self._time_step(items, result)
        self.results.apply(items, result)
        if not result.error:
            self._observe_step(items, result)

    def _time_step(self, items: list[Item], result: engine_pb2.ForwardResult) -> None:
        """For the speculation gate: this step's kind, rows and committed tokens."""
        if not self.spec.enabled:
            return
        kind = StepKind.OTHER if result.error else step_kind(items)
        tokens = 0
        if kind is not StepKind.OTHER:
            tokens = sum(1 + len(tok.extra_token_ids) for tok in result.tokens)
        self.spec.gate.observe(kind, len(items), tokens)

    def _observe_step(self, items: list[Item], result: engine_pb2.ForwardResult) -> None:
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

    # ------------------------------------------------------------------ output --
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
        """Refreshes the snapshot control calls and gauges read without waiting for the loop."""
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
        """Runs queued control calls on the loop's thread, between batches."""
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
        """Idle invariant: every slot free or evictable, nothing locked. The whole-tree
        recount (O(cached tokens)) runs only when ``full``."""
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


def step_kind(items: list[Item]) -> StepKind:
    """What the speculation gate times a result as."""
    if not items or any(it.is_prefill for it in items):
        return StepKind.OTHER
    return StepKind.VERIFY if any(it.drafts for it in items) else StepKind.PLAIN
