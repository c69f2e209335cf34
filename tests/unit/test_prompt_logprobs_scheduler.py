"""Prompt logprobs and max_tokens 0 in the real scheduler, against the fake worker.

The fake worker scores each prompt row from the KV it reads back through the request's
table row (tests/fake_worker.py), so a wrong row, a wrong target, a gap or a duplicate
across chunks or retractions shows up as a list different from expected_prompt_logprobs.
"""

from __future__ import annotations

import random

import pytest

from radixserve.internal.v1 import engine_pb2
from services.common.transport import pack_i32
from services.scheduler import prompt_logprobs
from services.scheduler.request import Req
from tests.fake_worker import FRONTEND, expected, expected_prompt_logprobs, make

Deltas = dict[str, list[engine_pb2.TokenDelta]]


def submit(sched, rid: str, prompt: list[int], max_tokens: int, **sampling) -> None:
    sp = engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, **sampling)
    msg = engine_pb2.TokenizedRequest(rid=rid, input_ids=pack_i32(prompt), sampling=sp)
    sched.add_request(FRONTEND, msg)


def run_all(sched, on_step=None, max_steps: int = 100_000) -> Deltas:
    """Every delta of every request, in order; checks the idle slot invariant at the end."""
    out: Deltas = {}
    for step in range(max_steps):
        worked = sched.step()
        for deltas in sched.outbox.take().values():
            for d in deltas:
                out.setdefault(d.rid, []).append(d)
        if on_step:
            on_step(step)
        if not worked:
            sched.check_idle()
            if not sched.has_requests():
                break
    return out


def scored(deltas: list[engine_pb2.TokenDelta]) -> tuple[int, list[tuple[int, float]]]:
    """(start, entries) from the one delta that carries them, which must be the first."""
    carrying = [i for i, d in enumerate(deltas) if d.prompt_logprobs_start]
    assert carrying == [0], f"prompt logprobs on deltas {carrying}, expected on the first only"
    d = deltas[0]
    return d.prompt_logprobs_start, [(lp.token_id, lp.logprob) for lp in d.prompt_logprobs]


