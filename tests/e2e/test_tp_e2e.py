"""`radixserve serve --tp-size 2` on the CPU (gloo): three services, the worker as two
ranks. Greedy tokens equal transformers' on the shipped model, a cache hit answers the
same, a constrained request keeps its pattern, prompt logprobs come back; then kill -9 of
rank 1 mid-stream: every stream ends UNAVAILABLE within 10 s, the engine comes back (serve
restarts the worker, which starts its ranks again) and answers as before, the pool whole.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve.v1 import generation_pb2 as pb
from tests.server_util import DEFAULT_MODEL, Server, greedy, idle_pool_is_whole, serve_children

pytestmark = pytest.mark.slow

PROMPT_IDS = [17, 240, 3, 99, 58, 311, 7, 460, 21, 75, 130, 8]
NEW = 16
RANK_LOST_S = 10.0  # the bound for streams of a lost rank


def _generate_ids(s: Server, ids: list[int], **sampling) -> tuple[list[int], list, int]:
    """(tokens, prompt logprobs, cached tokens) of one greedy request."""
    req = pb.GenerateRequest(input_ids=pb.InputIds(ids=ids), sampling=greedy(NEW, **sampling))
    tokens: list[int] = []
    prompt: list = []
    cached = 0
    for msg in s.stub.Generate(req, timeout=60):
        tokens.extend(msg.token_ids)
        prompt.extend(msg.prompt_logprobs)
        cached = msg.cached_tokens or cached
    return tokens, prompt, cached


def _transformers_greedy(ids: list[int]) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
    return out[0, len(ids) :].tolist()


def _rank1_pid(s: Server) -> int:
    worker = serve_children(s.proc.pid)["worker"]
    return serve_children(worker)["worker"]  # rank 0 starts `services.cli worker --tp-rank 1`


class _Stream:
    """A long greedy stream on a thread: its status code and when it ended."""

    def __init__(self, s: Server):
        req = pb.GenerateRequest(text="A long one.", sampling=greedy(400, ignore_eos=True))
        self.call = s.stub.Generate(req, timeout=120)
        self.started, self.done = threading.Event(), threading.Event()
        self.code: grpc.StatusCode | None = None
        self.ended_at = 0.0
        threading.Thread(target=self._consume, daemon=True).start()

    def _consume(self) -> None:
        try:
            for _ in self.call:
                self.started.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code = e.code()
        self.ended_at = time.monotonic()
        self.done.set()


def _when_back(s: Server, ids: list[int], timeout_s: float = 180) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _generate_ids(s, ids)[0]
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            assert time.monotonic() < deadline, f"not serving again\n{s.output()[-4000:]}"
            time.sleep(0.3)


def test_tp2_serves_exactly_and_goes_down_with_a_killed_rank():
    flags = ("--tp-size", "2", "--max-total-tokens", "4096", "--restart-backoff", "0.2")
    with Server(*flags, metrics=True) as s:
        first, prompt_logprobs, _ = _generate_ids(s, PROMPT_IDS, prompt_logprobs=True)
        assert first == _transformers_greedy(PROMPT_IDS)
        assert len(prompt_logprobs) == len(PROMPT_IDS) - 1
        again, _, cached = _generate_ids(s, PROMPT_IDS)
        assert again == first and cached > 0
        req = pb.GenerateRequest(text="Numbers:", sampling=greedy(12, regex="[0-9]{3}-[0-9]{2}"))
        text = "".join(m.text for m in s.stub.Generate(req, timeout=60))
        assert re.fullmatch("[0-9]{3}-[0-9]{2}", text), text

        streams = [_Stream(s) for _ in range(3)]
        for st in streams:
            assert st.started.wait(60), s.output()[-4000:]
        os.kill(_rank1_pid(s), signal.SIGKILL)
        killed_at = time.monotonic()
        for st in streams:
            assert st.done.wait(RANK_LOST_S + 5)
            assert st.code == grpc.StatusCode.UNAVAILABLE, st.code
            assert st.ended_at - killed_at < RANK_LOST_S
        assert _when_back(s, PROMPT_IDS) == first
        idle_pool_is_whole(s)
        assert "the worker process exited with code 70" in s.output(), s.output()[-6000:]
