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

from tests.fake_worker import assert_pool_whole, make, run_arrivals
from tests.workload_strategies import CHUNKS, PAGE_SIZES, PREFIX_INDEX, PREFIXES, TAIL

request = st.tuples(
    PREFIX_INDEX,
    TAIL,
    st.integers(1, 20),  # max_tokens
    st.sampled_from([0, 0, 1, 3, 8]),  # the step it arrives at
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request, min_size=1, max_size=12),
    prefixes=PREFIXES,
    page_size=PAGE_SIZES,
    pool=st.integers(160, 600),
    chunk=CHUNKS,
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
    run_arrivals(sched, reqs, prefixes, aborts)
    assert_pool_whole(sched)
