"""End to end over the three real processes on loopback: streaming, batching, cancel, retraction."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from radixserve.v1 import generation_pb2
from services.common.config import WorkerConfig
from tests.server_util import (
    DEFAULT_MODEL,
    REPO,
    Server,
    common_prefix,
    greedy,
    idle_pool_is_whole,
    scrape_metrics,
)

pytestmark = pytest.mark.slow

PROMPTS = [
    "Beautiful is better than",
    "Explicit is",
    "Simple is better than complex. Complex is better",
    "Readability",
    "There should be one-- and preferably only one --obvious way",
    "Now is better than never. Although never is often better than",
    "If the implementation is hard to explain,",
    "Namespaces are one honking great idea",
]


@pytest.fixture(scope="module")
def offline():
    """Greedy tokens from the worker's ModelRunner called in-process (no scheduler, no sockets)."""
    from services.worker.model_runner import ModelRunner
    from services.worker.offline import generate

    runner = ModelRunner(
        WorkerConfig(
            model_path=str(DEFAULT_MODEL),
            device="cpu",
            max_total_tokens=8192,
            max_running_requests=16,
        )
    )

    def run(prompts: list[list[int]], max_tokens: int, stop_at_eos: bool = True) -> list[list[int]]:
        return generate(runner, prompts, max_tokens, stop_at_eos=stop_at_eos)

    return run


@pytest.fixture(scope="module")
def server():
    with Server("--max-total-tokens", "20000", "--max-running-requests", "64", metrics=True) as s:
        yield s


def tokenize(server: Server, text: str) -> list[int]:
    return list(server.stub.Tokenize(generation_pb2.TokenizeRequest(text=text)).ids)


@pytest.mark.parametrize("flags", [(), ("--disable-radix-cache",)], ids=["cache", "no-cache"])
def test_streaming_matches_offline_greedy(offline, flags):
    with Server(*flags, "--max-total-tokens", "8192") as s:
        ids = [tokenize(s, p) for p in PROMPTS]
        want = offline(ids, 24)
        for round_ in range(2):  # the second round hits the cache (when enabled)
            for prompt, expect in zip(ids, want, strict=True):
                got, _, last = s.generate(
                    input_ids=generation_pb2.InputIds(ids=prompt), sampling=greedy(24)
                )
                assert got == expect
                assert last.completion_tokens == len(expect)
                if flags:
                    assert last.cached_tokens == 0
                elif round_ == 1:
                    assert last.cached_tokens == len(prompt) - 1


def test_64_concurrent_streams_then_pool_is_whole(server, offline):
    texts = [PROMPTS[i % len(PROMPTS)] + " " * (i % 3) for i in range(64)]
    ids = [tokenize(server, t) for t in texts]
    lengths = [4 + (i * 7) % 40 for i in range(64)]

    def one(i: int) -> list[int]:
        return server.generate(
            input_ids=generation_pb2.InputIds(ids=ids[i]), sampling=greedy(lengths[i])
        )[0]

    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(one, range(64)))
    uniq = {tuple(x) for x in ids}
    want = {tuple(p): w for p, w in zip(uniq, offline([list(p) for p in uniq], 44), strict=True)}
    for i in range(64):
        assert got[i] == want[tuple(ids[i])][: len(got[i])]
        stopped_early = len(got[i]) < lengths[i]
        assert len(got[i]) == lengths[i] or stopped_early
    idle_pool_is_whole(server, 5)


def test_cancel_half_way_frees_slots(server):
    call = server.stub.Generate(
        generation_pb2.GenerateRequest(
            text="Cancel me half-way.", sampling=greedy(400, ignore_eos=True)
        ),
        timeout=60,
    )
    got = 0
    for msg in call:
        got += len(msg.token_ids)
        if got >= 5:
            call.cancel()
            break
    time.sleep(0.1)
    idle_pool_is_whole(server, 5)
    m = scrape_metrics(server.sched_metrics)
    assert m["radixserve:num_running_reqs"] == 0


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"text": ""}, "text"),
        ({"text": "x", "sampling": generation_pb2.SamplingParams(max_tokens=-1)}, "max_tokens"),
        ({"text": "x", "sampling": generation_pb2.SamplingParams(temperature=-1)}, "temperature"),
        ({"text": "x", "sampling": generation_pb2.SamplingParams(top_p=1.5)}, "top_p"),
        ({"input_ids": generation_pb2.InputIds(ids=[10**7])}, "input_ids"),
        ({"text": "x", "sampling": generation_pb2.SamplingParams(max_tokens=10**6)}, "max_tokens"),
    ],
)
def test_bad_input_is_rejected_and_server_keeps_serving(server, kw, field):
    with pytest.raises(grpc.RpcError) as err:
        server.generate(**kw)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    ids, _, last = server.generate(text="Beautiful is", sampling=greedy(3))
    assert last.finish_reason in ("length", "stop") and ids


