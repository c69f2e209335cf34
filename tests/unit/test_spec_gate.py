"""The speculation gate: a step verifies drafts only when its expected tokens per second beat
a plain step's, by periods it measures (a fake clock here). End to end against the
slot-checking fake worker: where verify steps are slow the gate runs them plain, outputs stay
token-exact and no slot leaks; where drafts pay, it lets them through."""

from __future__ import annotations

import pytest

from services.common.goodput import (
    EXPLORE_EVERY,
    MAX_EXPLORE_EVERY,
    MIN_STEPS,
    WINDOW,
    Goodput,
    explore_interval,
)
from services.scheduler.spec_gate import EXPLORE_CALLS, REFRESH_AFTER_IDLE_S, SpecGate, StepKind
from tests.fake_worker import expected, run, submit
from tests.unit.test_speculative_scheduler import Oracle, spec_sched, verify_items


def timed_gate(periods: dict[StepKind, float]) -> SpecGate:
    """A gate whose clock advances by ``periods[kind]`` before each result it sees."""
    now = [0.0]
    gate = SpecGate(clock=lambda: now[0])
    observe = gate.observe

    def timed(kind: StepKind, batch: int, tokens: int) -> None:
        now[0] += periods.get(kind, 0.001)
        observe(kind, batch, tokens)

    gate.observe = timed  # type: ignore[method-assign]
    return gate


def goodput(*rates: float) -> Goodput:
    """Steps of one second each, delivering ``rates`` tokens."""
    g = Goodput()
    for r in rates:
        g.add(1.0, r)
    return g


def test_periods_are_measured_between_results_of_one_kind():
    gate = timed_gate({StepKind.PLAIN: 0.010, StepKind.VERIFY: 0.040})
    gate.observe(StepKind.VERIFY, 16, 40)
    assert gate.verify == {}  # one result is no period yet
    gate.observe(StepKind.VERIFY, 16, 40)
    gate.observe(StepKind.PLAIN, 16, 16)  # after a verify step: not a plain period
    assert list(gate.verify[5].rates) == [pytest.approx(1000.0)] and gate.plain == {}
    gate.observe(StepKind.PLAIN, 17, 17)
    gate.observe(StepKind.OTHER, 17, 0)  # a prefill breaks the chain
    gate.observe(StepKind.PLAIN, 17, 17)
    gate.idle()
    gate.observe(StepKind.PLAIN, 17, 17)
    assert list(gate.plain[5].rates) == [pytest.approx(1700.0)]
    gate.observe(StepKind.PLAIN, 4, 4)  # another bucket
    assert list(gate.plain[3].rates) == [pytest.approx(400.0)]


def test_a_rate_is_the_mean_tokens_over_the_median_period():
    g = Goodput()
    for seconds in (0.010, 0.011, 0.500, 0.009):  # one step held up by other work
        g.add(seconds, 16)
    assert g.known and g.rate == pytest.approx(16 / 0.0105)
    # A verify step commits 1 token when its first draft fails, 1 + k when all pass: the
    # rate counts what the steps delivered (a median of per-step rates read 250 here).
    g = Goodput()
    for tokens in (1, 1, 5, 5, 1):
        g.add(0.004, tokens)
    assert g.rate == pytest.approx(2.6 / 0.004)
    for _ in range(WINDOW):
        g.add(1.0, 1.0)
    assert len(g.steps) == WINDOW and g.rate == 1.0
    assert not goodput(*[1.0] * (MIN_STEPS - 1)).known


def test_worth_compares_measured_tokens_per_second():
    gate = SpecGate()
    assert gate.worth(16)  # nothing measured: verify steps first
    gate.verify[5] = goodput(1300.0, 1300.0, 1300.0)
    assert not gate.worth(16)  # then plain ones
    gate.plain[5] = goodput(1600.0, 1600.0, 1600.0)
    assert not gate.worth(16)
    gate.verify[5] = goodput(1700.0, 1700.0, 1700.0)
    assert gate.worth(16)
    assert gate.worth(2)  # bucket 2 unmeasured


