"""Speculative decoding in the scheduler, against the slot-checking fake worker (its verify
steps read every draft back through the slots the scheduler named).

Drafts come from an oracle that knows the fake model's true continuation and corrupts it
where the test says, so accepts and rejects land where wanted: outputs stay token-exact,
stops inside an accepted run keep nothing after them, rejected slots go back at once, and
the idle check proves no slot leaked. The real draft sources run too (ngram, suffix).
"""

from __future__ import annotations

import random

import pytest

from radixserve.internal.v1 import engine_pb2
from services.common.config import SchedulerConfig
from services.common.transport import pack_i32, unpack_i32
from services.scheduler.scheduler import Scheduler
from services.scheduler.spec_drafts import propose
from services.scheduler.speculative import (
    BACKLOG_TOKENS_PER_STEP,
    FEED_TOKENS_PER_STEP,
    START_OFF_BELOW,
)
from tests.fake_worker import (
    FRONTEND,
    VOCAB,
    copying_model,
    expected,
    make,
    next_token,
    run,
    submit,
)


class Oracle:
    """Drafts the true continuation of each request (the fake model's), wrong where
    ``corrupt(rid, position)`` says."""

    def __init__(self, corrupt=lambda rid, pos: False):
        self.corrupt = corrupt

    def __call__(self, algorithm, index, namespace, seq_id, tokens, k) -> list[int]:
        rid = seq_id.rsplit("#", 1)[0]
        seq = list(tokens)
        out = []
        for _ in range(k):
            t = next_token(seq)
            if self.corrupt(rid, len(seq)):
                t = (t + 1) % (VOCAB - 1)
            out.append(t)
            seq.append(t)
        return out


def spec_sched(oracle=None, **cfg) -> Scheduler:
    cfg.setdefault("speculative_algorithm", "ngram")
    cfg.setdefault("speculative_gate", "always")  # these tests count verify steps
    sched, _ = make(**cfg)
    if oracle is not None:
        sched.spec.draft_fn = oracle
    return sched


def verify_items(sched: Scheduler) -> list[engine_pb2.ForwardRequest]:
    """Every request step the fake worker got with drafts."""
    batches = sched.link.sock.worker.batches
    return [r for b in batches for r in b.reqs if r.draft_tokens]


def test_all_accepted_takes_several_tokens_a_step():
    prompt = list(range(1, 30))
    sched = spec_sched(Oracle(), speculative_num_draft_tokens=4)
    submit(sched, "a", prompt, 40)
    got = run(sched)["a"]
    assert list(got.token_ids) == expected(prompt, 40)
    batches = sched.link.sock.worker.batches
    # A prefill, then decode steps of up to 5 tokens: 1 + 4 drafts each.
    assert len(batches) <= 1 + 40 // 5 + 1
    drafted = [len(unpack_i32(r.draft_tokens)) for r in verify_items(sched)]
    assert max(drafted) == 4 and sum(drafted) >= 30


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("overlap", [False, True])
def test_rejections_free_their_slots_and_stay_exact(page_size, overlap):
    rng = random.Random(1)
    prompts = {
        f"r{i}": [rng.randrange(1, 900) for _ in range(rng.randrange(5, 40))] for i in range(6)
    }
    oracle = Oracle(corrupt=lambda rid, pos: rng.random() < 0.3)
    sched = spec_sched(
        oracle, page_size=page_size, disable_overlap_schedule=not overlap, num_slots=2000
    )
    for rid, p in prompts.items():
        submit(sched, rid, p, 30)
    got = run(sched)
    assert {rid: list(d.token_ids) for rid, d in got.items()} == {
        rid: expected(p, 30) for rid, p in prompts.items()
    }
    sched.kv.check()


def test_a_stop_inside_accepted_drafts_keeps_nothing_after_it():
    prompt = list(range(1, 20))
    truth = expected(prompt, 30)
    stop = truth[6]
    assert stop not in truth[:6]
    sched = spec_sched(Oracle(), speculative_num_draft_tokens=8)
    sampling = engine_pb2.SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop])
    sched.add_request(
        FRONTEND,
        engine_pb2.TokenizedRequest(rid="a", input_ids=pack_i32(prompt), sampling=sampling),
    )
    got = run(sched)["a"]
    assert list(got.token_ids) == truth[:7]
    assert (got.finish_reason, got.matched_stop_token, got.completion_tokens) == ("stop", stop, 7)
    # What the tree keeps is the output's KV, not the accepted drafts past the stop.
    sched.kv.check()
    submit(sched, "b", prompt + truth[:7] + [5], 1)
    assert run(sched)["b"].cached_tokens == len(prompt) + 6  # the last token has no KV


