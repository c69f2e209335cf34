"""Two engines sharing the storage tier through a real redis-server (issue 37): what engine
A computed, engine B, running beside it with empty device and host tiers, loads from the
server instead of computing, token-exact with the worker's offline greedy, and reports as
cached from storage. The server's password comes by environment, as a chart's Secret
gives it."""

from __future__ import annotations

import time

import pytest

from radixserve.v1 import generation_pb2
from services.common.config import WorkerConfig
from tests.redis_util import RedisServer
from tests.server_util import DEFAULT_MODEL, Server, greedy

pytestmark = pytest.mark.slow

ZEN = (
    "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than "
    "complex. Complex is better than complicated. Flat is better than nested."
)
PROMPTS = [f"Session {i} says: {ZEN}" for i in range(3)]
PAGE = 16
PASSWORD = "e2e-secret"


def _pages(server: RedisServer) -> int:
    with server.client() as c:
        return sum(1 for _ in c.scan_iter(match=b"radixserve:kv:*", count=1000))


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)


def test_an_engine_loads_the_pages_another_engine_computed(tmp_path):
    from services.worker.model_runner import ModelRunner
    from services.worker.offline import generate

    with RedisServer(tmp_path, password=PASSWORD) as store:
        flags = (
            "--max-total-tokens", "512", "--hicache-ratio", "4", "--hicache-write-policy",
            "write_through", "--hicache-storage-url", store.url,
            "--hicache-storage-page-tokens", str(PAGE),
        )  # fmt: skip
        env = {"RADIXSERVE_HICACHE_STORAGE_PASSWORD": PASSWORD}
        with Server(*flags, env=env) as a:
            ids = [
                list(a.stub.Tokenize(generation_pb2.TokenizeRequest(text=p)).ids) for p in PROMPTS
            ]
            runner = ModelRunner(
                WorkerConfig(model_path=str(DEFAULT_MODEL), device="cpu", max_total_tokens=4096)
            )
            want = generate(runner, ids, 6, stop_at_eos=False)
            for prompt, expect in zip(ids, want, strict=True):
                got, _, last = a.generate(
                    input_ids=generation_pb2.InputIds(ids=prompt),
                    sampling=greedy(6, ignore_eos=True),
                )
                assert got == expect and last.cached_tokens < PAGE  # "Session " is shared
            pages = sum((len(p) - 1) // PAGE for p in ids)
            _wait_for(lambda: _pages(store) >= pages)  # written on the worker's own thread
            assert _pages(store) >= pages  # (and pages ending in the outputs)

            with Server(*flags, env=env) as b:  # beside A, sharing nothing but the server
                for prompt, expect in zip(ids, want, strict=True):
                    got, _, last = b.generate(
                        input_ids=generation_pb2.InputIds(ids=prompt),
                        sampling=greedy(6, ignore_eos=True),
                    )
                    assert got == expect
                    assert last.cached_tokens == (len(prompt) - 1) // PAGE * PAGE
                    d = last.cached_tokens_details  # the shared first words may be on the device
                    assert d.device + d.storage == last.cached_tokens
                    assert d.storage >= PAGE and not d.host
                flushed = b.stub.FlushCache(generation_pb2.FlushCacheRequest(storage=True))
                assert flushed.flushed, flushed.message
                _wait_for(lambda: _pages(store) == 0)  # deleted by B's worker, next batch
                assert _pages(store) == 0
                assert "e2e-secret" not in b.output()
