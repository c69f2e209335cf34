"""Random workloads with prompt logprobs and max_tokens 0 through the scheduler loop,
against the slot-checking fake worker (which scores prompt rows from the KV it reads back).

Whatever the mix (shared prefixes already cached, chunking, tiny pools that force retraction
and eviction, aborts, mixed batches, page size, overlap schedule), every request that is
not aborted gets exactly the true tokens and, when it asked, exactly the true prompt
logprobs from max(start, 1) on, once, on its first delta; an idle engine holds no KV beyond
its evictable cache.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.internal.v1 import engine_pb2
from services.common.transport import pack_i32
from tests.fake_worker import FRONTEND, assert_pool_whole, expected, expected_prompt_logprobs, make
from tests.workload_strategies import CHUNKS, PAGE_SIZES, PREFIX_INDEX, PREFIXES, TAIL

request = st.tuples(
    PREFIX_INDEX,
    TAIL,
    st.sampled_from([0, 0, 1, 5, 20]),  # max_tokens
    st.one_of(st.none(), st.integers(0, 60)),  # prompt logprobs from (None: not asked)
)


def submit(sched, rid: str, prompt: list[int], max_tokens: int, start: int | None) -> None:
    sp = engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0)
    if start is not None:
        sp.prompt_logprobs, sp.prompt_logprobs_start = True, min(start, len(prompt) - 1)
    msg = engine_pb2.TokenizedRequest(rid=rid, input_ids=pack_i32(prompt), sampling=sp)
    sched.add_request(FRONTEND, msg)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request, min_size=1, max_size=10),
    prefixes=PREFIXES,
    page_size=PAGE_SIZES,
    pool=st.integers(200, 600),
    chunk=CHUNKS,
    overlap=st.booleans(),
    mixed=st.sampled_from([0, 16]),
    warm=st.booleans(),
    aborts=st.dictionaries(st.integers(0, 9), st.integers(0, 20), max_size=2),
)
def test_prompt_logprobs_are_exact_under_any_schedule(
    reqs, prefixes, page_size, pool, chunk, overlap, mixed, warm, aborts
):
    sched, _ = make(
        num_slots=pool,
        max_running=8,
        page_size=page_size,
        chunked_prefill_size=chunk,
        disable_overlap_schedule=not overlap,
        mixed_prefill_tokens=mixed,
    )
    if warm:  # the shared prefixes are in the tree before anyone asks for their logprobs
        for j, p in enumerate(prefixes):
            if len(p) > 1:
                submit(sched, f"warm{j}", p, 1, None)
    want = {}
    for i, (p, tail, n, start) in enumerate(reqs):
        prompt = prefixes[p] + tail
        want[f"r{i}"] = (prompt, n, start)
        submit(sched, f"r{i}", prompt, n, start)
    plan = {step: f"r{i}" for i, step in aborts.items() if i < len(reqs)}

    deltas: dict[str, list[engine_pb2.TokenDelta]] = {}
    for step in range(100_000):
        worked = sched.step()
        for batch in sched.outbox.take().values():
            for d in batch:
                deltas.setdefault(d.rid, []).append(d)
        if step in plan:
            sched.abort(plan[step], "test abort")
        if not worked:
            sched.check_idle()
            break

    for rid, (prompt, n, start) in want.items():
        got = deltas[rid]
        toks = [t for d in got for t in d.token_ids]
        carrying = [k for k, d in enumerate(got) if d.prompt_logprobs_start]
        if got[-1].finish_reason == "abort":
            assert rid in plan.values()
            assert toks == expected(prompt, n)[: len(toks)]
            assert carrying in ([], [0])
            continue
        assert (toks, got[-1].finish_reason) == (expected(prompt, n), "length"), rid
        if start is None:
            assert carrying == []
            continue
        assert carrying == [0], rid
        s = min(start, len(prompt) - 1)
        assert got[0].prompt_logprobs_start == max(s, 1)
        entries = [(lp.token_id, lp.logprob) for lp in got[0].prompt_logprobs]
        want_lps = expected_prompt_logprobs(prompt, s)
        assert entries == [(t, pytest.approx(lp, abs=1e-6)) for t, lp in want_lps], rid
    assert_pool_whole(sched)
