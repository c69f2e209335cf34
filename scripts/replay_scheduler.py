"""A seeded scheduler workload's record, to prove a refactor changed no behaviour.

The real Scheduler drives the real ModelRunner (the shipped default model, in process,
no sockets) through several configurations: chunked prefill, ngram and suffix speculation,
a pool small enough to retract, a regex constraint, cache hits on a second pass. The
record is every ForwardBatch the scheduler sent (a hash of its bytes, in order) and every
delta it emitted; two commits' records must be equal.

    python scripts/replay_scheduler.py OUT.json            # from the repository root
    git worktree add /tmp/old <commit> && (cd /tmp/old && python /path/to/this OUT_OLD.json)
    cmp OUT.json OUT_OLD.json
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the checkout being replayed, not this file's

from radixserve.internal.v1 import engine_pb2  # noqa: E402
from services.common.config import DEFAULT_MODEL_PATH, SchedulerConfig, WorkerConfig  # noqa: E402
from services.common.transport import pack_i32  # noqa: E402
from services.scheduler.metrics import SchedulerMetrics  # noqa: E402
from services.scheduler.scheduler import Scheduler  # noqa: E402
from services.worker import wire  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from tests.fake_worker import FRONTEND, FakeWorkerSocket  # noqa: E402

# name: (scheduler flags, KV pool tokens)
CONFIGS = {
    "chunked": (dict(chunked_prefill_size=16), 4096),
    "ngram": (dict(speculative_algorithm="ngram", chunked_prefill_size=24), 4096),
    "suffix": (dict(speculative_algorithm="suffix"), 4096),
    "tight_pool": (dict(chunked_prefill_size=32), 100),
}


def workload(vocab: int) -> list[tuple[str, list[int], engine_pb2.SamplingParams]]:
    rng = random.Random(0)
    block = [rng.randrange(3, vocab) for _ in range(16)]
    sp = engine_pb2.SamplingParams
    regex = engine_pb2.Constraint(regex="[a-z]{2,6}( [a-z]{2,6}){3}")
    return [
        ("greedy", block * 3, sp(max_tokens=40, temperature=0, ignore_eos=True)),
        ("seeded", block + [5, 6], sp(max_tokens=24, temperature=0.8, top_p=0.9, seed=3)),
        ("penalty", block[:9], sp(max_tokens=20, temperature=0, repetition_penalty=1.2)),
        (
            "lp",
            block * 2,
            sp(max_tokens=32, temperature=0, logprobs=True, top_logprobs=2, ignore_eos=True),
        ),
        ("prompt", block[3:], sp(max_tokens=3, temperature=0, prompt_logprobs=True)),
        ("regex", block[:5], sp(max_tokens=30, temperature=0, constraint=regex)),
        ("min", block[:7], sp(max_tokens=10, min_tokens=6, temperature=0)),
    ]


class RecordingWorker:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.info = wire.encode_info(runner.info(), "replay")
        self.batches: list[str] = []

    def forward(self, batch: engine_pb2.ForwardBatch) -> engine_pb2.ForwardResult:
        data = batch.SerializeToString(deterministic=True)
        self.batches.append(hashlib.sha256(data).hexdigest()[:16])
        result = wire.forward(self.runner, batch)
        result.worker_instance = self.info.instance_id
        return result


def _text(delta: engine_pb2.TokenDelta) -> str:
    """The delta without its timings (the only fields that differ between runs)."""
    for name in ("queue_time", "prefill_time", "decode_time"):
        delta.ClearField(name)
    return str(delta).replace("\n", " ")


def replay(flags: dict, pool: int) -> dict:
    runner = ModelRunner(
        WorkerConfig(
            model_path=DEFAULT_MODEL_PATH,
            device="cpu",
            dtype="float32",
            max_total_tokens=pool,
            max_running_requests=8,
        )
    )
    worker = RecordingWorker(runner)
    metrics = SchedulerMetrics("replay", "0")
    sched = Scheduler(SchedulerConfig(**flags), FakeWorkerSocket(worker), worker.info, metrics)
    deltas: list[str] = []
    for suffix in ("", "-again"):
        for rid, prompt, sampling in workload(runner.info().vocab_size):
            msg = engine_pb2.TokenizedRequest(
                rid=rid + suffix, input_ids=pack_i32(prompt), sampling=sampling
            )
            sched.add_request(FRONTEND, msg)
        while sched.step() or sched.has_requests():
            deltas += [_text(d) for batch in sched.outbox.take().values() for d in batch]
        deltas += [_text(d) for batch in sched.outbox.take().values() for d in batch]
    sched.check_idle()
    labels = {"model_name": "replay", "engine": "0"}
    counts = {
        name: metrics.registry.get_sample_value(f"radixserve:{name}_total", labels) or 0
        for name in ("num_retracted_requests", "spec_decode_num_accepted_tokens")
    }
    return {"batches": worker.batches, "deltas": deltas, "counts": counts}


def freeze_clocks() -> None:
    """Every clock ticks 1 ms per reading: the scheduler's time-based choices (waiting
    times, step costs) then repeat exactly from run to run."""
    ticks = itertools.count()
    for name in ("time", "monotonic", "perf_counter"):
        setattr(time, name, lambda: 1e6 + next(ticks) * 1e-3)


def synchronous_grammars() -> None:
    """Grammars compile on the worker's threads, so when one is ready depends on the
    machine: the replay waits for each compile where it starts."""
    from services.worker.grammar.compiler import GrammarCompiler

    submit = GrammarCompiler.submit

    def compiled_now(self: GrammarCompiler, c):  # type: ignore[no-untyped-def]
        fut = submit(self, c)
        fut.result()
        return fut

    GrammarCompiler.submit = compiled_now  # type: ignore[method-assign]


def main() -> None:
    freeze_clocks()
    synchronous_grammars()
    record = {name: replay(*config) for name, config in CONFIGS.items()}
    Path(sys.argv[1]).write_text(json.dumps(record, indent=1, sort_keys=True))
    for name, r in record.items():
        print(f"{name}: {len(r['batches'])} batches, {len(r['deltas'])} deltas, {r['counts']}")


if __name__ == "__main__":
    main()
