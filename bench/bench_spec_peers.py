"""Speculation against vLLM's: the code-edit workload of bench_spec.py (the answer repeats
a ~200-token document) over the OpenAI /v1/completions of servers already running, each
with and without speculation, greedy, at batch 1 and 16. Rounds interleave the servers
(the order flips each round); medians of output tokens/s, and every server's answers
compared with the first one's (greedy: the same tokens, or the row says how many differ).

    .venv/bin/python bench/bench_spec_peers.py --servers rs-off=http://127.0.0.1:30080,...

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

PAUSE_S = 2.0

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_spec import document  # noqa: E402
from services.common.config import DEFAULT_MODEL_PATH  # noqa: E402
from services.frontend.tokenizer import Tokenizer  # noqa: E402


def prompts(n: int, doc_tokens: int) -> list[str]:
    doc = document(doc_tokens, Tokenizer(DEFAULT_MODEL_PATH))
    lines = doc.splitlines()
    return [
        f"Rewrite this text, changing nothing:\n{doc}\n\nRewritten:\n{lines[i % len(lines)]}\n"
        for i in range(n)
    ]


def complete(url: str, model: str, prompt: str, max_tokens: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def measure(
    url: str, batch: int, texts: list[str], max_tokens: int, waves: int = 1
) -> tuple[float, list[str]]:
    """Output tokens/s of ``waves`` rounds of ``batch`` concurrent requests (each of
    ``max_tokens`` tokens), after a pause: vLLM's engine spins for ~1 s after a load."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    time.sleep(PAUSE_S)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        for _ in range(waves):
            outs = list(pool.map(lambda p: complete(url, model, p, max_tokens), texts[:batch]))
    return waves * batch * max_tokens / (time.perf_counter() - t0), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", required=True, help="name=url,... (the first is the baseline)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=160)
    ap.add_argument("--doc-tokens", type=int, default=200)
    a = ap.parse_args()
    servers = dict(s.split("=", 1) for s in a.servers.split(","))
    batches = [int(b) for b in a.batches.split(",")]
    texts = prompts(max(batches), a.doc_tokens)
    for url in servers.values():  # warm: compiled graphs, caches of the document's prefix
        measure(url, 2, texts, 8)
    speeds: dict[tuple[str, int], list[float]] = {}
    answers: dict[tuple[str, int], list[str]] = {}
    for r in range(a.rounds):
        for batch in batches:
            for name in list(servers)[:: 1 if r % 2 == 0 else -1]:
                waves = max(1, 8 // batch)  # a batch-1 run of one answer is too short to time
                tps, outs = measure(servers[name], batch, texts, a.output_len, waves)
                speeds.setdefault((name, batch), []).append(tps)
                answers[(name, batch)] = outs
    first = next(iter(servers))
    print("| server | " + " | ".join(f"batch {b} tok/s" for b in batches) + " | answers |")
    print("|---|" + "---:|" * len(batches) + "---|")
    for name in servers:
        cells = []
        for b in batches:
            med, base = statistics.median(speeds[(name, b)]), statistics.median(speeds[(first, b)])
            cells.append(f"{med:,.0f} ({med / base:.2f}x)")
        same = sum(answers[(name, b)] == answers[(first, b)] for b in batches)
        print(f"| {name} | " + " | ".join(cells) + f" | {same}/{len(batches)} batches as {first} |")


if __name__ == "__main__":
    main()
