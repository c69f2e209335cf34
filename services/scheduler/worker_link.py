"""The scheduler's end of the ZeroMQ link to its worker: batches out, results back, both in
order, so unanswered batches wait in a FIFO (two with the overlap schedule).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from radixserve.internal.v1 import engine_pb2
from services.common import transport
from services.common.transport import pack_i32
from services.scheduler import prompt_logprobs, request_spans
from services.scheduler.batch import Item, is_decode
from services.scheduler.host_tier import Copy, Direction
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request import Req

POLL_SLICE_MS = 100  # how soon a lost worker (or an expired shutdown) is noticed in recv

_DIRECTIONS = {
    Direction.DEVICE_TO_HOST: engine_pb2.KVCopy.DIRECTION_DEVICE_TO_HOST,
    Direction.HOST_TO_DEVICE: engine_pb2.KVCopy.DIRECTION_HOST_TO_DEVICE,
    Direction.DEVICE_TO_STORAGE: engine_pb2.KVCopy.DIRECTION_DEVICE_TO_STORAGE,
    Direction.STORAGE_TO_HOST: engine_pb2.KVCopy.DIRECTION_STORAGE_TO_HOST,
    Direction.STORAGE_CLEAR: engine_pb2.KVCopy.DIRECTION_STORAGE_CLEAR,
}


class WorkerError(RuntimeError):
    pass


class WorkerLost(WorkerError):
    """The worker cannot answer the batches in flight (gone, restarted, or past the result
    deadline): their requests fail UNAVAILABLE."""


def _never_lost() -> str:
    return ""


@dataclass(frozen=True, slots=True)
class SentBatch:
    batch_id: int
    items: list[Item]


class WorkerLink:
    def __init__(
        self,
        sock: zmq.Socket,
        info: engine_pb2.WorkerInfo,
        metrics: SchedulerMetrics,
        lost: Callable[[], str] = _never_lost,
        result_timeout_s: float = 120.0,
    ):
        self.sock = sock
        self.info = info
        self.metrics = metrics
        self.lost = lost  # "" while the worker may still answer, else why it will not
        self.result_timeout_s = result_timeout_s
        self.in_flight: deque[SentBatch] = deque()  # oldest first, as the results come
        self._last_id = 0

    @property
    def next_batch_id(self) -> int:
        return self._last_id + 1

    def send(
        self,
        items: list[Item],
        grammars: Sequence[engine_pb2.GrammarCompile] = (),
        copies: Sequence[Copy] = (),
    ) -> None:
        """Queues a batch, with grammars to compile and KV copies between tiers (run first);
        it may have no items."""
        self._last_id += 1
        batch = engine_pb2.ForwardBatch(batch_id=self._last_id, is_decode=is_decode(items))
        batch.grammars.extend(grammars)
        batch.copies.extend(
            engine_pb2.KVCopy(
                direction=_DIRECTIONS[c.direction],
                src_slots=pack_i32(c.src),
                dst_slots=pack_i32(c.dst),
                keys=b"".join(c.keys),
                load_id=c.load_id,
            )
            for c in copies
        )
        batch.reqs.extend(forward_request(it) for it in items)
        parent, links = request_spans.batch_context([it.req for it in items])
        batch.trace_context.update(parent)
        batch.trace_links.extend(links)
        self.metrics.on_batch(self.info, items)
        transport.send(self.sock, engine_pb2.SchedulerToWorker(forward=batch))
        self.in_flight.append(SentBatch(self._last_id, items))

    def recv(self) -> engine_pb2.ForwardResult:
        """Waits for the result of the oldest batch in flight (removed from in_flight)."""
        sent = self.in_flight.popleft()
        reply = self._recv_reply()
        if not reply.HasField("result") or reply.result.batch_id != sent.batch_id:
            raise WorkerError(f"the worker answered batch {sent.batch_id} with something else")
        if reply.result.worker_instance != self.info.instance_id:
            # Its KV pool is new and empty: every slot the tree names is garbage now.
            raise WorkerLost(
                f"the worker restarted (instance {self.info.instance_id or '?'} -> "
                f"{reply.result.worker_instance or '?'}); its KV pool is gone"
            )
        return reply.result

    def _recv_reply(self) -> engine_pb2.WorkerToScheduler:
        """The next reply; WorkerLost once the connection is dead or the deadline passed."""
        deadline = time.monotonic() + self.result_timeout_s
        while not self.sock.poll(POLL_SLICE_MS):
            if why := self.lost():
                raise WorkerLost(why)
            if time.monotonic() > deadline:
                raise WorkerLost(
                    f"the worker did not answer a batch within {self.result_timeout_s:g} s "
                    "(--worker-result-timeout)"
                )
        try:
            return transport.recv(self.sock, engine_pb2.WorkerToScheduler)
        except transport.BadFrame as e:  # the results are in order: one lost, all out of step
            raise WorkerLost(f"the worker sent an unreadable reply ({e})") from e


def forward_request(it: Item) -> engine_pb2.ForwardRequest:
    req = it.req
    end = it.start + it.n
    fr = engine_pb2.ForwardRequest(
        req_slot=req.req_slot,
        rid=req.rid,
        prefix_len=it.start,
        sample=it.sample,
        out_slots=pack_i32(req.kv_slots[it.start : end]),
    )
    if it.from_last:
        fr.use_last_sampled = True
    else:
        fr.input_ids = pack_i32(req.fill_ids[it.start : it.start + it.n_real])
    if it.drafts:
        fr.draft_tokens = pack_i32(it.drafts)
    if it.is_prefill:  # decode steps never score the prompt
        prompt_logprobs.fill_request(fr, it)
    if req.table_dirty:
        _rewrite_row(fr, req, it.start)
    return fr


def _rewrite_row(fr: engine_pb2.ForwardRequest, req: Req, prefix_len: int) -> None:
    """The worker's table row is new or stale: send all it needs to rebuild it."""
    fr.is_new = True
    fr.prefix_slots = pack_i32(req.kv_slots[:prefix_len])
    fr.sampling.CopyFrom(req.sampling)
    fr.output_ids = pack_i32(req.output_ids)
    fr.eos_token_ids.extend(sorted(req.eos_token_ids))
    req.table_dirty = False