def test_min_tokens_and_max_tokens_bound_the_drafts():
    prompt = list(range(40, 60))
    truth = expected(prompt, 9)
    sched = spec_sched(Oracle(), speculative_num_draft_tokens=8)
    sampling = engine_pb2.SamplingParams(
        max_tokens=9, temperature=0, min_tokens=5, stop_token_ids=[truth[2]]
    )
    sched.add_request(
        FRONTEND,
        engine_pb2.TokenizedRequest(rid="a", input_ids=pack_i32(prompt), sampling=sampling),
    )
    got = run(sched)["a"]
    # The stop id at position 2 is under min_tokens: it does not stop there.
    want = truth if truth[2] not in truth[5:] else truth[: truth.index(truth[2], 5) + 1]
    assert list(got.token_ids) == want
    for r in verify_items(sched):
        # Never more drafts than the tokens left after the target's own.
        done = r.prefix_len + 1 - len(prompt)
        assert len(unpack_i32(r.draft_tokens)) <= 9 - done - 1


def test_opted_out_requests_never_draft_and_constrained_ones_may():
    prompt = list(range(1, 25))
    sched = spec_sched(Oracle())
    sampling = engine_pb2.SamplingParams(max_tokens=10, temperature=0, disable_speculation=True)
    sched.add_request(
        FRONTEND,
        engine_pb2.TokenizedRequest(rid="a", input_ids=pack_i32(prompt), sampling=sampling),
    )
    got = run(sched)["a"]
    assert list(got.token_ids) == expected(prompt, 10) and not verify_items(sched)
    constrained = engine_pb2.SamplingParams(max_tokens=3, temperature=0)
    constrained.constraint.regex = "[a-z]+"
    req = sched._new_req(FRONTEND, engine_pb2.TokenizedRequest(rid="b", sampling=constrained))
    assert sched.spec.may_speculate(req)  # the worker's grammar filters its drafts


def test_overlap_pauses_for_verify_steps_and_resumes_without_drafts():
    prompt = list(range(1, 25))
    drafting = {"on": True}

    def oracle(*args):
        return Oracle()(*args) if drafting["on"] else []

    sched = spec_sched(oracle)
    submit(sched, "a", prompt, 60)

    def switch(step):
        if step == 4:
            drafting["on"] = False

    got = run(sched, on_step=switch)["a"]
    assert list(got.token_ids) == expected(prompt, 60)
    batches = sched.link.sock.worker.batches
    verify_at = [i for i, b in enumerate(batches) if any(r.draft_tokens for r in b.reqs)]
    overlap_at = [i for i, b in enumerate(batches) if any(r.use_last_sampled for r in b.reqs)]
    assert verify_at and overlap_at and max(verify_at) < min(overlap_at)
    # Never a lookahead right behind a verify step.
    assert not set(overlap_at) & {i + 1 for i in verify_at}


def test_metrics_count_drafts_and_accepts():
    from services.scheduler.metrics import SchedulerMetrics

    prompt = list(range(1, 25))
    wrong = {30, 31, 40}  # positions whose draft is wrong
    oracle = Oracle(corrupt=lambda rid, pos: pos in wrong)
    metrics = SchedulerMetrics("fake", "0")
    sched = spec_sched(oracle)
    sched.metrics = sched.decode.metrics = sched.spec.metrics = metrics
    submit(sched, "a", prompt, 30)
    assert list(run(sched)["a"].token_ids) == expected(prompt, 30)
    reg = metrics.registry
    labels = {"model_name": "fake", "engine": "0"}

    def value(name: str) -> float:
        return reg.get_sample_value(f"radixserve:{name}_total", labels) or 0.0

    drafts, tokens = value("spec_decode_num_drafts"), value("spec_decode_num_draft_tokens")
    accepted = value("spec_decode_num_accepted_tokens")
    assert drafts == len(verify_items(sched)) and tokens > accepted > 0
    assert 0 < accepted / tokens < 1


def test_a_declining_gate_is_asked_before_anything_is_proposed():
    """Steps the gate runs plain propose nothing (a proposal costs tens of us a request,
    every step); once it verifies again, the requests draft as before."""
    calls: list[int] = []

    class Counting(Oracle):
        def __call__(self, *args):
            calls.append(1)
            return super().__call__(*args)

    rng = random.Random(6)
    prompts = {f"r{i}": [rng.randrange(1, VOCAB - 1) for _ in range(20)] for i in range(3)}
    sched = spec_sched(Counting(), speculative_gate="goodput")
    declined = {"on": True}
    sched.spec.gate.worth = lambda batch: not declined["on"]
    for rid, p in prompts.items():
        submit(sched, rid, p, 40)
    for _ in range(12):
        assert sched.step()
    assert not calls and not verify_items(sched)
    declined["on"] = False
    got = run(sched)
    assert calls and verify_items(sched)
    assert {rid: list(d.token_ids) for rid, d in got.items()} == {
        rid: expected(p, 40) for rid, p in prompts.items()
    }
    sched.kv.check()


