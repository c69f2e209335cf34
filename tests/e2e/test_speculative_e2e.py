"""Speculative decoding over the three real processes (--speculative-algorithm suffix) on
the shipped model, which recites the Zen of Python: its answers repeat themselves and
each other, so drafts land.

Every API answers exactly what the same request answers with speculation opted out
(``disable_speculation``: the one-token-per-step path of the same server), greedy and
seeded; a stop string inside a multi-token step keeps nothing after it; the metrics count
accepted drafts; the idle pool is whole afterwards.
"""

from __future__ import annotations

import httpx
import pytest

from radixserve.v1 import generation_pb2 as pb
from tests.server_util import Server, idle_pool_is_whole, scrape_metrics

pytestmark = pytest.mark.slow

PROMPT = "Beautiful is better than ugly.\n"
MAX_NEW = 64


@pytest.fixture(scope="module")
def server():
    flags = ("--speculative-algorithm", "suffix", "--speculative-gate", "always",
             "--chunked-prefill-size", "16")  # fmt: skip
    with Server(*flags, metrics=True) as s:
        yield s


def grpc_run(server: Server, off: bool = False, **sampling) -> tuple[list[int], str, list[int]]:
    """(token ids, text, tokens per streamed message) of one Generate."""
    sp = pb.SamplingParams(max_tokens=MAX_NEW, disable_speculation=off, **sampling)
    ids, text, sizes = [], "", []
    for msg in server.stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=sp), timeout=120):
        ids.extend(msg.token_ids)
        text += msg.text
        sizes.append(len(msg.token_ids))
    return ids, text, sizes


def accepted(server: Server) -> float:
    return scrape_metrics(server.sched_metrics)["radixserve:spec_decode_num_accepted_tokens_total"]


def test_greedy_and_seeded_equal_opt_out_and_drafts_land(server):
    for sampling in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 5}):
        ref_ids, ref_text, ref_sizes = grpc_run(server, off=True, **sampling)
        assert max(ref_sizes) == 1  # opted out: one token per step
        before = accepted(server)
        for _ in range(2):  # the second: a cache hit, and the first's answer in the index
            ids, text, sizes = grpc_run(server, **sampling)
            assert (ids, text) == (ref_ids, ref_text), sampling
        assert accepted(server) > before
        assert max(sizes) > 1  # several tokens in one streamed message
    idle_pool_is_whole(server)


def test_http_routes_and_a_stop_string_inside_a_step(server):
    base = f"http://127.0.0.1:{server.http_port}"
    ref, ref_text, _ = grpc_run(server, off=True, temperature=0.0)
    stop = ref_text.splitlines()[3][:12]  # a line the answer reaches after several steps
    for off in (True, False):
        body = {"prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0, "stop": [stop]}
        body["disable_speculation"] = off
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        assert choice["text"] == ref_text[: ref_text.index(stop)]
        assert choice["finish_reason"] == "stop"
        if off:
            want_usage = usage["completion_tokens"]
        else:
            assert usage["completion_tokens"] == want_usage
        native = {
            "text": PROMPT,
            "sampling_params": {
                "max_new_tokens": MAX_NEW,
                "temperature": 0,
                "disable_speculation": off,
            },
        }
        r = httpx.post(f"{base}/generate", json=native, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == ref
    idle_pool_is_whole(server)
