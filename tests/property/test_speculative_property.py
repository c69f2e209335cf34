"""Random workloads with speculative decoding through the scheduler loop, against the
slot-checking fake worker.

Drafts come from an oracle that knows the fake model's continuation and corrupts it at
random (so every mix of full accepts, partial accepts and rejects happens), beside aborts
at random steps, tiny pools that force retraction (drafts dropped first, then requests
sent back) and eviction, chunked prefills, mixed batches, page sizes and the overlap
schedule (paused by verify steps) on or off. Every request that is not aborted gets
exactly the tokens the fake model gives its true sequence, and the idle integrity check
(run() makes it whenever the loop goes idle) proves that no slot leaked.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fake_worker import VOCAB, assert_pool_whole, make, next_token, run_arrivals
from tests.workload_strategies import CHUNKS, PAGE_SIZES, PREFIX_INDEX, PREFIXES, TAIL

request = st.tuples(
    PREFIX_INDEX,
    TAIL,
    st.integers(1, 24),  # max_tokens
    st.sampled_from([0, 0, 1, 3, 8]),  # the step it arrives at
)


def oracle(seed: int, wrong: float):
    rng = random.Random(seed)

    def draft(algorithm, index, namespace, seq_id, tokens, k) -> list[int]:
        seq, out = list(tokens), []
        for _ in range(rng.randrange(0, k + 1)):  # sometimes fewer drafts, or none
            t = next_token(seq)
            if rng.random() < wrong:
                t = (t + 1 + rng.randrange(VOCAB - 2)) % (VOCAB - 1)
            out.append(t)
            seq.append(t)
        return out

    return draft


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request, min_size=1, max_size=10),
    prefixes=PREFIXES,
    page_size=PAGE_SIZES,
    pool=st.integers(160, 600),
    chunk=CHUNKS,
    overlap=st.booleans(),
    aborts=st.dictionaries(st.integers(0, 9), st.integers(0, 30), max_size=3),
    mixed=st.sampled_from([0, 16, 256]),
    k=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    wrong=st.sampled_from([0.0, 0.1, 0.4, 1.0]),
)
def test_speculative_workloads_are_token_exact_and_leak_nothing(
    reqs, prefixes, page_size, pool, chunk, overlap, aborts, mixed, k, seed, wrong
):
    sched, _ = make(
        num_slots=pool,
        max_running=8,
        page_size=page_size,
        chunked_prefill_size=chunk,
        disable_overlap_schedule=not overlap,
        mixed_prefill_tokens=mixed,
        speculative_algorithm="ngram",
        speculative_num_draft_tokens=k,
        speculative_gate="always",  # every draft verified: the bookkeeping under test
    )
    sched.spec.draft_fn = oracle(seed, wrong)
    run_arrivals(sched, reqs, prefixes, aborts)
    sched.kv.check()
    assert_pool_whole(sched)
