"""Speculative decoding end to end in one process: the real scheduler driving the real
model runner (a tiny random Llama, float32, CPU) through the wire messages, no sockets.

Greedy and seeded outputs are token-exact with speculation off (and greedy with
transformers), with cache hits, chunked prefill, pages, a pool small enough to retract,
and the overlap schedule; repetitive prompts (and random tiny models' loops) make the
drafts land, so accepted > 0 is asserted, not hoped for.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from conftest import load_hf_model

from radixserve.internal.v1 import engine_pb2
from services.common.config import SchedulerConfig, WorkerConfig
from services.common.transport import pack_i32
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.scheduler import Scheduler
from services.worker import wire
from services.worker.model_runner import ModelRunner
from tests.fake_worker import FRONTEND, FakeWorkerSocket, run

MAX_NEW = 48
LABELS = {"model_name": "tiny", "engine": "0"}


class InProcessWorker:
    """The real worker's forward (wire.forward) behind the fake worker's socket."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.info = wire.encode_info(runner.info(), "in-process")
        self.batches: list[engine_pb2.ForwardBatch] = []

    def forward(self, batch: engine_pb2.ForwardBatch) -> engine_pb2.ForwardResult:
        self.batches.append(batch)
        result = wire.forward(self.runner, batch)
        result.worker_instance = self.info.instance_id
        return result


@pytest.fixture(scope="module")
def runners(tiny_llama_dir):
    """One runner per pool size, reused (each run starts from an empty tree: the tables
    and sampling state are rewritten by every request's first batch)."""
    made: dict[int, ModelRunner] = {}

    def get(pool: int) -> ModelRunner:
        if pool not in made:
            made[pool] = ModelRunner(
                WorkerConfig(
                    model_path=str(tiny_llama_dir),
                    device="cpu",
                    dtype="float32",
                    max_total_tokens=pool,
                    max_running_requests=8,
                )
            )
        return made[pool]

    return get


def workload(seed: int = 0) -> list[tuple[str, list[int], engine_pb2.SamplingParams]]:
    """Repetitive prompts (a block said three times), one random one, a seeded sampled
    one with penalties, one asking for logprobs; then the first again, extended (a cache
    hit that goes on from a finished request's text)."""
    rng = random.Random(seed)
    greedy = engine_pb2.SamplingParams(max_tokens=MAX_NEW, temperature=0)
    block = [rng.randrange(3, 300) for _ in range(20)]
    other = [rng.randrange(3, 300) for _ in range(15)]
    seeded = engine_pb2.SamplingParams(
        max_tokens=MAX_NEW, temperature=0.8, top_p=0.95, seed=42, repetition_penalty=1.1
    )
    logprobs = engine_pb2.SamplingParams(
        max_tokens=MAX_NEW, temperature=0, logprobs=True, top_logprobs=2
    )
    return [
        ("rep", block * 3, greedy),
        ("rand", [rng.randrange(3, 300) for _ in range(37)], greedy),
        ("rep2", other * 4, seeded),
        ("lp", block * 2 + other, logprobs),
    ]


def serve(runner: ModelRunner, reqs, **cfg) -> tuple[dict, Scheduler, InProcessWorker]:
    worker = InProcessWorker(runner)
    metrics = SchedulerMetrics("tiny", "0")
    cfg.setdefault("speculative_gate", "always")  # the cases assert drafts were verified
    sched = Scheduler(SchedulerConfig(**cfg), FakeWorkerSocket(worker), worker.info, metrics)
    for rid, prompt, sampling in reqs:
        msg = engine_pb2.TokenizedRequest(rid=rid, input_ids=pack_i32(prompt), sampling=sampling)
        sched.add_request(FRONTEND, msg)
    first = run(sched)
    # The same prompts again (cache hits), and one going on from "rep"'s whole text.
    rep = next(p for rid, p, _ in reqs if rid == "rep")
    again = [(rid + "-again", p, s) for rid, p, s in reqs]
    again.append(("rep-on", rep + list(first["rep"].token_ids), reqs[0][2]))
    for rid, prompt, sampling in again:
        msg = engine_pb2.TokenizedRequest(rid=rid, input_ids=pack_i32(prompt), sampling=sampling)
        sched.add_request(FRONTEND, msg)
    return first | run(sched), sched, worker


