"""In-process generation through a ModelRunner, with trivial slot bookkeeping (no scheduler).

The end-to-end tests' reference: prompts run in waves of max_running_requests, each
request owning a contiguous span of KV slots. Batches go through wire.forward as protobuf,
so a reference that agrees with the server proves the wire path too.
"""

from __future__ import annotations

import itertools

from radixserve.internal.v1 import engine_pb2
from services.common.transport import pack_i32
from services.worker import wire
from services.worker.batch import RunnerInfo


def generate(
    runner: wire.Runner,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: engine_pb2.SamplingParams | None = None,
    stop_at_eos: bool = True,
) -> list[list[int]]:
    """The generated tokens of each prompt (a hit EOS is the last). ``sampling`` None:
    greedy (unlike the server's default temperature 1.0)."""
    if sampling is None:
        sampling = engine_pb2.SamplingParams(temperature=0.0)
    info = runner.info()
    eos = set(info.eos_token_ids) if stop_at_eos else set()
    outputs: list[list[int]] = []
    wave = info.max_running_requests
    for start in range(0, len(prompts), wave):
        outputs += _generate_wave(
            runner, prompts[start : start + wave], max_new_tokens, sampling, eos
        )
    return outputs


def _generate_wave(
    runner: wire.Runner,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: engine_pb2.SamplingParams,
    eos: set[int],
) -> list[list[int]]:
    bases = _slot_bases(runner.info(), prompts, max_new_tokens)
    outputs: list[list[int]] = [[] for _ in prompts]
    prefill = _prefill_batch(prompts, bases, sampling)
    _append(outputs, wire.forward(runner, prefill), list(range(len(prompts))))
    for step in itertools.count(1):
        active = [
            i for i, out in enumerate(outputs) if len(out) < max_new_tokens and out[-1] not in eos
        ]
        if not active:
            break
        batch = _decode_batch(step, [(i, prompts[i], outputs[i], bases[i]) for i in active])
        _append(outputs, wire.forward(runner, batch), active)
    return outputs


def _slot_bases(info: RunnerInfo, prompts: list[list[int]], max_new_tokens: int) -> list[int]:
    spans = [len(p) + max_new_tokens for p in prompts]
    if sum(spans) > info.max_total_num_tokens:
        raise ValueError(f"{sum(spans)} KV slots needed, the pool has {info.max_total_num_tokens}")
    if max(spans) > info.max_model_len:
        raise ValueError(
            f"prompt + max_new_tokens {max(spans)} exceeds max_model_len {info.max_model_len}"
        )
    return [1 + sum(spans[:i]) for i in range(len(prompts))]


def _prefill_batch(
    prompts: list[list[int]], bases: list[int], sampling: engine_pb2.SamplingParams
) -> engine_pb2.ForwardBatch:
    batch = engine_pb2.ForwardBatch(batch_id=0, is_decode=False)
    for i, prompt in enumerate(prompts):
        req = batch.reqs.add(
            req_slot=i,
            input_ids=pack_i32(prompt),
            prefix_len=0,
            out_slots=pack_i32(range(bases[i], bases[i] + len(prompt))),
            is_new=True,
            sample=True,
            rid=f"offline-{i}",
        )
        req.sampling.CopyFrom(sampling)
    return batch


def _decode_batch(
    step: int, rows: list[tuple[int, list[int], list[int], int]]
) -> engine_pb2.ForwardBatch:
    """One new token per (req_slot, prompt, output so far, first KV slot): the last sampled."""
    batch = engine_pb2.ForwardBatch(batch_id=step, is_decode=True)
    for req_slot, prompt, output, base in rows:
        pos = len(prompt) + len(output) - 1  # the last sampled token's position
        batch.reqs.add(
            req_slot=req_slot,
            input_ids=pack_i32([output[-1]]),
            prefix_len=pos,
            out_slots=pack_i32([base + pos]),
            sample=True,
        )
    return batch


def _append(outputs: list[list[int]], result: engine_pb2.ForwardResult, rows: list[int]) -> None:
    for i, tok in zip(rows, result.tokens, strict=True):
        outputs[i].append(tok.token_id)
