"""The worker's prompt logprobs against transformers (tiny random models, float32, CPU):
log_softmax of the reference logits within 1e-4 and top-n equal to torch.topk of them, in a
batch beside other requests, split into chunks, and on top of a cached prefix."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import load_hf_model
from test_model_parity import make_runner

from radixserve.internal.v1 import engine_pb2
from services.common.transport import pack_i32
from services.worker import wire

TOP = 5


@pytest.fixture(scope="module")
def runner_and_ref(tiny_llama_dir):
    return make_runner(tiny_llama_dir), load_hf_model(tiny_llama_dir)


def ref_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def chunk(
    slot: int,
    ids: list[int],
    start: int,
    end: int,
    kv: list[int],
    score_from: int | None,
    *,
    new: bool,
    prefix_kv: list[int] | None = None,
) -> engine_pb2.ForwardRequest:
    """The chunk [start, end) of ids; scores prompt positions from score_from on (None: none)."""
    r = engine_pb2.ForwardRequest(
        req_slot=slot,
        input_ids=pack_i32(ids[start:end]),
        prefix_len=start,
        out_slots=pack_i32(kv[start:end]),
        sample=end == len(ids),
    )
    if new:
        r.is_new = True
        r.prefix_slots = pack_i32((prefix_kv or kv)[:start])
        r.sampling.CopyFrom(engine_pb2.SamplingParams(temperature=0.0))
    if score_from is not None:
        lo, hi = max(score_from, start + 1), min(end + 1, len(ids))
        if lo < hi:
            r.prompt_logprob_row = lo - start - 1
            r.prompt_logprob_targets = pack_i32(ids[lo:hi])
            r.prompt_top_logprobs = TOP
    return r


def run(runner, reqs: list[engine_pb2.ForwardRequest]) -> engine_pb2.ForwardResult:
    result = wire.forward(runner, engine_pb2.ForwardBatch(batch_id=1, reqs=reqs))
    assert not result.error, result.error
    return result


def assert_parity(entries, ref: torch.Tensor, ids: list[int], first: int) -> None:
    assert [e.token_id for e in entries] == ids[first:]
    for k, e in enumerate(entries):
        row = ref[first + k - 1]  # the logits before position first + k
        assert e.logprob == pytest.approx(row[ids[first + k]].item(), abs=1e-4)
        best = row.topk(TOP)
        assert [t.token_id for t in e.top] == best.indices.tolist()
        got = torch.tensor([t.logprob for t in e.top])
        torch.testing.assert_close(got, best.values, atol=1e-4, rtol=0)


def test_whole_prompt_in_a_mixed_batch(runner_and_ref):
    runner, hf = runner_and_ref
    a, b, c = prompt(37, 1), prompt(12, 2), prompt(20, 3)
    kv_a, kv_b, kv_c = (list(range(s, s + 64)) for s in (1, 101, 201))
    result = run(
        runner,
        [
            chunk(0, a, 0, len(a), kv_a, 0, new=True),
            chunk(1, b, 0, len(b), kv_b, None, new=True),  # asks nothing: its rows stay unscored
            chunk(2, c, 0, len(c), kv_c, 7, new=True),
        ],
    )
    assert_parity(result.tokens[0].prompt_logprobs, ref_logprobs(hf, a), a, 1)
    assert not result.tokens[1].prompt_logprobs
    assert_parity(result.tokens[2].prompt_logprobs, ref_logprobs(hf, c), c, 7)
    assert result.tokens[0].token_id == int(ref_logprobs(hf, a)[-1].argmax())


@pytest.mark.parametrize("size", [5, 16])
def test_chunked_prefill_stitches_to_the_reference(runner_and_ref, size):
    runner, hf = runner_and_ref
    ids = prompt(45, 4)
    kv = list(range(400, 460))
    entries = []
    for start in range(0, len(ids), size):
        end = min(start + size, len(ids))
        result = run(runner, [chunk(3, ids, start, end, kv, 2, new=start == 0)])
        entries += list(result.tokens[0].prompt_logprobs)
    assert_parity(entries, ref_logprobs(hf, ids), ids, 2)


def test_scoring_on_top_of_a_cached_prefix(runner_and_ref):
    runner, hf = runner_and_ref
    shared, tail = prompt(24, 5), prompt(10, 6)
    kv = list(range(600, 640))
    run(runner, [chunk(4, shared, 0, len(shared), kv, None, new=True)])
    ids = shared + tail
    # Another request reuses the KV of shared[:20] and scores from position 21.
    kv2 = kv[:20] + list(range(700, 720))
    result = run(runner, [chunk(5, ids, 20, len(ids), kv2, 21, new=True)])
    assert_parity(result.tokens[0].prompt_logprobs, ref_logprobs(hf, ids), ids, 21)


def test_rows_outside_the_chunk_are_refused(runner_and_ref):
    runner, _ = runner_and_ref
    ids = prompt(8, 7)
    r = chunk(6, ids, 0, len(ids), list(range(800, 810)), None, new=True)
    r.prompt_logprob_row = 3
    r.prompt_logprob_targets = pack_i32(ids[:6])  # rows 3 .. 8 of 8
    with pytest.raises(ValueError, match="prompt logprob rows"):
        wire.decode_batch(engine_pb2.ForwardBatch(reqs=[r]), wire.Limits.of(runner.info()))
