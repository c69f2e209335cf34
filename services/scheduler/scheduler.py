"""The scheduler loop: one thread owns the radix cache, the allocator and the queues.

Each turn: take what the frontends sent, build one batch (a prefill batch when requests
wait and fit, else a decode step of every running request), have the worker run it, apply
the sampled tokens, stream them back, and hand finished KV to the tree. When the loop goes
idle it checks that no KV slot leaked.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import zmq

from radixserve.internal.v1 import engine_pb2
from services.common import transport
from services.common.config import SchedulerConfig
from services.common.transport import pack_i32, unpack_i32
from services.scheduler import request_spans, schedule_policy
from services.scheduler.allocator import KVSlotAllocator
from services.scheduler.batch_log import BatchLog
from services.scheduler.kv_manager import KVManager
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.outbox import Outbox
from services.scheduler.radix_cache import create_prefix_cache
from services.scheduler.req_slots import ReqSlotTable
from services.scheduler.request import Req

log = logging.getLogger("radixserve.scheduler")

# Admission reserves this share of each request's remaining max_tokens (SGLang's
# new-token ratio): optimistic, since most requests stop early; retraction covers the rest.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.15
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
# A waiting request sharing this many uncached tokens with one already in the batch waits
# one step: after that batch its prefix is in the tree, and it is a hit instead of a copy.
IN_BATCH_SHARE_THRESHOLD = 32
WORKER_TIMEOUT_S = 600.0


class WorkerError(RuntimeError):
    pass


@dataclass
class Item:
    """One request's share of a batch."""

    req: Req
    start: int  # position of the first token computed
    n: int  # tokens computed
    sample: bool
    is_prefill: bool
    from_last: bool = False  # input = the token the worker sampled in the batch before (overlap)


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        worker_sock: zmq.Socket,
        info: engine_pb2.WorkerInfo,
        metrics: SchedulerMetrics | None = None,
    ):
        self.cfg = cfg
        self.worker = worker_sock
        self.info = info
        self.max_model_len = info.max_model_len
        self.max_running = min(cfg.max_running_requests, info.max_running_requests)
        allocator = KVSlotAllocator(
            usable_slots(int(info.max_total_num_tokens), cfg.page_size), cfg.page_size
        )
        cache = create_prefix_cache(
            allocator,
            cfg.page_size,
            cfg.disable_radix_cache,
            cfg.radix_eviction_policy,
            cfg.slru_protected_hits,
        )
        self.kv = KVManager(allocator, cache)
        self.table = ReqSlotTable(self.max_running)
        self.metrics = metrics or SchedulerMetrics.disabled()
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.by_rid: dict[str, Req] = {}
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.batch_id = 0
        self.batch_log = BatchLog(cfg.decode_log_interval)
        self.commands: queue.Queue[tuple[Callable[[], object], Future]] = queue.Queue()
        self.outbox = Outbox()
        self.dirty_since_check = False
        self.snapshot = engine_pb2.SchedulerStats()
        self.inflight: tuple[list[Item], int] | None = None  # a batch sent, its result not read

    # ------------------------------------------------------------------ admission --
    def add_request(self, identity: bytes, msg: engine_pb2.TokenizedRequest) -> None:
        ids = unpack_i32(msg.input_ids).tolist()
        req = Req(
            rid=msg.rid,
            identity=identity,
            input_ids=ids,
            sampling=msg.sampling,
            priority=msg.priority,
            namespace=msg.cache_salt,
            eos_token_ids=frozenset(msg.eos_token_ids) | frozenset(self.info.eos_token_ids),
            arrival_time=msg.arrival_time or time.time(),
            trace_context=dict(msg.trace_context),
        )
        problem = self._reject_reason(req)
        if problem or req.rid in self.by_rid:
            code = "RESOURCE_EXHAUSTED" if problem else "ALREADY_EXISTS"
            req.error_code, req.finish_reason = code, "abort"
            req.finish_message = problem or f"request_id {req.rid!r} is already running"
            self._emit(req)
            return
        self.by_rid[req.rid] = req
        self.waiting.append(req)
        self.metrics.on_arrival(req)
        request_spans.on_arrival(req)

    def _reject_reason(self, req: Req) -> str:
        if not req.input_ids:
            return "input_ids is empty"
        need = len(req.input_ids) + req.max_new_tokens
        if need > self.kv.total:
            return (
                f"prompt ({len(req.input_ids)} tokens) + max_tokens ({req.max_new_tokens}) needs "
                f"{need} KV slots; this engine's pool holds {self.kv.total}"
            )
        if len(req.input_ids) >= self.max_model_len:
            return f"prompt has {len(req.input_ids)} tokens; max_model_len is {self.max_model_len}"
        return ""

    def abort(self, rid: str, reason: str) -> None:
        req = self.by_rid.get(rid)
        if req is None or req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self._leave_running(req, cache_it=True)
        req.finish_reason, req.finish_message = "abort", reason or "aborted by the client"
        self._finish(req)

    # ------------------------------------------------------------------ batches --
    def step(self) -> bool:
        """Runs one batch if there is work; returns False when idle.

        Overlap schedule: while the worker runs batch N, the next decode step N+1 is built
        and queued behind it (its requests' input is the token the worker samples in N), so
        the scheduler's own work hides behind the forward. Stop conditions are then seen one
        step late; the extra step's token of a request that finished is dropped.
        """
        if self.inflight is None:
            items = self._build_prefill() or self._build_decode()
            if not items:
                return False
            self.dirty_since_check = True
            self._send(items)
        current, self.inflight = self.inflight, None
        if not self.cfg.disable_overlap_schedule and not self.waiting:
            ahead = self._build_lookahead(current[0])
            if ahead:
                self._send(ahead)
        result = self._recv_result(current[1])
        self._apply(current[0], result)
        # Before this step's outputs go out, so a client that just got its last token
        # reads gauges that already count the KV its request left behind.
        self.publish_stats()
        return True

    def _build_lookahead(self, current: list[Item]) -> list[Item]:
        """The decode step after ``current``, built before current's tokens are known."""
        pending = {id(it.req) for it in current if it.sample}
        items: list[Item] = []
        for req in self.running:
            if req.in_prefill:
                break  # a chunked prefill runs next: no lookahead
            if id(req) in pending:
                # Its length stop is known now; a dirty table row needs the full output ids.
                if (
                    req.table_dirty
                    or len(req.output_ids) + 1 >= req.max_new_tokens
                    or req.seq_len + 1 >= self.max_model_len
                ):
                    continue
                from_last = True
            elif req.kv_len == req.seq_len - 1:
                from_last = False
            else:
                continue
            if self.kv.grow(req, 1) is None:
                break
            req.lookahead = self.batch_id + 1  # the id _send will give this batch
            items.append(Item(req, req.kv_len - 1, 1, True, False, from_last))
        else:
            return items
        for it in items:  # not all of them fit, or a prefill comes first: take it all back
            self.kv.shrink(it.req, 1)
            it.req.lookahead = 0
        return []

    def _ordered_waiting(self) -> list[Req]:
        return schedule_policy.order(self.cfg.schedule_policy, self.waiting, self.kv.cache)

    def _reserved_tokens(self) -> float:
        return sum(r.remaining_new_tokens for r in self.running) * self.new_token_ratio

    def _build_prefill(self) -> list[Item]:
        budget = self.cfg.max_prefill_tokens
        chunk = self.cfg.chunked_prefill_size if self.cfg.chunked_prefill_size > 0 else 1 << 30
        items: list[Item] = []
        for req in self.running:
            if req.in_prefill and budget > 0:
                n = min(req.seq_len - req.kv_len, chunk, budget)
                if self.kv.grow(req, n) is None:
                    continue
                items.append(Item(req, req.kv_len - n, n, req.kv_len == req.seq_len, True))
                budget -= n
        if not self.waiting or budget <= 0:
            return items
        reserved = self._reserved_tokens()
        admitted: list[Req] = []
        for req in self._ordered_waiting():
            if len(self.running) + len(admitted) >= self.max_running or budget <= 0:
                break
            if self._shares_with(req, admitted):
                continue
            matched = self.kv.match(req)
            todo = req.seq_len - matched
            need = todo + req.remaining_new_tokens * self.new_token_ratio
            if need > self.kv.available - reserved:
                self.kv.unmatch(req)
                break
            n = min(todo, chunk, budget)
            if self.kv.grow(req, n) is None:
                self.kv.unmatch(req)
                break
            req.req_slot = self.table.alloc()
            if req.cached_tokens < 0:
                req.cached_tokens = matched
                req.first_scheduled = time.time()
                self.metrics.on_scheduled(req)
                request_spans.on_scheduled(req)
            admitted.append(req)
            items.append(Item(req, matched, n, matched + n == req.seq_len, True))
            budget -= n
            reserved += req.remaining_new_tokens * self.new_token_ratio
        for req in admitted:
            self.waiting.remove(req)
            self.running.append(req)
        if admitted or items:
            self._log_prefill(items, admitted)
        return items

    def _shares_with(self, req: Req, admitted: list[Req]) -> bool:
        if self.cfg.disable_radix_cache or not admitted:
            return False
        ids = req.fill_ids
        for other in admitted:
            n = _common_prefix_len(ids, other.fill_ids)
            if n - other.locked_len >= IN_BATCH_SHARE_THRESHOLD:
                return True
        return False

    def _build_decode(self) -> list[Item]:
        items: list[Item] = []
        for req in list(self.running):
            if req.in_prefill or req not in self.running:
                continue
            while self.kv.grow(req, 1) is None:
                if not self._retract_one(keep=req):
                    raise WorkerError(
                        "decode cannot get one KV slot even after retracting every other request"
                    )
            items.append(Item(req, req.kv_len - 1, 1, True, False))
        # A request retracted after it got its slot this step must not run.
        return [it for it in items if it.req in self.running]

    def _retract_one(self, keep: Req) -> bool:
        """Frees KV by sending back the running request that loses least (fewest tokens decoded)."""
        victims = [r for r in self.running if r is not keep and not r.in_prefill]
        victims = victims or [r for r in self.running if r is not keep]
        if not victims:
            return False
        victim = min(victims, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
        if victim.kv_len and not victim.in_prefill and victim.kv_len == victim.seq_len:
            # It already got this step's slot: give it back before caching the rest.
            self.kv.shrink(victim, 1)
        self._leave_running(victim, cache_it=True)
        victim.num_retractions += 1
        self.waiting.insert(0, victim)
        old = self.new_token_ratio
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        self.metrics.on_retract()
        log.warning(
            "Retract requests. #retracted-reqs: 1, rid: %s, #decoded: %d, "
            "#new-token-ratio: %.4f -> %.4f, #running-req: %d, #queue-req: %d",
            victim.rid,
            len(victim.output_ids),
            old,
            self.new_token_ratio,
            len(self.running),
            len(self.waiting),
        )
        return True

    def _leave_running(self, req: Req, cache_it: bool) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.lookahead:
            # The queued step computes a token nobody will read: give back its slot (the
            # worker runs batches in order, so the slot's next owner writes after it).
            self.kv.shrink(req, 1)
            req.lookahead = 0
        self.kv.release(req, cache_it=cache_it and not self.cfg.disable_radix_cache)
        if req.req_slot is not None:
            self.table.free(req.req_slot)
            req.req_slot = None

    # ------------------------------------------------------------------ worker --
    def _forward_request(self, it: Item) -> engine_pb2.ForwardRequest:
        req = it.req
        fr = engine_pb2.ForwardRequest(
            req_slot=req.req_slot,
            rid=req.rid,
            prefix_len=it.start,
            sample=it.sample,
            out_slots=pack_i32(req.kv_slots[it.start : it.start + it.n]),
        )
        if it.from_last:
            fr.use_last_sampled = True
        else:
            fr.input_ids = pack_i32(req.fill_ids[it.start : it.start + it.n])
        if req.table_dirty:
            fr.is_new = True
            fr.prefix_slots = pack_i32(req.kv_slots[: it.start])
            fr.sampling.CopyFrom(req.sampling)
            fr.output_ids = pack_i32(req.output_ids)
            fr.eos_token_ids.extend(sorted(req.eos_token_ids))
            req.table_dirty = False
        return fr

    def _send(self, items: list[Item]) -> None:
        self.batch_id += 1
        batch = engine_pb2.ForwardBatch(
            batch_id=self.batch_id, is_decode=not any(it.is_prefill for it in items)
        )
        batch.reqs.extend(self._forward_request(it) for it in items)
        parent, links = request_spans.batch_context([it.req for it in items])
        batch.trace_context.update(parent)
        batch.trace_links.extend(links)
        self.metrics.on_batch(self.info, items)
        transport.send(self.worker, engine_pb2.SchedulerToWorker(forward=batch))
        self.inflight = (items, self.batch_id)

    def _recv_result(self, batch_id: int) -> engine_pb2.ForwardResult:
        reply = self._recv_worker()
        if not reply.HasField("result") or reply.result.batch_id != batch_id:
            raise WorkerError(f"the worker answered batch {batch_id} with something else")
        if reply.result.worker_instance != self.info.instance_id:
            # Its KV pool is new and empty: every slot the tree names is garbage now.
            raise WorkerError(
                f"the worker restarted (instance {self.info.instance_id or '?'} -> "
                f"{reply.result.worker_instance or '?'}); its KV pool is gone, so the "
                "scheduler stops to start over with an empty tree"
            )
        return reply.result

    def _recv_worker(self) -> engine_pb2.WorkerToScheduler:
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while not self.worker.poll(1000):
            if time.monotonic() > deadline:
                raise WorkerError(f"the worker did not answer within {WORKER_TIMEOUT_S:.0f} s")
        return transport.recv(self.worker, engine_pb2.WorkerToScheduler)

    def _apply(self, items: list[Item], result: engine_pb2.ForwardResult) -> None:
        if result.error:
            log.error("worker failed batch %d: %s", result.batch_id, result.error)
            for it in items:
                if it.req.finished:
                    continue
                if it.req in self.running:
                    self._leave_running(it.req, cache_it=False)
                it.req.finish_reason, it.req.error_code = "abort", "INTERNAL"
                it.req.finish_message = f"the worker failed this batch: {result.error}"
                self._finish(it.req)
            return
        now = time.time()
        for it, tok in zip(items, result.tokens, strict=True):
            req = it.req
            if req.finished:
                continue  # finished (or aborted) while this step was queued: its token is moot
            if req.lookahead == result.batch_id:
                req.lookahead = 0  # no step of it in flight any more (a later one may be)
            if it.is_prefill:
                request_spans.on_prefill_chunk(req, it.n)
                if not self.cfg.disable_radix_cache:
                    self.kv.commit(req, it.start + it.n)
            if not it.sample:
                continue
            req.output_ids.append(tok.token_id)
            if tok.HasField("logprob"):
                req.logprobs.append(tok.logprob)
            if not req.first_token_time:
                req.first_token_time = now
                request_spans.on_first_token(req)
            reason, matched = req.stop_reason(tok.token_id, self.max_model_len)
            if reason:
                req.finish_reason, req.matched_stop_token = reason, matched
                self._leave_running(req, cache_it=True)
                self._finish(req)
            else:
                self._emit(req)
        if not any(it.is_prefill for it in items):
            self._after_decode(len(items), result)

    # ------------------------------------------------------------------ output --
    def _finish(self, req: Req) -> None:
        req.finish_time = time.time()
        self.by_rid.pop(req.rid, None)
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

    def flush_cache(self) -> engine_pb2.FlushReply:
        if self.running or self.waiting:
            return self.busy_flush_reply(len(self.running), len(self.waiting))
        self.kv.flush()
        self.publish_stats()
        log.info("Cache flushed.")
        return engine_pb2.FlushReply(flushed=True, message="Cache flushed.")

    def publish_stats(self) -> None:
        """Refreshes the snapshot that control calls and gauges read without waiting for the loop."""
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
            num_running_reqs=len(self.running),
            num_queue_reqs=len(self.waiting),
            page_size=self.cfg.page_size,
            worker=self.info,
        )

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

    def call(self, fn: Callable[[], object], timeout: float = 30.0):
        """From another thread: run fn on the loop's thread and wait for its result."""
        fut: Future = Future()
        self.commands.put((fn, fut))
        return fut.result(timeout)

    def check_idle(self) -> None:
        """The invariant when nothing runs: every slot is free or evictable; nothing locked."""
        if not self.dirty_since_check:
            return
        self.dirty_since_check = False
        self.kv.check()
        size = self.kv.cache.size_info()
        if size.protected or self.kv.held_by_requests():
            raise AssertionError(
                f"idle engine still holds KV: protected={size.protected}, "
                f"held_by_requests={self.kv.held_by_requests()}"
            )
        self.publish_stats()

    # ------------------------------------------------------------------ logs --
    def token_usage(self) -> float:
        s = self.stats()
        return s.used_tokens / max(1, s.max_total_num_tokens)

    def _log_prefill(self, items: list[Item], admitted: list[Req]) -> None:
        new_tokens = sum(it.n for it in items)
        cached = sum(max(r.cached_tokens, 0) for r in admitted)
        self.metrics.on_prefill_batch(new_tokens, cached, self)
        self.batch_log.prefill(
            len(admitted),
            new_tokens,
            cached,
            self.token_usage(),
            len(self.running) - len(admitted),
            len(self.waiting),
        )

    def _after_decode(self, n_tokens: int, result: engine_pb2.ForwardResult) -> None:
        # Every decode step (however it was built) lowers the reserve a little.
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        self.batch_log.decode(
            n_tokens,
            len(self.running),
            sum(r.kv_len for r in self.running),
            self.token_usage(),
            result.cuda_graph,
            len(self.waiting),
        )


def usable_slots(pool_slots: int, page_size: int) -> int:
    """Slots the allocator may hand out so that none exceeds the worker's pool (1..pool_slots).

    With pages, page 0 (which holds padding slot 0) is reserved and only whole pages that
    end at or before slot pool_slots count.
    """
    if page_size == 1:
        return pool_slots
    return max(0, (pool_slots + 1) // page_size - 1) * page_size


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on slice equality: C-speed comparisons, O(log n) of them
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
