"""Test helpers for the frontend: a tiny tokenizer folder, a scripted scheduler peer, and a
frontend running in a background thread. Real ZeroMQ and real gRPC, on loopback."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import zmq

from radixserve.internal.v1 import engine_pb2, engine_pb2_grpc
from services.common import transport
from services.common.config import FrontendConfig
from tests.server_util import free_port

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello radix tree, hello cache",
    "a stop word ends the text; the rest is cut",
    "serving large language models with a shared prefix cache",
] * 20
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# What the fake scheduler "generates": multi-byte characters that the ASCII-trained
# byte-level BPE splits across several tokens, and a stop word to cut at.
SCRIPT_TEXT = "Hello wörld, 世界! 🙂 the STOP word. 日本語 done"
EOS_ID = 1


def build_tokenizer(path: Path) -> Path:
    """A byte-level BPE tokenizer with a chat template, saved like a model folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID]}))
    return path


@dataclass
class _Running:
    identity: bytes
    req: engine_pb2.TokenizedRequest
    step_s: float
    emitted: int = 0
    next_at: float = 0.0


@dataclass
class FakeScheduler:
    """A scheduler peer that answers every TokenizedRequest with ``script`` one token per step.

    Behaviour by cache_salt: ``error:CODE`` rejects with that gRPC code; ``slow`` emits
    forever (until aborted) every 50 ms; ``multi:N`` emits N tokens per delta (as
    speculative decoding does). Otherwise it finishes "length" at max_tokens, or "stop"
    with EOS after the script.
    """

    script: list[int]
    vocab_size: int
    max_model_len: int = 256
    step_s: float = 0.002
    addr: str = field(default_factory=lambda: transport.new_ipc_addr("fake-scheduler"))
    control_port: int = field(default_factory=free_port)
    requests: list = field(default_factory=list)
    aborts: list = field(default_factory=list)  # (AbortRequest, time received)
    flushes: int = 0
    flush_refusal: str = ""

    @property
    def control_addr(self) -> str:
        return f"127.0.0.1:{self.control_port}"

    def start(self) -> FakeScheduler:
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = transport.router(self._ctx, self.addr)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        engine_pb2_grpc.add_SchedulerControlServicer_to_server(_Control(self), self._grpc)
        self._grpc.add_insecure_port(self.control_addr)
        self._grpc.start()
        return self

    def stop(self) -> None:
        self._grpc.stop(0)
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()

    def _loop(self) -> None:
        running: dict[str, _Running] = {}
        while not self._stop.is_set():
            if self._sock.poll(1):
                identity, msg = transport.recv_routed(self._sock, engine_pb2.FrontendToScheduler)
                self._on_message(identity, msg, running)
            now = time.monotonic()
            for rid, r in list(running.items()):
                if now >= r.next_at and self._step(r):
                    del running[rid]

    def _on_message(self, identity: bytes, msg, running: dict[str, _Running]) -> None:
        if msg.WhichOneof("kind") == "abort":
            self.aborts.append((msg.abort, time.monotonic()))
            r = running.pop(msg.abort.rid, None)
            if r is not None:  # like the real scheduler: a closing delta with the totals
                delta = engine_pb2.TokenDelta(
                    rid=r.req.rid, finish_reason="abort", finish_message=msg.abort.reason
                )
                self._send(identity, _with_totals(delta, r))
            return
        req = msg.generate
        self.requests.append(req)
        if req.cache_salt.startswith("error:"):
            delta = engine_pb2.TokenDelta(
                rid=req.rid,
                finish_reason="abort",
                error_code=req.cache_salt[6:],
                finish_message="fake refusal: no room",
                # As the real scheduler's overload refusal: when to retry.
                retry_after=2.0 if req.cache_salt == "error:RESOURCE_EXHAUSTED" else 0.0,
            )
            self._send(identity, delta)
            return
        step = 0.05 if req.cache_salt == "slow" else self.step_s
        running[req.rid] = _Running(identity, req, step, next_at=time.monotonic() + step)

    def _step(self, r: _Running) -> bool:
        """Emits one token (N with ``multi:N``) in one delta; True when the request is done."""
        salt = r.req.cache_salt
        per_step = int(salt[6:]) if salt.startswith("multi:") else 1
        deltas = [self._one_token(r) for _ in range(per_step)]
        delta = deltas[0]
        for more in deltas[1:]:
            if delta.finish_reason:
                break
            delta.token_ids.extend(more.token_ids)
            delta.logprobs.extend(more.logprobs)
            for name in ("finish_reason", "matched_stop_token", "prompt_tokens", "cached_tokens"):
                setattr(delta, name, getattr(more, name))
            for name in ("completion_tokens", "queue_time", "prefill_time", "decode_time"):
                setattr(delta, name, getattr(more, name))
        self._send(r.identity, delta)
        r.next_at = time.monotonic() + r.step_s
        return bool(delta.finish_reason)

    def _one_token(self, r: _Running) -> engine_pb2.TokenDelta:
        sp = r.req.sampling
        max_tokens = sp.max_tokens if sp.HasField("max_tokens") else 128
        if max_tokens == 0:  # prefill only: one delta, no token
            delta = engine_pb2.TokenDelta(rid=r.req.rid, finish_reason="length")
            _with_prompt_logprobs(delta, r.req)
            return _with_totals(delta, r)
        slow = r.req.cache_salt == "slow"
        token = (
            self.script[r.emitted % len(self.script)]
            if slow or r.emitted < len(self.script)
            else EOS_ID
        )
        r.emitted += 1
        delta = engine_pb2.TokenDelta(rid=r.req.rid, token_ids=[token], matched_stop_token=-1)
        if sp.logprobs:
            lp = engine_pb2.TokenLogprob(token_id=token, logprob=-0.5)
            lp.top.add(token_id=token, logprob=-0.5)
            delta.logprobs.append(lp)
        if token == EOS_ID and not slow:
            delta.finish_reason, delta.matched_stop_token = "stop", EOS_ID
        elif r.emitted >= max_tokens:
            delta.finish_reason = "length"
        if delta.finish_reason:
            _with_totals(delta, r)
        if r.emitted == 1:
            _with_prompt_logprobs(delta, r.req)
        return delta

    def _send(self, identity: bytes, delta: engine_pb2.TokenDelta) -> None:
        transport.send(
            self._sock, engine_pb2.SchedulerToFrontend(outputs=[delta]), identity=identity
        )


