"""Token deltas for the frontends: collected while a step is applied, sent after it."""

from __future__ import annotations

import logging

import zmq

from radixserve.internal.v1 import engine_pb2
from services.common import transport
from services.scheduler import prompt_logprobs
from services.scheduler.request import Req

log = logging.getLogger("radixserve.scheduler")


def delta_of(req: Req) -> engine_pb2.TokenDelta:
    """What the request produced since its last delta (and, once finished, its timings)."""
    new = req.output_ids[req.sent_tokens :]
    d = engine_pb2.TokenDelta(
        rid=req.rid,
        token_ids=new,
        finish_reason=req.finish_reason,
        finish_message=req.finish_message,
        error_code=req.error_code,
        matched_stop_token=req.matched_stop_token,
        retry_after=req.retry_after,
    )
    if req.logprobs:
        d.logprobs.extend(req.logprobs[req.sent_tokens :])
    req.sent_tokens = len(req.output_ids)
    if not req.prompt_logprobs_done:
        prompt_logprobs.fill_delta(req, d)
    # Counts ride on every delta, so a frontend that stops early (stop string) has them.
    d.prompt_tokens = len(req.input_ids)
    d.cached_tokens = max(req.cached_tokens, 0)
    d.cached_host_tokens = req.cached_host_tokens
    d.cached_storage_tokens = req.cached_storage_tokens
    d.completion_tokens = len(req.output_ids)
    if req.finished:
        first = req.first_scheduled or req.finish_time
        first_token = req.first_token_time or req.finish_time
        d.queue_time = max(0.0, first - req.arrival_time)
        d.prefill_time = max(0.0, first_token - first)
        d.decode_time = max(0.0, req.finish_time - first_token)
    return d


class Outbox:
    def __init__(self):
        self._pending: dict[bytes, list[engine_pb2.TokenDelta]] = {}

    def add(self, req: Req) -> None:
        self._pending.setdefault(req.identity, []).append(delta_of(req))

    def take(self) -> dict[bytes, list[engine_pb2.TokenDelta]]:
        pending, self._pending = self._pending, {}
        return pending

    def flush(self, sock: zmq.Socket) -> list[str]:
        """Sends one message per frontend; returns the requests of frontends that went away."""
        lost: list[str] = []
        for identity, deltas in self.take().items():
            try:
                transport.send(sock, engine_pb2.SchedulerToFrontend(outputs=deltas), identity)
            except zmq.ZMQError as e:
                log.warning("frontend %r unreachable (%s); aborting its requests", identity, e)
                lost.extend(d.rid for d in deltas)
        return lost
