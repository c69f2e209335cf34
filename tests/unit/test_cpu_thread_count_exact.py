"""The CPU worker's numbers do not depend on its thread count: `--cpu-wait adaptive` runs
each batch size with every thread or one fewer (services/worker/cpu_threads.py), so a
request's logits must be bit-identical whichever count its steps ran with."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.internal.v1 import engine_pb2
from services.common.config import WorkerConfig
from services.common.transport import pack_i32
from services.worker import wire
from services.worker.model_runner import ModelRunner

BATCH, PROMPT, STEPS = 4, 40, 4


def logits_of_a_run(path, dtype: str, threads: list[int]) -> list[torch.Tensor]:
    """A prefill of BATCH prompts, then STEPS decode steps, step i on threads[i]; every
    logits tensor the model computed."""
    torch.set_num_threads(threads[0])
    cfg = WorkerConfig(model_path=str(path), device="cpu", dtype=dtype, max_total_tokens=4096)
    runner = ModelRunner(cfg)
    seen: list[torch.Tensor] = []
    compute = runner.model.compute_logits
    runner.model.compute_logits = lambda h: seen.append(compute(h).clone()) or seen[-1]
    rng = random.Random(0)
    prefill, slot = engine_pb2.ForwardBatch(batch_id=1), 1
    for i in range(BATCH):
        ids = [rng.randrange(3, runner.vocab_size) for _ in range(PROMPT)]
        prefill.reqs.add(
            req_slot=i, input_ids=pack_i32(ids), out_slots=pack_i32(range(slot, slot + PROMPT)),
            is_new=True, sample=True, sampling=engine_pb2.SamplingParams(temperature=0.0),
        )  # fmt: skip
        slot += PROMPT
    wire.forward(runner, prefill)
    for step, n in enumerate(threads[1:]):
        torch.set_num_threads(n)
        batch = engine_pb2.ForwardBatch(batch_id=step + 2, is_decode=True)
        for i in range(BATCH):
            batch.reqs.add(
                req_slot=i, input_ids=pack_i32([3 + step]), prefix_len=PROMPT + step,
                out_slots=pack_i32([slot]), sample=True,
            )  # fmt: skip
            slot += 1
        wire.forward(runner, batch)
    return seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_are_the_same_with_one_thread_or_two(tiny_llama_dir, dtype):
    before = torch.get_num_threads()
    try:
        fixed = logits_of_a_run(tiny_llama_dir, dtype, [2] * (STEPS + 1))
        mixed = logits_of_a_run(tiny_llama_dir, dtype, [1, 2, 1, 2, 1][: STEPS + 1])
    finally:
        torch.set_num_threads(before)
    assert len(fixed) == len(mixed) == STEPS + 1
    for a, b in zip(fixed, mixed, strict=True):
        assert torch.equal(a, b)