def fake_prompt_logprob(position: int) -> float:
    """What the fake scheduler reports as the logprob of the prompt token at position."""
    return -0.25 * position


def _with_prompt_logprobs(delta: engine_pb2.TokenDelta, req: engine_pb2.TokenizedRequest) -> None:
    """On the first delta, as the real scheduler sends them: from max(start, 1) on."""
    sp = req.sampling
    if not sp.prompt_logprobs:
        return
    ids = transport.unpack_i32(req.input_ids).tolist()
    start = max(sp.prompt_logprobs_start if sp.HasField("prompt_logprobs_start") else 0, 1)
    for q in range(start, len(ids)):
        lp = delta.prompt_logprobs.add(token_id=ids[q], logprob=fake_prompt_logprob(q))
        for _ in range(sp.top_logprobs if sp.HasField("top_logprobs") else 0):
            lp.top.add(token_id=ids[q], logprob=fake_prompt_logprob(q))
    delta.prompt_logprobs_start = start


def _with_totals(delta: engine_pb2.TokenDelta, r: _Running) -> engine_pb2.TokenDelta:
    """Counts and timings, which the scheduler sends on a request's last delta only."""
    n_prompt = len(transport.unpack_i32(r.req.input_ids))
    delta.prompt_tokens, delta.cached_tokens, delta.completion_tokens = (
        n_prompt,
        n_prompt // 2,
        r.emitted,
    )
    delta.queue_time, delta.prefill_time, delta.decode_time = 0.001, 0.002, 0.003
    return delta


class _Control(engine_pb2_grpc.SchedulerControlServicer):
    def __init__(self, fake: FakeScheduler) -> None:
        self._fake = fake

    def GetStats(self, request, context):
        worker = engine_pb2.WorkerInfo(
            model_id="tiny",
            architecture="LlamaForCausalLM",
            vocab_size=self._fake.vocab_size,
            max_model_len=self._fake.max_model_len,
            eos_token_ids=[EOS_ID],
        )
        return engine_pb2.SchedulerStats(
            max_total_num_tokens=4096, available_tokens=4096, page_size=1, worker=worker
        )

    def FlushCache(self, request, context):
        if self._fake.flush_refusal:
            return engine_pb2.FlushReply(flushed=False, message=self._fake.flush_refusal)
        self._fake.flushes += 1
        return engine_pb2.FlushReply(flushed=True, message="Cache flushed.")


class FrontendThread:
    """The real frontend (FrontendServer) in its own event loop on a background thread."""

    def __init__(self, cfg: FrontendConfig) -> None:
        from services.frontend.main import FrontendServer

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server = FrontendServer(cfg)

    def start(self) -> FrontendThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(60)
        return self

    def wait_ready(self, timeout_s: float = 10.0) -> FrontendThread:
        """Returns once HTTP /health answers 200 (an engine reached): tests start from a
        serving frontend, not one still connecting."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while httpx.get(self.http_base + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the frontend did not become ready"
            time.sleep(0.05)
        return self

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.server.grpc_port}"

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0.5), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def frontend_config(
    model_path: Path, fakes: list[FakeScheduler], http: bool = False
) -> FrontendConfig:
    return FrontendConfig(
        model_path=str(model_path),
        served_model_name="tiny",
        port=0,
        http_port=0 if http else -1,
        scheduler_addrs=[f.addr for f in fakes],
        scheduler_control_addrs=[f.control_addr for f in fakes],
    )
