"""A burst far beyond the queue: how fast the refusals come back, and whether the admitted
requests still get their exact answers. Not a test (tests/e2e/test_overload.py asserts the
same without timing it).

One server with --max-running-requests R and --max-queued-requests Q; a burst of
--factor x (R + Q) greedy /v1/completions at once (asyncio, one HTTP connection each).
Reports the 429s' latency (p50 / p99 / max, ms), their Retry-After, and checks every 200
against the same prompt sent alone afterwards. Exits 1 when an admitted answer differs or
a status other than 200 / 429 came back.

    .venv/bin/python bench/bench_overload.py [--factor 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from tests.server_util import Server  # noqa: E402


async def complete(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.monotonic()
    r = await client.post(url, json=body, timeout=300)
    return r, time.monotonic() - start


async def burst(
    url: str, prompts: list[str], max_tokens: int
) -> list[tuple[httpx.Response, float]]:
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(limits=limits) as client:
        return await asyncio.gather(*(complete(client, url, p, max_tokens) for p in prompts))


async def alone(url: str, prompt: str, max_tokens: int) -> str:
    async with httpx.AsyncClient() as client:
        r, _ = await complete(client, url, prompt, max_tokens)
        return r.json()["choices"][0]["text"]


def one_round(url: str, n: int, max_tokens: int, seed: int) -> dict:
    prompts = [f"Round {seed}, request {i}: beautiful is better than ugly." for i in range(n)]
    got = asyncio.run(burst(url, prompts, max_tokens))
    refused = [t * 1000 for r, t in got if r.status_code == 429]
    admitted = [(p, r) for p, (r, _) in zip(prompts, got, strict=True) if r.status_code == 200]
    other = sorted({r.status_code for r, _ in got} - {200, 429})
    wrong = sum(
        asyncio.run(alone(url, p, max_tokens)) != r.json()["choices"][0]["text"]
        for p, r in admitted
    )
    retry = {r.headers.get("retry-after") for r, _ in got if r.status_code == 429}
    return {"refused": refused, "admitted": len(admitted), "wrong": wrong, "other": other,
            "retry_after": sorted(retry)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", type=int, default=4, help="--max-running-requests")
    ap.add_argument("--queued", type=int, default=8, help="--max-queued-requests")
    ap.add_argument("--factor", type=int, default=4, help="burst = factor x (running + queued)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args()
    flags = ("--max-running-requests", str(ns.running), "--max-queued-requests", str(ns.queued))
    n = ns.factor * (ns.running + ns.queued)
    with Server(*flags) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/completions"
        rounds = [one_round(url, n, ns.max_tokens, seed) for seed in range(ns.rounds)]
    refused = np.array([ms for r in rounds for ms in r["refused"]])
    print(f"burst of {n} = {ns.factor} x ({ns.running} running + {ns.queued} queued), "
          f"{ns.max_tokens} tokens each, {ns.rounds} rounds")  # fmt: skip
    print("| measure | figure |\n|---|---|")
    print(f"| refused (429) | {len(refused)} of {n * ns.rounds} |")
    print(
        f"| 429 latency p50 / p99 / max (ms) | {np.percentile(refused, 50):.1f} / "
        f"{np.percentile(refused, 99):.1f} / {refused.max():.1f} |"
    )
    print(f"| Retry-After (s) | {sorted({x for r in rounds for x in r['retry_after']})} |")
    admitted = sum(r["admitted"] for r in rounds)
    wrong = sum(r["wrong"] for r in rounds)
    print(f"| admitted, token-exact against alone | {admitted - wrong} of {admitted} |")
    print(f"| admitted per round (median) | {statistics.median(r['admitted'] for r in rounds)} |")
    other = sorted({c for r in rounds for c in r["other"]})
    if other:
        print(f"| other statuses | {other} |")
    return 1 if wrong or other else 0


if __name__ == "__main__":
    sys.exit(main())
