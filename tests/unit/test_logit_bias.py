"""logit_bias end to end in pieces: the sampler adds it (greedy included), the worker's wire
and the scheduler check what a peer sends, the frontend validates it and the OpenAI and
SGLang bodies map their ``{"token id": bias}`` onto it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.internal.v1 import engine_pb2
from radixserve.v1 import generation_pb2 as pb
from services.common.sampling_limits import MAX_LOGIT_BIAS
from services.frontend.engine_messages import sampling_to_engine
from services.frontend.native_protocol import parse_generate
from services.frontend.openai_errors import ApiError
from services.frontend.openai_protocol import (
    CompletionRequest,
    check_unserved,
    completion_to_request,
)
from services.frontend.validation import ValidationError, validate_sampling
from services.scheduler.request_checks import request_problem
from services.worker.sampling import Sampler
from services.worker.wire import Limits, decode_request, sampling_spec

VOCAB = 32


def biased(bias: dict[int, float], **kw) -> engine_pb2.SamplingParams:
    entries = [engine_pb2.LogitBias(token_id=t, bias=b) for t, b in bias.items()]
    return engine_pb2.SamplingParams(logit_bias=entries, **kw)


def sampler(specs: list[engine_pb2.SamplingParams]) -> Sampler:
    s = Sampler(len(specs), VOCAB, torch.device("cpu"), random_seed=0)
    for slot, p in enumerate(specs):
        s.reset_slot(slot, sampling_spec(p), np.zeros(0, dtype=np.int32))
    return s


def logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 5


# ---- the sampler -------------------------------------------------------------------------


def test_greedy_plus_100_picks_the_token_and_minus_100_bans_it():
    x = logits(3)
    best = x.argmax(-1).tolist()
    forced = [(b + 1) % VOCAB for b in best]
    s = sampler([biased({forced[0]: 100}, temperature=0), biased({best[1]: -100}, temperature=0),
                 engine_pb2.SamplingParams(temperature=0)])  # fmt: skip
    out = s.sample(x, [0, 1, 2]).token_ids
    assert out[0] == forced[0]
    assert out[1] == x[1].topk(2).indices[1].item()  # the best is banned: the runner-up
    assert out[2] == best[2]  # a row without a bias is untouched


def test_sampled_rows_never_draw_a_banned_token():
    x = torch.zeros(8, VOCAB)
    x[:, 3] = 6.0  # token 3 would take ~90 % of the mass
    s = sampler([biased({3: -100}, temperature=1.0)] * 8)
    for _ in range(20):
        assert 3 not in s.sample(x, list(range(8))).token_ids
    s = sampler([biased({5: 100}, temperature=1.0)] * 8)
    assert s.sample(x, list(range(8))).token_ids == [5] * 8


def test_a_bias_cannot_revive_a_token_the_grammar_forbids():
    s = sampler([biased({4: 100}, temperature=0)])
    allowed = torch.zeros(1, VOCAB, dtype=torch.bool)
    allowed[0, 7] = True
    assert s.sample(logits(1), [0], allowed).token_ids == [7]


def test_logprobs_stay_the_models_own():
    x = logits(1)
    out = sampler([biased({4: 100}, temperature=0, logprobs=True)]).sample(x, [0])
    assert out.token_ids == [4]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(x, -1)[0, 4].item())


def test_a_slot_forgets_the_bias_of_its_last_request():
    s = sampler([biased({4: 100}, temperature=0)])
    s.reset_slot(0, sampling_spec(engine_pb2.SamplingParams(temperature=0)), np.zeros(0, np.int32))
    assert not s.biases
    x = logits(1)
    assert s.sample(x, [0]).token_ids == [x.argmax().item()]


# ---- what a peer may send ------------------------------------------------------------------


def forward_request(p: engine_pb2.SamplingParams) -> engine_pb2.ForwardRequest:
    return engine_pb2.ForwardRequest(
        req_slot=0,
        input_ids=np.array([1], dtype="<i4").tobytes(),
        out_slots=np.array([1], dtype="<i4").tobytes(),
        is_new=True,
        sample=True,
        sampling=p,
    )


def test_the_worker_takes_the_pairs_and_refuses_ids_outside_its_vocabulary():
    limits = Limits(max_running_requests=2, max_context=64, vocab_size=VOCAB, num_slots=8)
    req = decode_request(forward_request(biased({3: 1.5, 9: -100})), False, limits)
    assert req.start is not None and req.start.sampling.logit_bias == ((3, 1.5), (9, -100.0))
    with pytest.raises(ValueError, match="logit_bias names a token outside the vocabulary"):
        decode_request(forward_request(biased({VOCAB: 1})), False, limits)
    with pytest.raises(ValueError, match="logit_bias is outside"):
        decode_request(forward_request(biased({3: float("nan")})), False, limits)


@pytest.mark.parametrize(
    ("bias", "words"),
    [
        ({VOCAB: 1.0}, "logit_bias: token id 32 is outside the vocabulary [0, 32)"),
        ({1: 101.0}, "sampling.logit_bias: the bias of token 1 must be in [-100, 100]"),
    ],
)
def test_the_scheduler_refuses_what_the_frontend_would(bias, words):
    msg = engine_pb2.TokenizedRequest(rid="r", sampling=biased(bias))
    assert words in request_problem(msg, np.array([1, 2]), VOCAB)


def test_the_scheduler_bounds_the_entries():
    many = [engine_pb2.LogitBias(token_id=i % VOCAB, bias=0) for i in range(MAX_LOGIT_BIAS + 1)]
    msg = engine_pb2.TokenizedRequest(rid="r", sampling=engine_pb2.SamplingParams(logit_bias=many))
    assert f"at most {MAX_LOGIT_BIAS} entries" in request_problem(msg, np.array([1]), VOCAB)


# ---- the frontend ------------------------------------------------------------------------


def public(entries: list[tuple[int, float]]) -> pb.SamplingParams:
    return pb.SamplingParams(logit_bias=[pb.LogitBias(token_id=t, bias=b) for t, b in entries])


@pytest.mark.parametrize(
    ("entries", "words"),
    [
        ([(VOCAB, 1.0)], "token id 32 is outside the vocabulary [0, 32)"),
        ([(1, -100.5)], "must be in [-100, 100], got -100.5"),
        ([(1, float("inf"))], "must be in [-100, 100]"),
        ([(1, 1.0), (1, 2.0)], "token 1 is given twice"),
        ([(i, 1.0) for i in range(MAX_LOGIT_BIAS + 1)], f"at most {MAX_LOGIT_BIAS} entries"),
    ],
)
def test_validation_names_logit_bias(entries, words):
    with pytest.raises(ValidationError) as e:
        validate_sampling(public(entries), VOCAB if entries[0][0] == VOCAB else 4096)
    assert e.value.field == "sampling.logit_bias" and words in str(e.value)


def test_the_limits_themselves_are_fine_and_reach_the_engine():
    sp = public([(0, -100.0), (VOCAB - 1, 100.0)])
    validate_sampling(sp, VOCAB)
    engine = sampling_to_engine(sp)
    assert [(e.token_id, e.bias) for e in engine.logit_bias] == [(0, -100.0), (VOCAB - 1, 100.0)]


def test_openai_bodies_map_their_object_and_name_a_bad_key():
    body = CompletionRequest(prompt="x", logit_bias={"5": 2.5, "17": -100})
    check_unserved(body)  # no longer refused
    req = completion_to_request(body)
    assert [(e.token_id, e.bias) for e in req.sampling.logit_bias] == [(5, 2.5), (17, -100.0)]
    assert not completion_to_request(
        CompletionRequest(prompt="x", logit_bias={})
    ).sampling.logit_bias
    for key in ("x", "-1", "1.5", str(2**31)):
        with pytest.raises(ApiError) as e:
            completion_to_request(CompletionRequest(prompt="x", logit_bias={key: 1}))
        assert e.value.param == "logit_bias" and "token ids" in e.value.message


def test_native_bodies_map_their_object_and_name_a_bad_key():
    body = {"text": "x", "sampling_params": {"logit_bias": {"3": 1.0}}}
    sp = parse_generate(body).items[0].req.sampling
    assert [(e.token_id, e.bias) for e in sp.logit_bias] == [(3, 1.0)]
    with pytest.raises(ApiError) as e:
        parse_generate({"text": "x", "sampling_params": {"logit_bias": {"a": 1.0}}})
    assert e.value.message.startswith("sampling_params.logit_bias:")
