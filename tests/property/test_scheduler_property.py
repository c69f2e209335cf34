"""Random workloads through the scheduler loop against the slot-checking fake worker.

Whatever the mix (shared prefixes, chunking, tiny pools that force retraction and eviction,
aborts at random steps, page size, overlap schedule on or off), every request that is not
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
)
def test_random_workloads_are_token_exact(
    reqs, prefixes, page_size, pool, chunk, overlap, aborts, policy
):
    sched, _ = make(
        num_slots=pool,
        max_running=8,
        page_size=page_size,
        chunked_prefill_size=chunk,
        disable_overlap_schedule=not overlap,
        schedule_policy=policy,
    )
    want = {}
    for i, (p, tail, n) in enumerate(reqs):
        prompt = prefixes[p] + tail
        want[f"r{i}"] = expected(prompt, n)
        submit(sched, f"r{i}", prompt, n)
    plan = {step: f"r{i}" for i, step in aborts.items() if i < len(reqs)}

    def maybe_abort(step: int) -> None:
        if step in plan:
            sched.abort(plan[step], "test abort")

    got = run(sched, on_step=maybe_abort)
    for rid, d in got.items():
        if d.finish_reason == "abort" and rid in plan.values():
            assert list(d.token_ids) == want[rid][: len(d.token_ids)]  # a prefix of the truth
        else:
            assert (list(d.token_ids), d.finish_reason) == (want[rid], "length"), rid
    size = sched.kv.cache.size_info()
    assert size.protected == 0 and sched.kv.held_by_requests() == 0
    assert sched.kv.allocator.num_free + size.evictable == sched.kv.total
