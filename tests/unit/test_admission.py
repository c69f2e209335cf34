"""Admission control (issue 41): a full queue refuses a new request at once with
RESOURCE_EXHAUSTED and a Retry-After, a request that waited past --max-queue-time ends
DEADLINE_EXCEEDED holding nothing, and the queue's token count follows every way in and out."""

from __future__ import annotations

import time

import pytest

from radixserve.internal.v1 import engine_pb2
from services.common.config import SchedulerConfig
from services.scheduler.admission import QueueLimits
from services.scheduler.req_queues import ReqQueue
from services.scheduler.request import Req
from tests.fake_worker import expected, make, run, submit


def _req(rid: str, n: int) -> Req:
    prompt = list(range(1, n + 1))
    return Req(rid=rid, identity=b"f", input_ids=prompt, sampling=engine_pb2.SamplingParams())


def test_the_queue_counts_prompt_tokens_through_every_move():
    q = ReqQueue()
    a, b = _req("a", 5), _req("b", 7)
    q.append(a)
    q.append(b)
    q.append(a)  # already there: counted once
    assert q.tokens == 12
    q.discard(a)
    q.discard(a)
    assert q.tokens == 7
    q.push_front(a)  # a retraction puts it back at the front
    assert list(q) == [a, b] and q.tokens == 12


def test_defaults_are_sized_from_the_engine_and_minus_one_is_unlimited():
    limits = QueueLimits.of(SchedulerConfig(), max_running=16, pool_tokens=1000)
    assert (limits.max_requests, limits.max_tokens, limits.max_wait_s) == (128, 4000, 0.0)
    off = QueueLimits.of(
        SchedulerConfig(max_queued_requests=-1, max_total_queued_tokens=-1), 16, 1000
    )
    assert (off.max_requests, off.max_tokens) == (0, 0)


@pytest.mark.parametrize(
    "kw, flag",
    [
        ({"max_queued_requests": -2}, "--max-queued-requests"),
        ({"max_total_queued_tokens": -5}, "--max-total-queued-tokens"),
        ({"max_queue_time": -1.0}, "--max-queue-time"),
        ({"max_queue_time": float("nan")}, "--max-queue-time"),
    ],
)
def test_bad_limits_are_refused_naming_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        SchedulerConfig(**kw)


def test_a_full_queue_refuses_at_once_and_the_admitted_finish_exact():
    sched, _ = make(num_slots=4096, max_running=2, max_queued_requests=3)
    prompts = {f"r{i}": list(range(10 + i, 30 + i)) for i in range(5)}
    for rid, prompt in prompts.items():
        submit(sched, rid, prompt, 4)
    refused = {d.rid: d for ds in sched.outbox.take().values() for d in ds}
    assert set(refused) == {"r3", "r4"}
    for d in refused.values():
        assert d.error_code == "RESOURCE_EXHAUSTED" and d.finish_reason == "abort"
        assert "--max-queued-requests 3" in d.finish_message and d.retry_after >= 1
    final = run(sched)
    for rid in ("r0", "r1", "r2"):
        assert list(final[rid].token_ids) == expected(prompts[rid], 4)
    sched.check_idle()


def test_queued_tokens_limit_refuses_what_does_not_fit():
    sched, _ = make(num_slots=4096, max_total_queued_tokens=50)
    submit(sched, "a", list(range(1, 41)), 2)
    submit(sched, "b", list(range(1, 21)), 2)  # 40 + 20 > 50
    submit(sched, "c", list(range(1, 11)), 2)  # 40 + 10 fits
    refused = [d for ds in sched.outbox.take().values() for d in ds]
    assert [d.rid for d in refused] == ["b"]
    assert "--max-total-queued-tokens 50" in refused[0].finish_message
    final = run(sched)
    assert set(final) == {"a", "c"} and not final["a"].error_code
    sched.check_idle()


def test_a_request_past_its_queue_time_ends_and_holds_nothing():
    sched, _ = make(num_slots=4096, max_running=1, max_queue_time=0.05)
    submit(sched, "first", list(range(1, 20)), 30)
    submit(sched, "late", list(range(5, 25)), 3)
    sched.queues.by_rid["late"].enqueued_at = time.monotonic() - 1.0  # waited a second
    final = run(sched)
    assert final["late"].error_code == "DEADLINE_EXCEEDED"
    assert "--max-queue-time" in final["late"].finish_message and not final["late"].token_ids
    assert list(final["first"].token_ids) == expected(list(range(1, 20)), 30)
    sched.check_idle()