@pytest.mark.parametrize("verify_rate", [1550.0, 1650.0])
def test_the_other_mode_is_measured_again_now_and_then(verify_rate):
    gate = SpecGate(
        verify={5: goodput(*[verify_rate] * 3)}, plain={5: goodput(1600.0, 1600.0, 1600.0)}
    )
    best = verify_rate > 1600.0
    every = explore_interval(verify_rate, 1600.0)
    assert EXPLORE_EVERY <= every < EXPLORE_EVERY * 1.1  # the two are close
    answers = [gate.worth(16) for _ in range(2 * (every + EXPLORE_CALLS - 1))]
    # A few calls in a row: two steps of the other mode back to back measure one period.
    assert answers.count(not best) == 2 * EXPLORE_CALLS
    assert answers[every - 1 : every - 1 + EXPLORE_CALLS] == [not best] * EXPLORE_CALLS


def test_a_mode_far_behind_is_looked_at_rarely():
    assert explore_interval(2.0, 1.0) == explore_interval(1.0, 2.0) == 4 * EXPLORE_EVERY
    assert explore_interval(1.0, 100.0) == MAX_EXPLORE_EVERY


def test_after_a_pause_old_measurements_are_thinned_and_both_modes_measured_again():
    """Another workload may follow a pause: from its first result on, each mode keeps its
    newest MIN_STEPS // 2 rates and is measured again, verify first, so the new steps
    decide; a short gap (a client's next call) changes nothing."""
    now = [0.0]
    gate = SpecGate(
        clock=lambda: now[0],
        verify={5: goodput(*[100.0] * WINDOW)},
        plain={5: goodput(*[1600.0] * WINDOW)},
    )
    assert not gate.worth(16)
    gate.idle()
    now[0] += REFRESH_AFTER_IDLE_S / 10
    gate.observe(StepKind.OTHER, 16, 0)  # a short gap: the next request's prefill
    assert len(gate.verify[5].steps) == WINDOW and not gate.worth(16)
    gate.idle()
    now[0] += REFRESH_AFTER_IDLE_S
    gate.idle()  # the loop turns while idle: the pause counts from its start
    now[0] += REFRESH_AFTER_IDLE_S / 2
    assert not gate.worth(16)  # the lookahead before the first result: as before
    gate.observe(StepKind.OTHER, 16, 0)
    assert len(gate.verify[5].steps) == len(gate.plain[5].steps) == MIN_STEPS // 2
    for _ in range(MIN_STEPS - MIN_STEPS // 2):  # the new workload's verify steps pay
        assert gate.worth(16)
        gate.verify[5].add(1.0, 3200.0)
    assert not gate.worth(16)  # now plain, until known
    for _ in range(MIN_STEPS - MIN_STEPS // 2):
        gate.plain[5].add(1.0, 1600.0)
    assert gate.worth(16)


def test_verify_steps_now_and_then_are_measured_after_plain_ones():
    """Drafts now and then (text that seldom repeats): a verify step seldom follows another,
    but its period after a plain step is its whole cost all the same (nothing overlaps it),
    so it is measured there; a plain step after a verify step still is not (the overlap
    schedule had nothing queued behind the verify step)."""
    gate = timed_gate({StepKind.PLAIN: 0.005, StepKind.VERIFY: 0.020})
    for _ in range(3):
        for _ in range(5):
            gate.observe(StepKind.PLAIN, 16, 16)
        gate.observe(StepKind.VERIFY, 16, 18)  # two requests drafted, one token accepted
    assert list(gate.verify[5].rates) == [pytest.approx(900.0)] * 3
    assert list(gate.plain[5].rates) == [pytest.approx(3200.0)] * 12
    assert not gate.worth(16)  # measured: the sporadic drafts do not pay


def test_a_smaller_batch_follows_a_larger_ones_verdict_for_verify_steps():
    """A batch draining (16, then 9, 4, ...) verifies in buckets not measured yet where the
    nearest larger measured bucket chose verify, looking at plain steps now and then only;
    a larger bucket's verdict for plain decides nothing below it."""
    gate = SpecGate(verify={5: goodput(*[3200.0] * 3)}, plain={5: goodput(*[1600.0] * 3)})
    every = explore_interval(3200.0, 1600.0)
    answers = [gate.worth(9) for _ in range(every + EXPLORE_CALLS - 1)]
    # bucket 4: verify, then a look at plain steps
    assert answers == [True] * (every - 1) + [False] * EXPLORE_CALLS
    assert gate.worth(16) and gate.worth(2)
    gate.plain[4] = goodput(*[1600.0] * 3)  # bucket 4 measured: its own ratio decides
    gate.verify[4] = goodput(*[1000.0] * 3)
    assert not gate.worth(9)
    assert gate.worth(2)  # bucket 2: the nearest larger measured bucket is 4 now: no verdict,
    gate.verify[2] = goodput(*[900.0] * 3)  # so both modes are measured, verify first
    assert not gate.worth(2)
    assert gate.worth(33)  # above every measured bucket: measured itself


def test_verifying_says_what_the_measurements_favour_and_explores_nothing():
    gate = SpecGate(verify={5: goodput(900.0, 900.0, 900.0)})
    assert gate.verifying(16)  # plain unknown
    gate.plain[5] = goodput(1600.0, 1600.0, 1600.0)
    assert not any(gate.verifying(16) for _ in range(4 * MAX_EXPLORE_EVERY))
    assert gate.verifying(4)  # another bucket, unknown
    assert SpecGate("always", plain={5: goodput(1600.0, 1600.0, 1600.0)}).verifying(16)


def test_always_never_declines_nor_measures():
    gate = SpecGate("always", verify={5: goodput(1.0, 1.0, 1.0)}, plain={5: goodput(9.0, 9.0, 9.0)})
    assert gate.worth(16)
    gate.observe(StepKind.PLAIN, 16, 16)
    gate.observe(StepKind.PLAIN, 16, 16)
    assert list(gate.plain[5].rates) == [9.0] * 3
    with pytest.raises(ValueError, match="speculative_gate"):
        SpecGate("sometimes")


def serve_gated(periods: dict[StepKind, float], corrupt) -> tuple[dict, object]:
    prompts = {f"r{i}": [i + 1] + list(range(2, 40)) for i in range(8)}
    sched = spec_sched(Oracle(corrupt), speculative_gate="goodput", speculative_num_draft_tokens=4)
    sched.spec.gate = timed_gate(periods)
    for rid, prompt in prompts.items():
        submit(sched, rid, prompt, 60)
    got = run(sched)
    for rid, prompt in prompts.items():
        assert list(got[rid].token_ids) == expected(prompt, 60)
    return got, sched


def test_slow_verify_steps_run_plain_and_stay_exact():
    # A verify step costs 4 plain ones; every second draft is wrong: ~2 tokens a verify step.
    periods = {StepKind.PLAIN: 0.010, StepKind.VERIFY: 0.040}
    _, sched = serve_gated(periods, corrupt=lambda rid, pos: pos % 2 == 0)
    steps = sched.link.sock.worker.batches
    verify = sum(any(r.draft_tokens for r in b.reqs) for b in steps)
    assert verify <= 6 and len(steps) > 50  # a few to measure and look again, then plain
    sched.check_idle()  # no slot leaked by drafts dropped after proposing


def test_cheap_verify_steps_keep_speculating():
    periods = {StepKind.PLAIN: 0.010, StepKind.VERIFY: 0.012}
    _, sched = serve_gated(periods, corrupt=lambda rid, pos: False)
    drafted = sum(len(r.draft_tokens) for r in verify_items(sched))
    assert drafted > 0
    steps = sched.link.sock.worker.batches
    assert len(steps) < 60 // 2  # several tokens a step
    sched.check_idle()