def counter(sched: Scheduler, name: str) -> float:
    return sched.metrics.registry.get_sample_value(f"radixserve:{name}_total", LABELS) or 0.0


CONFIGS = {
    "plain": dict(chunked_prefill_size=16),
    "pages_overlap_off": dict(page_size=4, chunked_prefill_size=24, disable_overlap_schedule=True),
    "tight_pool": dict(chunked_prefill_size=32, pool=330),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_and_seeded_outputs_equal_speculation_off(runners, name):
    cfg = dict(CONFIGS[name])
    runner = runners(cfg.pop("pool", 4096))
    reqs = workload()
    off, _, _ = serve(runner, reqs, **cfg)
    for algorithm in ("ngram", "suffix"):
        on, sched, worker = serve(runner, reqs, speculative_algorithm=algorithm, **cfg)
        assert set(on) == set(off)
        for rid, d in off.items():
            assert list(on[rid].token_ids) == list(d.token_ids), (algorithm, rid)
            assert on[rid].finish_reason == d.finish_reason
            if name != "tight_pool":  # there, what is evicted when depends on the pace
                assert on[rid].cached_tokens == d.cached_tokens
        for a, b in zip(on["lp"].logprobs, off["lp"].logprobs, strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
        accepted = counter(sched, "spec_decode_num_accepted_tokens")
        assert accepted > 0, algorithm
        assert len(worker.batches) < sum(len(d.token_ids) for d in on.values())
        sched.check_idle()
        sched.kv.check()
        if name == "tight_pool":
            assert counter(sched, "num_retracted_requests") > 0


def test_greedy_matches_transformers(runners, tiny_llama_dir):
    hf = load_hf_model(tiny_llama_dir)
    rid, prompt, sampling = workload()[0]
    got, _, _ = serve(runners(4096), [(rid, prompt, sampling)], speculative_algorithm="suffix")
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert list(got[rid].token_ids) == ref


def _constrained(rid: str, prompt: list[int], seed: int | None = None, **kind):
    sampling = engine_pb2.SamplingParams(max_tokens=40, temperature=0.7 if seed else 0)
    if seed is not None:
        sampling.seed = seed
    for key, value in kind.items():
        setattr(sampling.constraint, key, value)
    return rid, prompt, sampling


def test_constrained_requests_speculate_with_the_outputs_of_speculation_off():
    """Drafts of constrained requests go through the grammar row by row: the ones it
    refuses are dropped (a prompt of letters under a digits-only regex drafts letters), the
    ones it takes can land (a pattern that repeats), and every output is speculation off's,
    greedy and seeded, each one matching its constraint."""
    from transformers import AutoTokenizer

    from services.common.config import DEFAULT_MODEL_PATH

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    runner = ModelRunner(
        WorkerConfig(
            model_path=DEFAULT_MODEL_PATH,
            device="cpu",
            max_total_tokens=4096,
            max_running_requests=8,
        )
    )
    words = tok.encode("abc abc abc abc abc abc abc abc abc abc")
    digits = tok.encode("xy xy xy xy xy xy xy xy: 12 12 12")
    schema = (
        '{"type": "object", "properties": {"k": {"enum": ["abc abc abc abc"]}}, "required": ["k"]}'
    )
    reqs = [
        _constrained("rep", words, regex="(abc ){6}abc"),
        _constrained("digits", digits, regex="[0-9]{2}( [0-9]{2}){5}"),
        _constrained("seeded", digits, seed=11, regex="(12 |34 ){8}"),
        _constrained("schema", words, json_schema=schema),
    ]
    off, _, _ = serve(runner, reqs)
    on, sched, _ = serve(runner, reqs, speculative_algorithm="ngram")
    assert set(on) == set(off)
    for rid, d in off.items():
        assert list(on[rid].token_ids) == list(d.token_ids), rid
        assert on[rid].finish_reason == d.finish_reason == "stop", rid
    assert re.fullmatch(
        "(abc ){6}abc", tok.decode(list(on["rep"].token_ids), skip_special_tokens=True)
    )
    assert counter(sched, "spec_decode_num_accepted_tokens") > 0
    sched.check_idle()
    sched.kv.check()
