"""The hierarchical cache over the three real processes (issue 36): prompts whose KV was
evicted from a small device pool come back from the host tier, token-exact with the
worker's offline greedy (itself exact with transformers, test_model_parity.py), reported
as cached, and counted as host -> device tokens, at page size 1 and 16."""

from __future__ import annotations

import time

import pytest

from radixserve.v1 import generation_pb2
from services.common.config import WorkerConfig
from tests.server_util import DEFAULT_MODEL, Server, greedy, scrape_metrics

pytestmark = pytest.mark.slow

ZEN = (
    "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than "
    "complex. Complex is better than complicated. Flat is better than nested."
)
# Eight prompts of ~60 tokens apart from their first words: together several times the pool.
PROMPTS = [f"Session {i} says: {ZEN}" for i in range(8)]


@pytest.fixture(scope="module")
def offline():
    from services.worker.model_runner import ModelRunner
    from services.worker.offline import generate

    runner = ModelRunner(
        WorkerConfig(model_path=str(DEFAULT_MODEL), device="cpu", max_total_tokens=4096)
    )
    return lambda prompts, n: generate(runner, prompts, n, stop_at_eos=False)


@pytest.mark.parametrize("page_size", [1, 16])
def test_evicted_prefixes_come_back_from_the_host_tier_token_exact(offline, page_size):
    flags = ("--max-total-tokens", "256", "--hicache-ratio", "8", "--page-size", str(page_size))
    with Server(*flags, metrics=True) as s:
        ids = [list(s.stub.Tokenize(generation_pb2.TokenizeRequest(text=p)).ids) for p in PROMPTS]
        want = offline(ids, 8)
        for round_ in range(2):
            for prompt, expect in zip(ids, want, strict=True):
                got, _, last = s.generate(
                    input_ids=generation_pb2.InputIds(ids=prompt),
                    sampling=greedy(8, ignore_eos=True),
                )
                assert got == expect, (round_, page_size)
                if round_:  # long gone from the 256-slot pool: back from the host tier
                    whole = (len(prompt) - 1) // page_size * page_size
                    assert last.cached_tokens == whole
                    d = last.cached_tokens_details
                    # The prompts' shared first words stay on the device.
                    assert d.device + d.host == whole and d.host >= whole - 16 and not d.storage
        m = scrape_metrics(s.sched_metrics)
    moved = m["radixserve:hicache_tokens_total"]
    assert moved > 0 and m["radixserve:hicache_host_total_tokens"] >= 2000


def test_a_new_engine_on_the_volume_serves_the_pages_token_exact(offline, tmp_path):
    """The storage tier: one engine writes its pages (write_through), then stops; another
    on the same directory, with empty device and host tiers, loads them instead of
    computing them."""
    flags = (
        "--max-total-tokens", "512", "--hicache-ratio", "4", "--hicache-write-policy",
        "write_through", "--hicache-storage-dir", str(tmp_path), "--hicache-storage-page-tokens",
        "16",
    )  # fmt: skip
    prompts = PROMPTS[:3]
    with Server(*flags) as s:
        ids = [list(s.stub.Tokenize(generation_pb2.TokenizeRequest(text=p)).ids) for p in prompts]
        want = offline(ids, 6)
        for prompt, expect in zip(ids, want, strict=True):
            got, _, last = s.generate(
                input_ids=generation_pb2.InputIds(ids=prompt), sampling=greedy(6, ignore_eos=True)
            )
            assert got == expect and last.cached_tokens < 16  # "Session " is shared
        pages = sum((len(p) - 1) // 16 for p in ids)
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("*/*.kv"))) < pages and time.monotonic() < deadline:
            time.sleep(0.1)  # the worker writes pages on a thread of its own
    with Server(*flags, metrics=True) as s:
        for prompt, expect in zip(ids, want, strict=True):
            got, _, last = s.generate(
                input_ids=generation_pb2.InputIds(ids=prompt), sampling=greedy(6, ignore_eos=True)
            )
            assert got == expect
            assert last.cached_tokens == (len(prompt) - 1) // 16 * 16
            d = last.cached_tokens_details  # the shared first words may be on the device
            assert d.device + d.storage == last.cached_tokens and d.storage >= 16 and not d.host
        moved = _tier_counts(s.sched_metrics)
        flushed = s.stub.FlushCache(generation_pb2.FlushCacheRequest(storage=True))
        assert flushed.flushed, flushed.message
        deadline = time.monotonic() + 30
        while list(tmp_path.glob("*/*.kv")) and time.monotonic() < deadline:
            time.sleep(0.1)  # deleted by the worker with its next batch
        assert not list(tmp_path.glob("*/*.kv"))
    assert moved["storage_to_host"] == pages * 16, moved


def _tier_counts(port: int) -> dict[str, float]:
    """radixserve:hicache_tokens_total by direction."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        s.labels["direction"]: s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
        if s.name == "radixserve:hicache_tokens_total"
    }