def test_small_pool_forces_retraction_and_tokens_stay_right(offline):
    ids_text = [PROMPTS[i] for i in range(6)]
    # 6 x (prompt + 100) tokens of KV against a 256-slot pool: retraction is certain once
    # three run together. Two fit to the end, and a loaded machine can spread the arrivals
    # so far that the third comes too late to be admitted: the burst then runs again.
    with Server("--max-total-tokens", "256", "--chunked-prefill-size", "32", metrics=True) as s:
        ids = [tokenize(s, t) for t in ids_text]
        want = offline(ids, 100, stop_at_eos=False)
        for _ in range(3):
            with ThreadPoolExecutor(6) as pool:
                got = list(
                    pool.map(
                        lambda p: s.generate(
                            input_ids=generation_pb2.InputIds(ids=p),
                            sampling=greedy(100, ignore_eos=True),
                        )[0],
                        ids,
                    )
                )
            assert got == want
            if "Retract requests" in s.output():
                break
        assert "Retract requests" in s.output()
        idle_pool_is_whole(s, 5)


def test_cached_tokens_is_what_the_cache_reused(server):
    assert server.stub.FlushCache(generation_pb2.FlushCacheRequest()).flushed
    text_a = "Errors should never pass silently. Unless explicitly silenced."
    text_b = text_a + " In the face of ambiguity"
    prompt_a, prompt_b = tokenize(server, text_a), tokenize(server, text_b)
    before = scrape_metrics(server.sched_metrics)
    out_a, _, a = server.generate(text=text_a, sampling=greedy(4))
    _, _, b = server.generate(text=text_b, sampling=greedy(4))
    after = scrape_metrics(server.sched_metrics)
    reused = after["radixserve:cached_tokens_total"] - before["radixserve:cached_tokens_total"]
    assert a.cached_tokens == 0 and b.cached_tokens == reused
    # The tree holds a's prompt and output but its last token (which never got KV).
    in_tree = prompt_a + out_a[:-1]
    assert b.cached_tokens == min(common_prefix(in_tree, prompt_b), len(prompt_b) - 1)


def test_two_servers_side_by_side_and_generate_cli():
    with Server() as a, Server() as b:
        ta = a.generate(text="Beautiful is better than", sampling=greedy(6))[1]
        tb = b.generate(text="Beautiful is better than", sampling=greedy(6))[1]
        assert ta == tb and ta
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cli",
                "generate",
                "Beautiful is better than",
                "--target",
                a.addr,
                "--max-tokens",
                "6",
                "--temperature",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().startswith(ta.strip())


def _children(pid: int) -> dict[int, str]:
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                cmd = (stat.parent / "cmdline").read_bytes().split(b"\0")
                out[int(stat.parent.name)] = " ".join(c.decode() for c in cmd)
        except (OSError, IndexError, ValueError):
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


def test_supervisor_stops_all_when_one_dies():
    s = Server("--on-child-exit", "stop")  # the old behaviour (restarts: test_faults.py)
    try:
        kids = _children(s.proc.pid)
        worker = next(p for p, cmd in kids.items() if " worker " in cmd)
        os.kill(worker, signal.SIGKILL)
        s.proc.wait(30)
        assert s.proc.returncode == 1
        assert "the worker process was killed by signal 9" in s.output()
        time.sleep(0.5)
        assert not [p for p in kids if _alive(p)]
    finally:
        s.close()


def test_ctrl_c_stops_everything():
    s = Server()
    kids = _children(s.proc.pid)
    s.proc.send_signal(signal.SIGINT)
    s.proc.wait(30)
    time.sleep(0.5)
    alive = [p for p in kids if _alive(p)]
    s.close()
    assert len(kids) == 3 and not alive


def test_non_streaming_http_clients_that_hang_up_free_their_kv(server):
    """32 non-streaming clients ask for 500 tokens each and disconnect after 1 s: every
    request is aborted (nothing left running within a few seconds) and the pool is whole."""
    import httpx

    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    model = httpx.get(f"http://127.0.0.1:{server.http_port}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "Now is better than", "max_tokens": 500, "ignore_eos": True}

    async def hang_up() -> None:
        async with httpx.AsyncClient(timeout=1.0) as client:
            with contextlib.suppress(httpx.TimeoutException):
                await client.post(url, json=body)

    async def all_of_them() -> None:
        await asyncio.gather(*(hang_up() for _ in range(32)))

    asyncio.run(all_of_them())
    deadline = time.monotonic() + 10
    while scrape_metrics(server.sched_metrics)["radixserve:num_running_reqs"] > 0:
        assert time.monotonic() < deadline, "disconnected requests kept generating"
        time.sleep(0.1)
    idle_pool_is_whole(server, 5)
