"""The hierarchical cache over the three real processes (issue 36): prompts whose KV was
evicted from a small device pool come back from the host tier, token-exact with the
worker's offline greedy (itself exact with transformers, test_model_parity.py), reported
as cached, and counted as host -> device tokens, at page size 1 and 16, with chunked
prefill and constrained decoding on."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from radixserve.v1 import generation_pb2
from services.common.config import WorkerConfig
from tests.server_util import (
    DEFAULT_MODEL,
    Server,
    greedy,
    scrape_metrics,
    serve_children,
)

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
    flags = (
        "--max-total-tokens", "256", "--hicache-ratio", "8", "--page-size", str(page_size),
        "--chunked-prefill-size", "32",
    )  # fmt: skip
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
        # Constrained decoding over a prefix that comes back from the host tier: the same
        # answer as when it was computed.
        regex = generation_pb2.SamplingParams(max_tokens=12, temperature=0, regex="[a-z ]{4,12}")
        answers = []
        for _ in range(2):
            answers.append(
                s.generate(input_ids=generation_pb2.InputIds(ids=ids[0]), sampling=regex)
            )
            for prompt in ids[1:]:  # pushes ids[0]'s KV out of the device pool
                s.generate(input_ids=generation_pb2.InputIds(ids=prompt), sampling=greedy(1))
        (cold, text, _), (warm, warm_text, last) = answers
        assert cold == warm and text == warm_text and last.cached_tokens_details.host > 0
        m = scrape_metrics(s.sched_metrics)
        w = scrape_metrics(s.metrics_port + 2)
    moved = m["radixserve:hicache_tokens_total"]
    assert moved > 0 and m["radixserve:hicache_host_total_tokens"] >= 2000
    # The worker's side of the same copies: bytes (k and v of every layer) and seconds.
    assert w["radixserve:hicache_copy_bytes_total"] > 0
    assert w["radixserve:hicache_copy_seconds_total"] > 0


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
        _kill_the_worker_during_loads(s, ids, want)
        flushed = s.stub.FlushCache(generation_pb2.FlushCacheRequest(storage=True))
        assert flushed.flushed, flushed.message
        deadline = time.monotonic() + 30
        while list(tmp_path.glob("*/*.kv")) and time.monotonic() < deadline:
            time.sleep(0.1)  # deleted by the worker with its next batch
        assert not list(tmp_path.glob("*/*.kv"))
    assert moved["storage_to_host"] == pages * 16, moved


def _kill_the_worker_during_loads(s: Server, ids: list[list[int]], want: list[list[int]]) -> None:
    """kill -9 of the worker while a burst of prompts loads from storage (after a flush,
    the device and host tiers hold none of them): the streams fail UNAVAILABLE or finish,
    and the restarted worker, its tiers empty, loads the pages again, token-exact."""
    assert s.stub.FlushCache(generation_pb2.FlushCacheRequest()).flushed
    worker = serve_children(s.proc.pid)["worker"]
    codes: list = []

    def one(prompt: list[int]) -> None:
        try:
            s.generate(
                input_ids=generation_pb2.InputIds(ids=prompt), sampling=greedy(96, ignore_eos=True)
            )
            codes.append(None)
        except grpc.RpcError as e:
            codes.append(e.code())

    burst = [threading.Thread(target=one, args=(p,)) for p in ids * 3]
    for t in burst:
        t.start()
    time.sleep(0.2)
    os.kill(worker, signal.SIGKILL)
    for t in burst:
        t.join(60)
    assert len(codes) == len(burst) and set(codes) <= {None, grpc.StatusCode.UNAVAILABLE}, codes
    assert grpc.StatusCode.UNAVAILABLE in codes  # it died while serving the burst
    deadline = time.monotonic() + 120
    while serve_children(s.proc.pid).get("worker", worker) == worker:
        assert time.monotonic() < deadline, s.output()
        time.sleep(0.2)
    for prompt, expect in zip(ids, want, strict=True):
        while True:
            try:
                got, _, last = s.generate(
                    input_ids=generation_pb2.InputIds(ids=prompt),
                    sampling=greedy(6, ignore_eos=True),
                )
                break
            except grpc.RpcError as e:  # the engine is still starting
                assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
                time.sleep(0.3)
        assert got == expect and last.cached_tokens_details.storage >= 16


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
