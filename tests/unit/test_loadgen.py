"""`radixserve bench` against a fake OpenAI streaming server whose every figure is known.

The fake (FastAPI on uvicorn in a thread, loopback, free port) counts prompt tokens as
words, reports as cached the longest word prefix shared with any earlier prompt, sleeps a
fixed time before the first token and between tokens, and fails chosen requests (by
arrival order) with an HTTP error or an error event mid-stream. The client's figures must
match what the fake recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.config import DEFAULT_MODEL_PATH
from services.loadgen import workloads
from services.loadgen.serving import (
    Result,
    ServerError,
    StreamReader,
    add_bench_args,
    benchmark,
    run_bench,
)

FIRST_S, STEP_S = 0.15, 0.02


@dataclass
class Seen:
    """What the fake server was sent and answered, in arrival order."""

    bodies: list[dict] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    first_sent: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    answers: dict[int, str] = field(default_factory=dict)


def _common_words(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _chunk(text: str, finish: str | None = None, usage: dict | None = None) -> str:
    choices = [] if usage else [{"index": 0, "text": text, "finish_reason": finish}]
    return (
        "data: "
        + json.dumps({"object": "text_completion", "choices": choices, "usage": usage})
        + "\n\n"
    )


def fake_app(seen: Seen, http_fail: set[int], stream_fail: set[int], usage: bool = True) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        i = len(seen.bodies)
        seen.bodies.append(body)
        seen.arrivals.append(time.perf_counter())
        seen.first_sent.append(0.0)
        if i in http_fail:
            return JSONResponse(
                {"error": {"message": f"boom {i}", "type": "server_error"}}, status_code=500
            )
        words = body["prompt"].split()
        cached = max(
            (_common_words(words, b["prompt"].split()) for b in seen.bodies[:i]), default=0
        )
        seen.prompt_tokens.append(len(words))
        seen.cached.append(cached)
        return StreamingResponse(
            _stream(seen, i, body, cached, i in stream_fail, usage), media_type="text/event-stream"
        )

    return app


async def _stream(seen: Seen, i: int, body: dict, cached: int, fail: bool, usage: bool):
    n, words = body["max_tokens"], len(body["prompt"].split())
    answer = []
    for k in range(n):
        await asyncio.sleep(FIRST_S if k == 0 else STEP_S)
        if k == 0:
            seen.first_sent[i] = time.perf_counter()
        if fail and k == 1:
            yield "data: " + json.dumps({"error": {"message": f"stream broke {i}"}}) + "\n\n"
            return
        answer.append(f" t{k}")
        yield _chunk(answer[-1], "length" if k == n - 1 else None)
    seen.answers[i] = "".join(answer)
    if usage and body.get("stream_options", {}).get("include_usage"):
        u = {
            "prompt_tokens": words,
            "completion_tokens": n,
            "total_tokens": words + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        yield _chunk("", usage=u)
    yield "data: [DONE]\n\n"


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def args(base_url: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return parser.parse_args(["--base-url", base_url, "--disable-tqdm", *extra])


def run(
    extra: list[str],
    http_fail: Iterable[int] = (),
    stream_fail: Iterable[int] = (),
    usage: bool = True,
) -> tuple[dict, Seen]:
    seen = Seen()
    with serve(fake_app(seen, set(http_fail), set(stream_fail), usage)) as url:
        return benchmark(args(url, *extra)), seen


def test_shared_prefix_counts_tokens_and_hit_rate_as_the_server_reported():
    rep, seen = run(
        [
            "--workload",
            "shared-prefix",
            "--num-prompts",
            "6",
            "--prefix-len",
            "40",
            "--input-len",
            "5",
            "--output-len",
            "3",
            "--max-concurrency",
            "1",
            "--ignore-eos",
        ]
    )
    assert rep["model"] == "fake-model" and rep["completed"] == 6 and rep["errors"] == 0
    assert rep["input_tokens"] == sum(seen.prompt_tokens)
    assert rep["output_tokens"] == 6 * 3
    assert rep["cached_tokens"] == sum(seen.cached) >= 5 * 40
    assert rep["cache_hit_rate"] == pytest.approx(sum(seen.cached) / sum(seen.prompt_tokens))
    assert all(
        b["ignore_eos"] is True and b["temperature"] == 0.0 and b["stream"] for b in seen.bodies
    )
    assert all(b["stream_options"] == {"include_usage": True} for b in seen.bodies)
    prefixes = {tuple(b["prompt"].split()[:40]) for b in seen.bodies}
    assert len(prefixes) == 1 and len({b["prompt"] for b in seen.bodies}) == 6


def test_latency_figures_follow_the_servers_timing():
    rep, _ = run(
        ["--workload", "distinct", "--num-prompts", "4", "--input-len", "10", "--output-len", "5"]
    )
    ttft, itl, e2e = rep["ttft_ms"], rep["itl_ms"], rep["e2e_latency_ms"]
    # The upper bound leaves room for a loaded 2-core machine (736 ms seen in a full suite).
    assert FIRST_S * 1000 * 0.95 <= ttft["p50"] < FIRST_S * 1000 * 8
    assert STEP_S * 1000 * 0.8 <= itl["p50"] < FIRST_S * 1000
    assert ttft["p50"] <= ttft["p90"] <= ttft["p99"] <= ttft["max"]
    assert e2e["p50"] >= ttft["p50"] + 4 * itl["p50"] * 0.9
    assert rep["tpot_ms"]["p50"] == pytest.approx(itl["p50"], rel=0.5)
    assert rep["output_throughput"] == pytest.approx(rep["output_tokens"] / rep["wall_s"])
    assert rep["wall_s"] < 4 * (FIRST_S + 4 * STEP_S) + 2  # all four at once, not one after another


def test_errors_are_counted_not_raised():
    rep, seen = run(
        [
            "--workload",
            "distinct",
            "--num-prompts",
            "5",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--max-concurrency",
            "1",
        ],
        http_fail={1},
        stream_fail={3},
    )
    assert rep["requests"] == 5 and rep["completed"] == 3 and rep["errors"] == 2
    assert rep["output_tokens"] == 3 * 3
    assert rep["input_tokens"] == sum(
        n for i, n in enumerate(seen.prompt_tokens) if i != 2
    )  # entry 2 is request 3 (request 1 got none)
    msgs = " ".join(rep["error_messages"])
    assert "HTTP 500: boom 1" in msgs and "stream broke 3" in msgs


def test_unreachable_server_is_reported_not_raised(capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    assert run_bench(args(f"http://127.0.0.1:{port}", "--num-prompts", "1")) == 2
    assert "cannot reach" in capsys.readouterr().out


def test_without_usage_counts_fall_back_to_chunks_and_words():
    rep, seen = run(
        ["--workload", "distinct", "--num-prompts", "3", "--input-len", "12", "--output-len", "4"],
        usage=False,
    )
    assert rep["completed"] == 3 and rep["output_tokens"] == 12
    assert rep["input_tokens"] == sum(seen.prompt_tokens) == 36
    assert rep["cache_hit_rate"] is None and rep["cached_tokens"] is None


def test_multi_turn_resends_history_and_answer():
    rep, seen = run(
        [
            "--workload",
            "multi-turn",
            "--num-prompts",
            "2",
            "--num-turns",
            "3",
            "--input-len",
            "6",
            "--output-len",
            "2",
            "--max-concurrency",
            "1",
        ]
    )
    assert rep["requests"] == 6 and rep["completed"] == 6
    prompts = [b["prompt"] for b in seen.bodies]
    continued = 0
    for i, p in enumerate(prompts):
        earlier = [j for j in range(i) if p.startswith(prompts[j] + seen.answers[j] + "\n")]
        if earlier:  # a later turn: some earlier prompt, its answer, then a new 6-word message
            j = max(earlier, key=lambda j: len(prompts[j]))
            assert len(p[len(prompts[j] + seen.answers[j]) + 1 :].split()) == 6
            continued += 1
        else:
            assert len(p.split()) == 6
    assert continued == 4
    assert rep["cache_hit_rate"] > 0.3  # later turns share their history


def test_prefill_stall_sends_long_prompts_once_decode_streams_have_begun(tmp_path):
    out = tmp_path / "r.json"
    seen = Seen()
    with serve(fake_app(seen, set(), set())) as url:
        code = run_bench(
            args(
                url,
                "--workload",
                "prefill-stall",
                "--num-prompts",
                "3",
                "--input-len",
                "10",
                "--output-len",
                "6",
                "--stall-prompts",
                "2",
                "--stall-input-len",
                "50",
                "--stall-output-len",
                "1",
                "--output-json",
                str(out),
            )
        )
    assert code == 0
    rep = json.loads(out.read_text())
    assert set(rep["groups"]) == {"decode", "prefill"}
    assert (
        rep["groups"]["decode"]["output_tokens"] == 18
        and rep["groups"]["prefill"]["output_tokens"] == 2
    )
    decode = [i for i, b in enumerate(seen.bodies) if b["max_tokens"] == 6]
    prefill = [i for i, b in enumerate(seen.bodies) if b["max_tokens"] == 1]
    assert min(seen.arrivals[i] for i in prefill) >= max(seen.first_sent[i] for i in decode)
    assert rep["groups"]["decode"]["itl_ms"]["p50"] is not None


def test_seed_changes_every_text_and_tokenizer_lengths_are_exact():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    ns = args("http://x", "--workload", "distinct", "--num-prompts", "4", "--input-len", "100")
    a = workloads.build(ns, tok)
    ns.seed = 1
    b = workloads.build(ns, tok)
    assert not {s.turns[0].message for s in a} & {s.turns[0].message for s in b}
    lens = [len(tok.encode(s.turns[0].message, add_special_tokens=False)) for s in a + b]
    assert all(abs(n - 100) <= 1 for n in lens) and lens.count(100) >= 6


def test_stream_reader_counts_text_arrivals_and_refuses_unfinished_streams():
    def data(text: str | None, finish: str | None = None, usage: dict | None = None) -> str:
        choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": finish}]
        return "data: " + json.dumps({"choices": choices, "usage": usage})

    res = Result()
    reader = StreamReader(res, start=0.0)
    usage = {
        "prompt_tokens": 7,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    for t, line in [(1.0, data("")), (2.0, data("a")), (3.0, data("")), (5.0, data("b", "length")),
                    (5.1, data(None, usage=usage)), (5.2, "data: [DONE]")]:  # fmt: skip
        reader.line(line, t)
    reader.close()
    assert res.ok and res.ttft == 2.0 and res.itl == [3.0] and res.text == "ab"
    assert (res.prompt_tokens, res.completion_tokens, res.cached_tokens) == (7, 4, 3)

    cut = StreamReader(Result(), start=0.0)
    cut.line(data("a"), 1.0)
    with pytest.raises(ServerError, match="ended before"):
        cut.close()
