"""The five experiments of shared/SEED-EXPERIMENTS.md, end to end over the three real processes.

Token counts depend on the tokenizer, so every check is a relation: cached(X) is what the
server reports for X, common(X, Y) the common prefix of their token ids (from Tokenize).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from radixserve.v1 import generation_pb2
from tests.server_util import BackgroundStream, Server, common_prefix, greedy, scrape_metrics

pytestmark = pytest.mark.slow


class Client:
    def __init__(self, server: Server, metrics_port: int | None = None):
        self.server = server
        self.metrics_port = metrics_port

    def ids(self, text: str) -> list[int]:
        return list(self.server.stub.Tokenize(generation_pb2.TokenizeRequest(text=text)).ids)

    def run(self, max_tokens: int = 1, **kw) -> generation_pb2.GenerateResponse:
        return self.server.generate(sampling=greedy(max_tokens), **kw)[2]

    def flush(self) -> generation_pb2.FlushCacheResponse:
        return self.server.stub.FlushCache(generation_pb2.FlushCacheRequest())

    def fresh(self) -> None:
        """Flushes once the engine is idle (a cancel from the test before may still be landing)."""
        deadline = time.monotonic() + 10
        while not (reply := self.flush()).flushed:
            assert time.monotonic() < deadline, reply.message
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.metrics_port)


@pytest.fixture(scope="module")
def p1():
    with Server("--enable-mfu-metrics", "--max-total-tokens", "60000", metrics=True) as s:
        client = Client(s, s.sched_metrics)
        yield client
        client.fresh()  # idle at the end: flush is accepted


@pytest.fixture(scope="module")
def p16():
    with Server("--page-size", "16", "--max-total-tokens", "60000") as s:
        yield Client(s)


def test_1_the_tree_grows_branches(p1):
    p1.fresh()
    P = " Zephyr audit note zf732150a: the operator shall keep every record."
    A = P + " Question one: how long is the period?"
    B = P + " Request two: who may open the archive?"
    C = A + " Answer in one word."
    a, b, c = (p1.ids(x) for x in (A, B, C))
    assert p1.run(text=A).cached_tokens == 0
    cached_b = p1.run(text=B).cached_tokens
    cached_c = p1.run(text=C).cached_tokens
    assert cached_b == common_prefix(a, b)
    assert cached_c == common_prefix(a, c)
    assert cached_c > cached_b


def _pair(client: Client, n: int, marker: str) -> tuple[list[int], list[int]]:
    """Two prompts sharing marker + n repeats, differing only in their last token."""
    first = client.ids(f"{marker}" + " archive" * n + " end")
    second = first[:-1] + [(first[-1] + 1) % 200 + 10]
    return first, second


@pytest.mark.parametrize("n", [0, 2, 7, 20])
def test_2_any_shared_length_is_reused(p1, p16, n):
    rows = []
    for page, client in ((1, p1), (16, p16)):
        first, second = _pair(client, n, f"Marker {n}-{page} q{n * 7 + page}:")
        client.run(input_ids=generation_pb2.InputIds(ids=first))
        hit = client.run(input_ids=generation_pb2.InputIds(ids=second)).cached_tokens
        shared = common_prefix(first, second)
        assert shared == len(second) - 1
        want = shared if page == 1 else 16 * (shared // 16)
        assert hit == want, f"page size {page}, N={n}: hit {hit}, want {want}"
        rows.append((page, len(second), shared, hit))
    print(
        f"\nN={n}: "
        + "; ".join(f"page {p}: prompt {L}, shared {s}, hit {h}" for p, L, s, h in rows)
    )


def test_3_the_cache_outlives_the_request(p1):
    p1.fresh()
    text = "The cache outlives the request: a prompt sent twice, five seconds apart, hits."
    prompt = len(p1.ids(text))
    before = p1.metrics()
    first = p1.run(max_tokens=1, text=text)
    time.sleep(2.0)
    second = p1.run(max_tokens=1, text=text)
    after = p1.metrics()
    assert first.cached_tokens == 0 and second.cached_tokens == prompt - 1
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["radixserve:prompt_tokens_total"] == 2 * prompt
    assert delta["radixserve:cached_tokens_total"] == prompt - 1
    # Greedy: both requests leave the same prompt + 0 decoded tokens of KV (max_tokens 1).
    assert delta["radixserve:kv_evictable_tokens"] == prompt
    assert delta["radixserve:kv_available_tokens"] == -prompt
    assert after["radixserve:cache_hit_rate"] == pytest.approx((prompt - 1) / prompt)


def test_4_flush_removes_hits_and_is_refused_while_busy(p1):
    p1.fresh()
    text = "Flushing the tree removes the hits; every token is computed again."
    prompt = len(p1.ids(text))
    p1.run(text=text)
    assert p1.run(text=text).cached_tokens == prompt - 1
    p1.fresh()
    assert p1.run(text=text).cached_tokens == 0

    stream = BackgroundStream(p1.server)
    assert stream.started.wait(60)
    refused = p1.flush()
    stream.stop()
    assert not refused.flushed
    assert "running" in refused.message and "1 request(s) running" in refused.message


def test_5_hits_save_compute(p1):
    # ~150 tokens: at this size (hidden 192) attention adds little to the linear FLOPs, as for
    # the published 7B model; bench/seed_experiments.py reports the full-size breakdown.
    prefix = " ".join(f"rule{i} keep the record" for i in range(9))
    groups = {
        "shared": [f"{prefix} question {i}?" for i in range(20)],
        "distinct": [f"{i} {prefix} question {i}?" for i in range(20)],
    }
    out = {}
    for name, prompts in groups.items():
        p1.fresh()
        before = p1.metrics()
        with ThreadPoolExecutor(len(prompts)) as pool:
            finals = list(pool.map(lambda t: p1.run(text=t), prompts))
        after = p1.metrics()
        prompt = sum(f.prompt_tokens for f in finals)
        cached = sum(f.cached_tokens for f in finals)
        flops = after["radixserve:estimated_flops_total"] - before.get(
            "radixserve:estimated_flops_total", 0.0
        )
        out[name] = (cached / prompt, prompt - cached, flops)
    hit, computed, flops = out["shared"]
    assert hit > 0.9, out
    assert out["distinct"][0] < 0.1, out
    num_params = _num_parameters(p1)
    assert flops == pytest.approx(2 * num_params * computed, rel=0.10), (
        flops,
        num_params,
        computed,
    )


def _num_parameters(client: Client) -> int:
    from safetensors import safe_open

    from tests.server_util import DEFAULT_MODEL

    total = 0
    with safe_open(str(DEFAULT_MODEL / "model.safetensors"), "pt") as f:
        for k in f.keys():
            total += _prod(f.get_slice(k).get_shape())
    return total


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