def tokens(deltas: list[engine_pb2.TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def approx(entries: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return [(t, pytest.approx(lp, abs=1e-6)) for t, lp in entries]


PROMPT = list(range(10, 50))  # 40 tokens


@pytest.mark.parametrize("chunk", [0, 7, 16])
@pytest.mark.parametrize("start", [0, 1, 5, 38, 39])
def test_scores_every_asked_position_across_chunks(chunk, start):
    sched, _ = make(chunked_prefill_size=chunk)
    submit(sched, "a", PROMPT, 4, prompt_logprobs=True, prompt_logprobs_start=start)
    got = run_all(sched)["a"]
    first, entries = scored(got)
    assert first == max(start, 1)
    assert entries == approx(expected_prompt_logprobs(PROMPT, start))
    assert tokens(got) == expected(PROMPT, 4)


def test_cached_prefix_is_matched_only_below_the_start_and_whole_prompt_is_cached():
    sched, _ = make(chunked_prefill_size=8)
    submit(sched, "warm", PROMPT, 2)
    run_all(sched)
    submit(sched, "at20", PROMPT, 2, prompt_logprobs=True, prompt_logprobs_start=20)
    got = run_all(sched)["at20"]
    assert got[-1].cached_tokens == 19  # the logits at position 19 score token 20
    assert scored(got)[1] == approx(expected_prompt_logprobs(PROMPT, 20))
    submit(sched, "at0", PROMPT, 2, prompt_logprobs=True)
    got = run_all(sched)["at0"]
    assert got[-1].cached_tokens == 0
    assert scored(got)[1] == approx(expected_prompt_logprobs(PROMPT, 0))
    submit(sched, "plain", PROMPT, 2)
    assert run_all(sched)["plain"][-1].cached_tokens == len(PROMPT) - 1


# 39: the prompt's last token is left alone, and runs as a one-token (decode-shaped) step.
@pytest.mark.parametrize("chunk", [0, 8, 39])
def test_max_tokens_zero_is_prefill_only_and_caches_the_prompt(chunk):
    sched, worker = make(chunked_prefill_size=chunk)
    submit(sched, "a", PROMPT, 0, prompt_logprobs=True, top_logprobs=2)
    got = run_all(sched)["a"]
    assert len(got) == 1
    d = got[0]
    assert (d.finish_reason, d.prompt_tokens, d.cached_tokens, d.completion_tokens) == (
        "length",
        40,
        0,
        0,
    )
    assert not d.token_ids
    assert scored(got)[1] == approx(expected_prompt_logprobs(PROMPT))
    assert not any(r.sample for b in worker.batches for r in b.reqs)
    submit(sched, "b", PROMPT, 0)
    again = run_all(sched)["b"]
    assert (again[-1].finish_reason, again[-1].cached_tokens) == ("length", 39)
    assert not again[-1].prompt_logprobs  # not asked


def test_abort_mid_prompt_logprob_prefill_leaves_the_pool_clean():
    sched, _ = make(chunked_prefill_size=8)
    long = list(range(1, 200))

    def abort_at(step: int) -> None:
        if step == 3:
            sched.abort("a", "client cancelled")

    submit(sched, "a", long, 0, prompt_logprobs=True)
    got = run_all(sched, on_step=abort_at)["a"]  # run_all checks the slot invariant
    assert got[-1].finish_reason == "abort"
    assert not any(d.prompt_logprobs for d in got)  # incomplete: none sent
    sched.check_idle()
    stats = sched.stats()
    assert stats.used_tokens == 0 and stats.protected_tokens == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_retraction_stitches_without_gaps_or_repeats(page_size, caplog):
    rng = random.Random(5)
    sched, _ = make(num_slots=700, max_running=16, page_size=page_size, chunked_prefill_size=24)
    want = {}
    for i in range(12):
        prompt = [rng.randrange(1, 900) for _ in range(rng.randrange(30, 90))]
        start = rng.randrange(0, len(prompt))
        want[f"r{i}"] = (prompt, start)
        submit(sched, f"r{i}", prompt, 60, prompt_logprobs=True, prompt_logprobs_start=start)
    with caplog.at_level("WARNING", logger="radixserve.scheduler"):
        got = run_all(sched)
    assert "Retract requests" in caplog.text
    for rid, (prompt, start) in want.items():
        assert scored(got[rid])[1] == approx(expected_prompt_logprobs(prompt, start)), rid
        assert tokens(got[rid]) == expected(prompt, 60), rid


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_mid_prefill_resumes_scoring_where_it_stopped(page_size):
    sched, _ = make(page_size=page_size, chunked_prefill_size=8)
    prompt = list(range(300, 360))
    partial: list[int] = []

    def retract_mid_prefill(step: int) -> None:
        req = sched.queues.by_rid.get("a")
        if step == 2 and req is not None and req in sched.queues.running and req.in_prefill:
            partial.append(len(req.prompt_logprobs))
            sched.queues.retract(req)  # as decode's _retract_one does when the pool runs dry

    submit(sched, "a", prompt, 3, prompt_logprobs=True, prompt_logprobs_start=3)
    got = run_all(sched, on_step=retract_mid_prefill)["a"]
    assert partial and 0 < partial[0] < len(prompt) - 3
    assert scored(got)[1] == approx(expected_prompt_logprobs(prompt, 3))
    assert tokens(got) == expected(prompt, 3)


def test_one_token_prompt_has_an_empty_list_from_position_1():
    sched, _ = make()
    submit(sched, "a", [7], 2, prompt_logprobs=True)
    assert scored(run_all(sched)["a"]) == (1, [])


def test_start_beyond_the_prompt_is_refused_naming_the_field():
    sched, _ = make()
    submit(sched, "a", PROMPT, 2, prompt_logprobs=True, prompt_logprobs_start=40)
    (d,) = run_all(sched)["a"]
    assert d.error_code == "INVALID_ARGUMENT"
    assert "prompt_logprobs_start" in d.finish_message and "40" in d.finish_message


# ---- the pure functions ------------------------------------------------------------------


def _req(n: int, start: int | None, collected: int = 0) -> Req:
    sp = engine_pb2.SamplingParams(prompt_logprobs=True)
    if start is not None:
        sp.prompt_logprobs_start = start
    req = Req(rid="r", identity=b"", input_ids=list(range(100, 100 + n)), sampling=sp)
    req.prompt_logprobs = [engine_pb2.TokenLogprob()] * collected
    return req


def test_match_limit_and_targets_follow_the_index_table():
    req = _req(10, 4)
    assert prompt_logprobs.match_limit(req) == 3
    # chunk [0, 5): rows 3, 4 predict positions 4, 5
    assert prompt_logprobs.targets(req, 0, 5) == (3, [104, 105])
    req = _req(10, 4, collected=2)  # positions 4 and 5 done
    assert prompt_logprobs.match_limit(req) == 5
    assert prompt_logprobs.targets(req, 5, 5) == (0, [106, 107, 108, 109])
    req = _req(10, None, collected=9)  # all done
    assert prompt_logprobs.match_limit(req) is None
    assert prompt_logprobs.targets(req, 9, 1) == (0, [])
    plain = Req(rid="p", identity=b"", input_ids=[1, 2, 3], sampling=engine_pb2.SamplingParams())
    assert prompt_logprobs.match_limit(plain) is None


def test_the_list_goes_out_once_complete():
    req = _req(5, 0, collected=3)
    d = engine_pb2.TokenDelta()
    prompt_logprobs.fill_delta(req, d)
    assert not d.prompt_logprobs_start  # one entry still missing
    prompt_logprobs.collect(req, [engine_pb2.TokenLogprob(token_id=104)])
    prompt_logprobs.fill_delta(req, d)
    assert (d.prompt_logprobs_start, len(d.prompt_logprobs)) == (1, 4)
    again = engine_pb2.TokenDelta()
    prompt_logprobs.fill_delta(req, again)
    assert not again.prompt_logprobs_start
    assert prompt_logprobs.match_limit(req) is None  # after a retraction: no re-scoring
