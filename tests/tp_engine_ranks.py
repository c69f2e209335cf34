"""The rank side of tests/unit/test_tp_engine.py: the real scheduler driving the worker's
ModelRunner as rank 0 of a tensor-parallel group (the others follow, as `radixserve worker
--tp-rank K` does), through the wire messages, no sockets. Apart from the test module so
that a rank does not import conftest's transformers model classes."""

from __future__ import annotations

import random

import torch

from radixserve.internal.v1 import engine_pb2
from services.common.config import SchedulerConfig, WorkerConfig
from services.common.transport import pack_i32
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.scheduler import Scheduler
from services.worker import wire
from services.worker.model_runner import ModelRunner
from services.worker.parallel.group import TpGroup
from services.worker.parallel.rank_runner import RankModel
from tests.fake_worker import FRONTEND, FakeWorkerSocket

MAX_NEW = 24
LOGPROB_TOL = 1e-4
# name: (scheduler flags, KV pool tokens): chunked prefill, speculation's verify steps,
# a pool small enough that requests are retracted and resumed.
CASES = {
    "chunked": (dict(chunked_prefill_size=16), 4096),
    "speculative": (
        dict(speculative_algorithm="ngram", speculative_gate="always", chunked_prefill_size=24),
        4096,
    ),
    "tight_pool": (dict(chunked_prefill_size=32), 100),
}
Outputs = dict[str, dict]


def workload(seed: int = 0) -> list[tuple[str, list[int], engine_pb2.SamplingParams]]:
    """Greedy (a repetitive prompt, so drafts land), seeded sampling with a penalty,
    logprobs with top alternatives, and prompt logprobs."""
    rng = random.Random(seed)
    block = [rng.randrange(3, 290) for _ in range(16)]
    greedy = engine_pb2.SamplingParams(max_tokens=MAX_NEW, temperature=0)
    seeded = engine_pb2.SamplingParams(
        max_tokens=MAX_NEW, temperature=0.8, top_p=0.95, seed=7, repetition_penalty=1.1
    )
    logprobs = engine_pb2.SamplingParams(
        max_tokens=MAX_NEW, temperature=0, logprobs=True, top_logprobs=2
    )
    prompt_lp = engine_pb2.SamplingParams(
        max_tokens=4, temperature=0, prompt_logprobs=True, top_logprobs=1
    )
    return [
        ("rep", block * 3, greedy),
        ("seeded", [rng.randrange(3, 290) for _ in range(29)], seeded),
        ("lp", block * 2 + [5, 6, 7], logprobs),
        ("prompt", [rng.randrange(3, 290) for _ in range(21)], prompt_lp),
    ]


def drain(sched: Scheduler) -> Outputs:
    """Steps until idle; every request's tokens, logprobs and prompt logprobs, all deltas."""
    out: Outputs = {}
    while True:
        worked = sched.step()
        for deltas in sched.outbox.take().values():
            for d in deltas:
                o = out.setdefault(d.rid, dict(tokens=[], finish="", logprobs=[], prompt=[]))
                o["tokens"] += list(d.token_ids)
                o["logprobs"] += [(t.token_id, t.logprob) for t in d.logprobs]
                o["prompt"] += [(t.token_id, t.logprob) for t in d.prompt_logprobs]
                o["finish"] = d.finish_reason or o["finish"]
        if not worked and not sched.has_requests():
            return out


class _Worker:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.info = wire.encode_info(runner.info(), "in-process")

    def forward(self, batch: engine_pb2.ForwardBatch) -> engine_pb2.ForwardResult:
        result = wire.forward(self.runner, batch)
        result.worker_instance = self.info.instance_id
        return result


def serve(runner: ModelRunner, flags: dict) -> Outputs:
    """The workload, then the same prompts again (cache hits); each request's outputs."""
    worker = _Worker(runner)
    sched = Scheduler(
        SchedulerConfig(**flags), FakeWorkerSocket(worker), worker.info, SchedulerMetrics("t", "0")
    )
    out: Outputs = {}
    for suffix in ("", "-again"):
        for rid, prompt, sampling in workload():
            msg = engine_pb2.TokenizedRequest(
                rid=rid + suffix, input_ids=pack_i32(prompt), sampling=sampling
            )
            sched.add_request(FRONTEND, msg)
        out |= drain(sched)
    sched.check_idle()
    sched.kv.check()

    # The features the case is for did happen (not hoped for)
    def count(name: str) -> float:
        labels = {"model_name": "t", "engine": "0"}
        return sched.metrics.registry.get_sample_value(f"radixserve:{name}_total", labels) or 0

    if flags.get("speculative_algorithm"):
        assert count("spec_decode_num_accepted_tokens") > 0
    if runner.num_slots < 1000:
        assert count("num_retracted_requests") > 0
    assert any(o["prompt"] for o in out.values()) and any(o["logprobs"] for o in out.values())
    return out


def worker_config(folder: str, pool: int, tp_size: int) -> WorkerConfig:
    return WorkerConfig(
        model_path=folder,
        device="cpu",
        dtype="float32",
        max_total_tokens=pool,
        max_running_requests=8,
        tp_size=tp_size,
    )


def engine_outputs(folder: str, case: str, tp: TpGroup | None = None) -> Outputs | None:
    """One case's outputs on rank 0 (None on the others, which follow)."""
    flags, pool = CASES[case]
    cfg = worker_config(folder, pool, tp.world if tp else 1)
    if tp is not None and not tp.is_first:
        RankModel(folder, tp, torch.device("cpu"), None).follow()
        return None
    runner = ModelRunner(cfg, tp)
    try:
        return serve(runner, flags)
    finally:
        runner.stop_ranks()


def check(tp: TpGroup, folder: str, expected: dict[str, Outputs]) -> None:
    """Every case on these ranks; rank 0 compares with TP=1's outputs."""
    for case, want in expected.items():
        got = engine_outputs(folder, case, tp)
        if got is None:
            continue
        assert set(got) == set(want), case
        for rid, w in want.items():
            g, where = got[rid], f"{case}/{rid} at tp {tp.world}"
            assert g["tokens"] == w["tokens"] and g["finish"] == w["finish"], where
            for key in ("logprobs", "prompt"):
                assert [t for t, _ in g[key]] == [t for t, _ in w[key]], (where, key)
                for (_, a), (_, b) in zip(g[key], w[key], strict=True):
                    assert abs(a - b) <= LOGPROB_TOL, (where, key, a, b)
