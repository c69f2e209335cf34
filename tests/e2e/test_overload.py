"""Admission control over the three real processes (issue 41): a burst far beyond the
queue limit gets 429 with Retry-After at once, while every admitted request finishes with
the same greedy answer it gets alone, and the server serves normally afterwards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server_util import Server

pytestmark = pytest.mark.slow
PROMPTS = [f"Beautiful is better than ugly, number {i}." for i in range(16)]


@pytest.fixture(scope="module")
def server():
    flags = ("--max-running-requests", "2", "--max-queued-requests", "2")
    with Server(*flags, "--max-total-tokens", "4096") as s:
        yield s


def _complete(server: Server, prompt: str) -> httpx.Response:
    # Long enough that the burst arrives while the first ones still hold the queue.
    body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    return httpx.post(url, json=body, timeout=120)


def test_a_burst_beyond_the_queue_gets_429_and_the_admitted_answers_are_exact(server):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        burst = list(pool.map(lambda p: _complete(server, p), PROMPTS))
    codes = [r.status_code for r in burst]
    assert set(codes) <= {200, 429} and codes.count(200) >= 2 and codes.count(429) >= 4, codes
    for r in burst:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert "--max-queued-requests 2" in r.json()["error"]["message"]
    for prompt, r in zip(PROMPTS, burst, strict=True):
        if r.status_code == 200:  # alone, afterwards: the same greedy text
            alone = _complete(server, prompt)
            assert alone.status_code == 200
            assert r.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
