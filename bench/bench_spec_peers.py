"""Speculation against vLLM's: bench_spec.py's workloads (code edit, multi-turn, agentic,
random) over the OpenAI API of servers already running, each with and without
speculation, at batch 1 and 16. Rounds interleave the servers (the order flips each round),
with a pause before each run (vLLM's engine spins for ~1 s after a load); medians of
output tokens/s, and for the greedy workloads whether each server's answers equal the
first one's.

    .venv/bin/python bench/bench_spec_peers.py --servers rs-off=http://127.0.0.1:33080,...

docs/benchmarks.md ("Speculative decoding") has the commands that started the servers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_spec import MAKERS, Call, Stream, fit  # noqa: E402
from services.common.config import DEFAULT_MODEL_PATH  # noqa: E402

PAUSE_S = 2.0
CONTEXT = 512  # the shipped model's positions: bench_spec's calls are fitted to them


def body(call: Call, model: str) -> tuple[str, dict]:
    """The route and OpenAI body of one of bench_spec's calls (all plain completions)."""
    sp = call.sampling
    out: dict = {"model": model, "max_tokens": sp.max_tokens, "temperature": sp.temperature}
    if sp.HasField("seed"):
        out["seed"] = sp.seed
    if sp.ignore_eos:
        out["ignore_eos"] = True
    if sp.stop:
        out["stop"] = list(sp.stop)
    return "/v1/completions", out | {"prompt": call.text}


def run_stream(url: str, model: str, stream: Stream, tok) -> tuple[int, list[str]]:
    """A stream's calls in order; (output tokens, answers)."""
    call: Call | None = fit(stream.first, tok, CONTEXT)
    tokens, answers = 0, []
    while call is not None:
        route, b = body(call, model)
        r = httpx.post(url + route, json=b, timeout=600)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        answer = choice["text"]
        tokens += r.json()["usage"]["completion_tokens"]
        answers.append(answer)
        nxt = stream.follow(call, answer, len(answers)) if stream.follow else None
        call = fit(nxt, tok, CONTEXT) if nxt is not None else None
    return tokens, answers


def measure(url: str, streams: list[Stream], batch: int, tok) -> tuple[float, list[list[str]]]:
    """Output tokens/s of the streams, ``batch`` at a time (the next starts when one ends, as
    bench_spec.py runs them)."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    time.sleep(PAUSE_S)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        done = list(pool.map(lambda s: run_stream(url, model, s, tok), streams))
    total = sum(t for t, _ in done)
    return total / (time.perf_counter() - t0), [a for _, a in done]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", required=True, help="name=url,... (the first is the baseline)")
    ap.add_argument("--workloads", default="code-edit,multi-turn,agentic,random")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams-per-slot", type=int, default=4, help="as bench_spec.py's")
    # bench_spec.py's workload sizes (its defaults)
    ap.add_argument("--output-len", type=int, default=160)
    ap.add_argument("--turn-len", type=int, default=256)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--step-len", type=int, default=96)
    ap.add_argument("--agent-steps", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--random-temperature", type=float, default=2.0, help="vLLM allows <= 2")
    a = ap.parse_args()
    servers = dict(s.split("=", 1) for s in a.servers.split(","))
    batches = [int(b) for b in a.batches.split(",")]
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    first = next(iter(servers))
    print("| workload | batch | " + " | ".join(servers) + " | same answers as " + first + " |")
    print("|---|---:|" + "---:|" * len(servers) + "---|")
    for w in a.workloads.split(","):
        for batch in batches:
            streams = [MAKERS[w](i, a, tok) for i in range(batch * a.streams_per_slot)]
            speeds: dict[str, list[float]] = {name: [] for name in servers}
            answers: dict[str, list[list[str]]] = {}
            for r in range(a.rounds):
                for name in list(servers)[:: 1 if r % 2 == 0 else -1]:
                    tps, answers[name] = measure(servers[name], streams, batch, tok)
                    speeds[name].append(tps)
            base = statistics.median(speeds[first])
            cells = [f"{statistics.median(v):,.0f} ({statistics.median(v) / base:.2f}x)"
                     for v in speeds.values()]  # fmt: skip
            same = "(sampled)" if w == "random" else " ".join(
                name for name in servers if answers[name] == answers[first])  # fmt: skip
            print(f"| {w} | {batch} | " + " | ".join(cells) + f" | {same} |", flush=True)


if __name__ == "__main__":
    main()
