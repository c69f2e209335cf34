"""n samples of one prompt over the three real processes: the prompt is computed once, the
samples are those of separate seeded requests token for token, and a cancel frees them all."""

from __future__ import annotations

import time

import pytest
from openai import OpenAI

from radixserve.v1 import generation_pb2 as pb
from tests.server_util import Server, scrape_metrics

pytestmark = pytest.mark.slow

PROMPT = "Zebras quantum purple seventeen, marmalade orbit, copper violin umbrella:"


@pytest.fixture(scope="module")
def server():
    with Server("--max-total-tokens", "8192", metrics=True) as s:
        yield s


def _sched(server: Server) -> dict[str, float]:
    return scrape_metrics(server.sched_metrics)


def _computed(m: dict[str, float]) -> float:
    return m["radixserve:prompt_tokens_total"] - m["radixserve:cached_tokens_total"]


def _idle(server: Server) -> None:
    """Nothing runs and no KV is held (the scheduler's idle check has passed by then)."""
    for _ in range(100):
        m = _sched(server)
        if m["radixserve:num_running_reqs"] == m["radixserve:kv_used_tokens"] == 0:
            if m["radixserve:num_queue_reqs"] == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"not idle: {m}")


def test_n_seeded_samples_equal_separate_requests_and_the_prompt_is_computed_once(server):
    n, seed = 8, 1234
    sp = pb.SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
    prompt = len(server.stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).ids)
    _idle(server)
    assert server.stub.FlushCache(pb.FlushCacheRequest()).flushed  # nothing cached before
    before = _sched(server)
    ids: dict[int, list[int]] = {i: [] for i in range(n)}
    finals = {}
    req = pb.GenerateRequest(text=PROMPT, sampling=sp, n=n)
    for msg in server.stub.Generate(req, timeout=120):
        ids[msg.index].extend(msg.token_ids)
        if msg.finish_reason:
            finals[msg.index] = msg
    after = _sched(server)
    # The prefill computed the prompt; each sample only its last token (its logits).
    assert _computed(after) - _computed(before) == prompt + n
    assert after["radixserve:cached_tokens_total"] - before["radixserve:cached_tokens_total"] == (
        n * (prompt - 1)
    )
    assert sorted(finals) == list(range(n))
    assert all(f.prompt_tokens == prompt and f.completion_tokens == 12 for f in finals.values())
    assert len({tuple(v) for v in ids.values()}) > 1  # temperature 1: they differ
    for i in range(n):
        alone = pb.SamplingParams()
        alone.CopyFrom(sp)
        alone.seed = seed + i
        got, _, _ = server.generate(text=PROMPT, sampling=alone)
        assert got == ids[i], i


def test_openai_stream_of_n_choices_with_their_indices(server):
    client = OpenAI(
        base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0
    )
    ask = dict(
        model=client.models.list().data[0].id,
        prompt=PROMPT,
        max_tokens=6,
        n=3,
        seed=5,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    stream = client.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    text = {0: "", 1: "", 2: ""}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            text[choice.index] += choice.text
        usage = chunk.usage or usage
    whole = client.completions.create(**ask)
    assert [whole.choices[i].text for i in range(3)] == [text[0], text[1], text[2]]
    assert usage is not None and usage.completion_tokens == 18


def test_cancelling_n_samples_frees_every_kv_slot(server):
    sp = pb.SamplingParams(max_tokens=400, temperature=1.0, ignore_eos=True)
    call = server.stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=sp, n=6), timeout=120)
    seen = set()
    for msg in call:
        seen.add(msg.index)
        if len(seen) == 6:
            break
    call.cancel()
    _idle(server)
    assert server.stub.FlushCache(pb.FlushCacheRequest()).flushed
    assert "idle engine still holds KV" not in server.output()
