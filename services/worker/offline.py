"""In-process generation through a ModelRunner, with trivial slot bookkeeping (no scheduler).

The reference the end-to-end tests compare served tokens with, and the in-process
baseline of the streaming benchmark. Prompts run in waves of max_running_requests: one
prefill batch, then decode batches until every request has max_new_tokens (or hit EOS).
Request i of a wave owns the contiguous KV slots

    base_i + 1 .. base_i + len(prompt_i) + max_new_tokens    (base_i = sum of earlier spans)
"""

from __future__ import annotations

from radixserve.internal.v1 import engine_pb2
from services.common.transport import pack_i32
from services.worker.model_runner import ModelRunner


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: engine_pb2.SamplingParams | None = None,
    stop_at_eos: bool = True,
) -> list[list[int]]:
    """The generated tokens of each prompt (an EOS token, when hit, is the last one).

    ``sampling`` None means greedy (the server's default for an unset temperature is 1.0)."""
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


def _generate_wave(runner, prompts, max_new_tokens, sampling, eos) -> list[list[int]]:
    info = runner.info()
    spans = [len(p) + max_new_tokens for p in prompts]
    if sum(spans) > info.max_total_num_tokens:
        raise ValueError(f"{sum(spans)} KV slots needed, the pool has {info.max_total_num_tokens}")
    if max(spans) > info.max_model_len:
        raise ValueError(
            f"prompt + max_new_tokens {max(spans)} exceeds max_model_len {info.max_model_len}"
        )
    bases = [1 + sum(spans[:i]) for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    prefill = engine_pb2.ForwardBatch(batch_id=0, is_decode=False)
    for i, prompt in enumerate(prompts):
        req = prefill.reqs.add(
            req_slot=i,
            input_ids=pack_i32(prompt),
            prefix_len=0,
            out_slots=pack_i32(range(bases[i], bases[i] + len(prompt))),
            is_new=True,
            sample=True,
            rid=f"offline-{i}",
        )
        req.sampling.CopyFrom(sampling)
    _append(outputs, runner.forward(prefill), list(range(len(prompts))))
    step = 1
    while True:
        active = [
            i for i, out in enumerate(outputs) if len(out) < max_new_tokens and out[-1] not in eos
        ]
        if not active:
            return outputs
        batch = engine_pb2.ForwardBatch(batch_id=step, is_decode=True)
        for i in active:
            pos = len(prompts[i]) + len(outputs[i]) - 1  # the last sampled token's position
            batch.reqs.add(
                req_slot=i,
                input_ids=pack_i32([outputs[i][-1]]),
                prefix_len=pos,
                out_slots=pack_i32([bases[i] + pos]),
                sample=True,
            )
        _append(outputs, runner.forward(batch), active)
        step += 1


def _append(outputs: list[list[int]], result: engine_pb2.ForwardResult, rows: list[int]) -> None:
    for i, tok in zip(rows, result.tokens, strict=True):
        outputs[i].append(tok.token_id)