def test_ngram_and_suffix_drafts_run_the_real_index():
    """A copy-prone fake model repeats its prompt's 12-token block (and deviates now and
    then): the real draft sources find the repeats, most drafts are accepted, the rest
    rejected and taken back, token-exact. The suffix index keeps finished text per
    namespace: another salt never drafts from it."""
    rng = random.Random(3)
    model = copying_model(12)
    block = [rng.randrange(1, 900) for _ in range(12)]
    prompt = block * 3
    for algorithm in ("ngram", "suffix"):
        sched = spec_sched(speculative_algorithm=algorithm, model=model)
        submit(sched, "a", prompt, 60)
        assert list(run(sched)["a"].token_ids) == expected(prompt, 60, model)
        drafted = sum(len(r.draft_tokens) // 4 for r in verify_items(sched))
        steps = len(sched.link.sock.worker.batches)
        assert drafted > 20 and steps < 40, (algorithm, drafted, steps)
        sched.kv.check()
    index = sched.spec.index
    assert sched.spec.draft_fn is propose and index is not None and len(index) == 1
    text = [rng.randrange(1, 900) for _ in range(30)]
    submit(sched, "x", text, 4, cache_salt="tenant-x")
    run(sched)
    assert index.propose("tenant-x", text[:10], 4) == text[10:14]
    assert index.propose("tenant-y", text[:10], 4) == []


def test_running_text_is_indexed_a_shared_ration_per_step_verify_or_plain():
    """Running requests' text enters the index FEED_TOKENS_PER_STEP tokens a step, all of
    them together and each in turn, in plain steps as in verify steps (so the gate compares
    steps that carry the same upkeep)."""
    rng = random.Random(6)
    for gate in ("always", "goodput"):
        sched = spec_sched(speculative_algorithm="suffix", speculative_gate=gate)
        spec = sched.spec
        if gate == "goodput":  # every step plain: the gate declines whatever is drafted
            spec.gate.worth = lambda batch: False
        prompts = {f"r{i}": [rng.randrange(1, 900) for _ in range(100)] for i in range(3)}
        for rid, p in prompts.items():
            submit(sched, rid, p, 40)
        while any(r.in_prefill for r in sched.queues.running) or len(sched.queues.running) < 3:
            assert sched.step()
        grown = []
        for _ in range(6):
            before = spec.index.num_tokens
            assert sched.step()
            grown.append(spec.index.num_tokens - before)
        assert grown == [FEED_TOKENS_PER_STEP] * 6, (gate, grown)
        assert all(r.spec.indexed > 0 for r in sched.queues.running)  # each had its turn
        run(sched)
        spec.index.check_integrity()
        sched.kv.check()


def test_running_text_waits_for_the_backlog_while_drafts_keep_failing_or_are_declined():
    """Engine-wide acceptance under START_OFF_BELOW (text that repeats nothing), or a gate
    that runs this batch size plain: neither the running requests' text nor the backlog
    (a shorter request's, finished) is indexed step by step; all of it once idle."""
    rng = random.Random(4)
    sched = spec_sched(speculative_algorithm="suffix")
    spec = sched.spec
    for off in ("acceptance", "gate"):
        if off == "acceptance":
            spec.accept_rate = START_OFF_BELOW / 2
        else:  # the gate measured plain steps of this size faster
            spec.accept_rate = 1.0
            spec.gate.verifying = lambda batch: False
        spec.reset()
        text, short = ([rng.randrange(1, 900) for _ in range(n)] for n in (60, 20))
        submit(sched, "r", text, 30)
        submit(sched, "s", short, 3)
        while "r" in sched.queues.by_rid:
            assert sched.step()
            assert spec.index.num_tokens == 0
        assert spec.backlog_tokens == len(text) + 30 + len(short) + 3
        out = run(sched)
        held = len(text) + len(out["r"].token_ids) + len(short) + len(out["s"].token_ids)
        assert spec.index.num_tokens == held  # the backlog, drained idle
        spec.index.check_integrity()


def test_finished_text_is_indexed_a_little_per_step_and_the_rest_when_idle():
    """Indexing a finished request's text costs tens of us a token: it waits in a backlog,
    BACKLOG_TOKENS_PER_STEP of it indexed per decode step, the rest once the engine idles;
    beyond the index's own bound the oldest waiting text is dropped."""
    rng = random.Random(5)
    sched = spec_sched(speculative_algorithm="suffix")
    spec = sched.spec
    spec.max_k = 0  # off: nothing indexed while a request runs
    text = [rng.randrange(1, 900) for _ in range(200)]
    submit(sched, "done", text, 2)
    submit(sched, "next", [rng.randrange(1, 900) for _ in range(5)], 8)  # keeps it busy
    while not spec.backlog:
        assert sched.step()
    # Upkeep runs while a batch is in flight, before its result (which finished "done").
    assert spec.backlog_tokens == 202 and spec.index.num_tokens == 0
    step = BACKLOG_TOKENS_PER_STEP
    assert sched.step()
    assert spec.backlog_tokens == 202 - step and spec.index.num_tokens == step
    assert sched.step()
    assert spec.backlog_tokens == 202 - 2 * step
    run(sched)  # idle at the end: the rest
    assert spec.backlog_tokens == 0 and not spec.backlog
    assert spec.index.propose("", text[:20], 4) == text[20:24]
    spec.index.check_integrity()
    spec.index.max_tokens = 150
    submit(sched, "big", [rng.randrange(1, 900) for _ in range(200)], 2)  # nothing cached
    while "big" in sched.queues.by_rid:
        assert sched.step()
    assert not spec.backlog and spec.backlog_tokens == 0  # 202 > 150: dropped


def test_a_cached_prefix_is_not_indexed_again():
    """A second turn's history is the first turn's text, indexed with it: only its last
    max_depth tokens (for windows across the end of the prefix) and what follows are added;
    drafts across that end still come from the index."""
    rng = random.Random(8)
    sched = spec_sched(speculative_algorithm="suffix")
    spec = sched.spec
    first = [rng.randrange(1, 900) for _ in range(120)]
    submit(sched, "t1", first, 8)
    turn1 = first + list(run(sched)["t1"].token_ids)
    assert spec.index.num_tokens == len(turn1)  # all of it (idle drained the backlog)
    second = turn1 + [rng.randrange(1, 900) for _ in range(20)]
    submit(sched, "t2", second, 8)
    req = sched.queues.by_rid["t2"]
    while req.in_prefill:
        assert sched.step()
    depth = spec.index.max_depth
    assert req.cached_tokens >= 100
    turn2 = second + list(run(sched)["t2"].token_ids)
    held = {sid.split("#")[0]: toks for _, sid, toks in spec.index.sequences()}
    assert held["t2"] == turn2[req.cached_tokens - depth :]
    assert spec.index.num_tokens == len(turn1) + len(held["t2"])
    across = turn2[len(turn1) - 10 : len(turn1) + 2]  # ends past the first turn's text
    assert spec.index.propose("", across, 4) == turn2[len(turn1) + 2 : len(turn1) + 6]
    spec.index.check_integrity()
    sched.kv.check()


def test_retraction_and_aborts_with_drafts_in_a_tight_pool(caplog):
    rng = random.Random(9)
    prompts = {
        f"r{i}": [rng.randrange(1, 900) for _ in range(rng.randrange(10, 60))] for i in range(24)
    }
    oracle = Oracle(corrupt=lambda rid, pos: rng.random() < 0.25)
    sched = spec_sched(
        oracle, num_slots=640, chunked_prefill_size=48, speculative_num_draft_tokens=6
    )
    for rid, p in prompts.items():
        submit(sched, rid, p, 100)

    def abort_some(step):
        if step in (7, 19):
            sched.abort(f"r{step % 16}", "test abort")

    with caplog.at_level("WARNING", logger="radixserve.scheduler"):
        got = run(sched, on_step=abort_some)
    assert "Retract requests" in caplog.text
    for rid, d in got.items():
        want = expected(prompts[rid], 100)
        if d.finish_reason == "abort":
            assert list(d.token_ids) == want[: len(d.token_ids)]
        else:
            assert list(d.token_ids) == want, rid
    sched.kv.check()


def test_config_bounds():
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens"):
        SchedulerConfig(speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="<= 16"):
        SchedulerConfig(speculative_num_draft_tokens=17)


def test_decode_log_line_shows_the_accept_length(caplog):
    prompt = list(range(1, 25))
    sched = spec_sched(Oracle(), decode_log_interval=2, speculative_num_draft_tokens=4)
    submit(sched, "a", prompt, 20)
    with caplog.at_level("INFO", logger="radixserve.scheduler"):
        run(sched)
    lines = [r.message for r in caplog.records if r.message.startswith("Decode batch.")]
    assert lines and all(", accept len: " in line for line in lines)
    assert ", accept len: 5.00, " in lines[0]  # every draft accepted: 1 + 4 tokens a step
