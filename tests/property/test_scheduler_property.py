"""Random workloads through the scheduler loop against the slot-checking fake worker.

Whatever the mix (shared prefixes, chunking, tiny pools that force retraction and eviction,
aborts at random steps, requests arriving while others decode, mixed prefill + decode
batches on or off, page size, overlap schedule on or off), every request that is not
aborted gets exactly the tokens the fake model gives its true sequence, and an idle engine
holds no KV beyond its evictable cache.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fake_worker import expected, make, run, submit

request = st.tuples(
    st.integers(0, 2),  # which shared prefix
    st.lists(st.integers(1, 899), min_size=1, max_size=12),  # own tail
    st.integers(1, 20),  # max_tokens
    st.sampled_from([0, 0, 1, 3, 8]),  # the step it arrives at
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request, min_size=1, max_size=12),
    prefixes=st.lists(
        st.lists(st.integers(1, 899), min_size=0, max_size=40), min_size=3, max_size=3
    ),
    page_size=st.sampled_from([1, 4, 16]),
    pool=st.integers(160, 600),
    chunk=st.sampled_from([-1, 8, 32]),
    overlap=st.booleans(),
    aborts=st.dictionaries(st.integers(0, 11), st.integers(0, 30), max_size=3),
    policy=st.sampled_from(["lpm", "fcfs", "dfs-weight"]),
    mixed=st.sampled_from([0, 4, 16, 256]),
)
def test_random_workloads_are_token_exact(
    reqs, prefixes, page_size, pool, chunk, overlap, aborts, policy, mixed
):
    sched, _ = make(
        num_slots=pool,
        max_running=8,
        page_size=page_size,
        chunked_prefill_size=chunk,
        disable_overlap_schedule=not overlap,
        schedule_policy=policy,
        mixed_prefill_tokens=mixed,
    )
    want, arrivals = {}, {}
    for i, (p, tail, n, at) in enumerate(reqs):
        prompt = prefixes[p] + tail
        want[f"r{i}"] = expected(prompt, n)
        arrivals.setdefault(at, []).append((f"r{i}", prompt, n))
    plan = {step: f"r{i}" for i, step in aborts.items() if i < len(reqs)}
    for rid, prompt, n in arrivals.pop(0, []):
        submit(sched, rid, prompt, n)

    def maybe_abort(step: int) -> None:
        # The engine went idle before a later arrival: it comes now, so run() goes on.
        due = step if sched.has_requests() else max(arrivals, default=step)
        for at in [at for at in arrivals if at <= due]:
            for rid, prompt, n in arrivals.pop(at):
                submit(sched, rid, prompt, n)
        if step in plan:
            sched.abort(plan[step], "test abort")

    got = run(sched, on_step=maybe_abort)
    assert set(got) == set(want)
    for rid, d in got.items():
        if d.finish_reason == "abort" and rid in plan.values():
            assert list(d.token_ids) == want[rid][: len(d.token_ids)]  # a prefix of the truth
        else:
            assert (list(d.token_ids), d.finish_reason) == (want[rid], "length"), rid
    size = sched.kv.cache.size_info()
    assert size.protected == 0 and sched.kv.held_by_requests() == 0
    assert sched.kv.allocator.num_free + size.evictable == sched.kv.total
