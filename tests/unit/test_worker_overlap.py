"""The worker side of the overlap schedule: a decode whose input is the token it sampled last."""

from __future__ import annotations

import pytest

from radixserve.internal.v1 import engine_pb2
from services.common.config import WorkerConfig
from services.common.transport import pack_i32
from services.worker import wire
from services.worker.model_runner import ModelRunner

PROMPT = [5, 17, 42, 8, 99, 23, 61, 7]


def _runner(model_dir) -> ModelRunner:
    return ModelRunner(
        WorkerConfig(
            model_path=str(model_dir), device="cpu", max_total_tokens=256, max_running_requests=4
        )
    )


def _prefill(runner: ModelRunner) -> int:
    req = engine_pb2.ForwardRequest(
        req_slot=0,
        input_ids=pack_i32(PROMPT),
        prefix_len=0,
        out_slots=pack_i32(range(1, 9)),
        is_new=True,
        sample=True,
        sampling=engine_pb2.SamplingParams(temperature=0),
    )
    return wire.forward(runner, engine_pb2.ForwardBatch(batch_id=1, reqs=[req])).tokens[0].token_id


def _decode(runner: ModelRunner, batch_id: int, position: int, token: int | None) -> int:
    req = engine_pb2.ForwardRequest(
        req_slot=0, prefix_len=position, out_slots=pack_i32([position + 1]), sample=True
    )
    if token is None:
        req.use_last_sampled = True
    else:
        req.input_ids = pack_i32([token])
    return (
        wire.forward(runner, engine_pb2.ForwardBatch(batch_id=batch_id, is_decode=True, reqs=[req]))
        .tokens[0]
        .token_id
    )


def test_use_last_sampled_equals_sending_the_token(tiny_llama_dir):
    explicit, implicit = _runner(tiny_llama_dir), _runner(tiny_llama_dir)
    t_explicit, t_implicit = _prefill(explicit), _prefill(implicit)
    assert t_explicit == t_implicit
    chain_explicit, chain_implicit = [t_explicit], [t_implicit]
    for step in range(4):
        chain_explicit.append(_decode(explicit, step + 2, len(PROMPT) + step, chain_explicit[-1]))
        chain_implicit.append(_decode(implicit, step + 2, len(PROMPT) + step, None))
    assert chain_implicit == chain_explicit


def test_use_last_sampled_before_any_sample_is_refused(tiny_llama_dir):
    runner = _runner(tiny_llama_dir)
    req = engine_pb2.ForwardRequest(
        req_slot=1,
        prefix_len=0,
        out_slots=pack_i32([3]),
        is_new=True,
        sample=True,
        use_last_sampled=True,
    )
    with pytest.raises(ValueError, match="use_last_sampled"):
        wire.forward(runner, engine_pb2.ForwardBatch(batch_id=1, is_decode=True, reqs=[req]))
