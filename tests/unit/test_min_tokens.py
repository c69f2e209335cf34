"""min_tokens in every layer that sees it: the worker's mask, the scheduler's stop check and
request checks, the frontend's validation and stop strings, the HTTP bodies' mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.internal.v1 import engine_pb2
from radixserve.v1 import generation_pb2 as pb
from services.common.config import WorkerConfig
from services.common.transport import pack_i32
from services.frontend.engine_messages import sampling_to_engine
from services.frontend.stop_strings import StopStringMatcher, feed_tokens
from services.frontend.validation import ValidationError, validate_sampling
from services.scheduler.request import Req
from services.scheduler.request_checks import sampling_problem
from services.worker import wire
from services.worker.model_runner import ModelRunner
from services.worker.sampling import Sampler
from services.worker.wire import Limits, decode_request, sampling_spec

VOCAB = 32
EOS, STOP, OTHER = 5, 9, 7


def eos_argmax_logits(rows: int) -> torch.Tensor:
    """EOS best, then the stop id, then OTHER: every row's greedy choice is EOS."""
    logits = torch.zeros(rows, VOCAB)
    logits[:, EOS], logits[:, STOP], logits[:, OTHER] = 10.0, 9.0, 8.0
    return logits


def sampler(specs: list[engine_pb2.SamplingParams]) -> Sampler:
    s = Sampler(len(specs), VOCAB, torch.device("cpu"), random_seed=0)
    for slot, p in enumerate(specs):
        s.reset_slot(slot, sampling_spec(p, [EOS]), np.zeros(0, dtype=np.int32))
    return s


def greedy(**kw) -> engine_pb2.SamplingParams:
    return engine_pb2.SamplingParams(temperature=0.0, **kw)


def test_eos_and_stop_ids_are_masked_until_min_tokens():
    s = sampler([greedy(min_tokens=3, stop_token_ids=[STOP]), greedy()])
    seen = [s.sample(eos_argmax_logits(2), [0, 1]).token_ids for _ in range(5)]
    # Slot 0: neither EOS nor its stop id for its first 3 tokens, EOS from the 4th on.
    assert [row[0] for row in seen] == [OTHER, OTHER, OTHER, EOS, EOS]
    assert [row[1] for row in seen] == [EOS] * 5  # its neighbour is untouched
    assert not s.below_min


def test_ignore_eos_leaves_eos_unmasked_and_logprobs_stay_raw():
    s = sampler([greedy(min_tokens=2, ignore_eos=True, stop_token_ids=[STOP], logprobs=True)])
    logits = eos_argmax_logits(1)
    out = s.sample(logits, [0])
    assert out.token_ids == [EOS]  # EOS does not end an ignore_eos output: nothing to mask
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[0, EOS].item())
    assert sampling_spec(greedy(min_tokens=2, ignore_eos=True), [EOS]).min_tokens_ban == ()


def test_sampled_rows_never_take_a_masked_token():
    p = engine_pb2.SamplingParams(temperature=1.0, min_tokens=50, stop_token_ids=[STOP])
    s = sampler([p] * 8)
    for _ in range(20):
        ids = s.sample(eos_argmax_logits(8), list(range(8))).token_ids
        assert EOS not in ids and STOP not in ids


def test_retracted_request_counts_its_tokens_so_far():
    s = Sampler(1, VOCAB, torch.device("cpu"), random_seed=0)
    s.reset_slot(0, sampling_spec(greedy(min_tokens=3), [EOS]), np.array([1, 2], np.int32))
    assert s.sample(eos_argmax_logits(1), [0]).token_ids == [STOP]  # 3rd: EOS masked
    assert s.sample(eos_argmax_logits(1), [0]).token_ids == [EOS]  # 4th


def test_a_row_with_nothing_else_allowed_keeps_its_logits():
    """A finished grammar allows only EOS: the constraint's end wins over min_tokens."""
    s = sampler([greedy(min_tokens=4)])
    allowed = torch.zeros(1, VOCAB, dtype=torch.bool)
    allowed[0, EOS] = True
    assert s.sample(eos_argmax_logits(1), [0], allowed).token_ids == [EOS]


def test_no_min_tokens_no_mask_state():
    s = sampler([greedy(), greedy(min_tokens=0, stop_token_ids=[STOP])])
    assert not s.below_min
    assert sampling_spec(greedy(stop_token_ids=[STOP]), [EOS]).min_tokens_ban == ()


def scheduler_req(**kw) -> Req:
    return Req(
        rid="r",
        identity=b"",
        input_ids=[1, 2],
        sampling=greedy(**kw),
        eos_token_ids=frozenset({EOS}),
    )


@pytest.mark.parametrize("token", [EOS, STOP])
def test_scheduler_stops_on_eos_only_past_min_tokens(token):
    req = scheduler_req(min_tokens=2, stop_token_ids=[STOP])
    req.output_ids = [OTHER, token]  # a token at position 2 (of 2): still under the floor
    assert req.stop_reason(token, 1000) == ("", -1)
    req.output_ids = [OTHER, OTHER, token]
    assert req.stop_reason(token, 1000) == ("stop", token)


def test_scheduler_lets_a_constraint_end_before_min_tokens():
    req = scheduler_req(min_tokens=5)
    req.sampling.constraint.regex = "a"
    req.output_ids = [EOS]
    assert req.stop_reason(EOS, 1000) == ("stop", EOS)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"min_tokens": -1}, "sampling.min_tokens: must be >= 0, got -1"),
        (
            {"min_tokens": 9, "max_tokens": 8},
            "sampling.min_tokens: must be <= max_tokens (8), got 9",
        ),
        ({"min_tokens": 129}, "must be <= the default max_tokens (128), got 129"),
    ],
)
def test_bad_min_tokens_refused_by_frontend_and_scheduler(kw, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_sampling(pb.SamplingParams(**kw), VOCAB)
    assert message in sampling_problem(engine_pb2.SamplingParams(**kw), prompt_len=4)


def test_good_min_tokens_pass_and_reach_the_engine():
    sp = pb.SamplingParams(min_tokens=8, max_tokens=8)
    validate_sampling(sp, VOCAB)
    assert sampling_problem(sampling_to_engine(sp), prompt_len=4) == ""
    assert sampling_to_engine(sp).min_tokens == 8
    assert not sampling_to_engine(pb.SamplingParams()).HasField("min_tokens")


# ---- stop strings (vLLM: a stop string must end after the first min_tokens tokens) ----


def run_tokens(pieces: list[str], stops: list[str], min_tokens: int, step: int = 1) -> str:
    """Feeds ``pieces`` (one string per token) ``step`` tokens at a time; the shown text."""
    m, shown = StopStringMatcher(stops), ""
    ids = list(range(len(pieces)))
    for i in range(0, len(ids), step):
        if m.matched is not None:
            break
        shown += feed_tokens(
            m, lambda t: "".join(pieces[j] for j in t), ids[i : i + step], i, min_tokens
        )
    return shown + (m.flush() if m.matched is None else "")


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stop_strings_wait_for_min_tokens(step):
    pieces = [" is", " L", "ee", ",", " and", " I", "'m", " a", " stud", "ent"]
    assert run_tokens(pieces, ["e"], 0, step) == " is L"
    # vLLM's case: with min_tokens 5 the first "e" that ends after token 5 stops it.
    assert run_tokens(pieces, ["e"], 5, step) == " is Lee, and I'm a stud"


@pytest.mark.parametrize("step", [1, 3])
def test_a_stop_string_may_start_under_the_floor(step):
    pieces = ["x", "ST", "OP", "y", "z"]
    assert run_tokens(pieces, ["STOP"], 2, step) == "x"  # ends in token 3: it counts
    assert run_tokens(pieces, ["STOP"], 3, step) == "xSTOPyz"  # ends in token 3: too early


# ---- the worker's wire: what it masks, and a peer's bad ids ----------------------------


def forward_request(min_tokens: int, eos: list[int], **kw) -> engine_pb2.ForwardRequest:
    return engine_pb2.ForwardRequest(
        req_slot=0,
        input_ids=np.array([1, 2], dtype="<i4").tobytes(),
        out_slots=np.array([1, 2], dtype="<i4").tobytes(),
        is_new=True,
        sample=True,
        sampling=greedy(min_tokens=min_tokens, **kw),
        eos_token_ids=eos,
    )


def test_wire_bans_eos_and_stop_ids_and_checks_them():
    limits = Limits(max_running_requests=4, max_context=64, vocab_size=VOCAB, num_slots=16)
    req = decode_request(forward_request(3, [EOS, 2], stop_token_ids=[STOP]), False, limits)
    assert req.start is not None and req.start.sampling.min_tokens_ban == (2, EOS, STOP)
    req = decode_request(forward_request(0, [EOS], stop_token_ids=[STOP]), False, limits)
    assert req.start is not None and req.start.sampling.min_tokens_ban == ()
    with pytest.raises(ValueError, match="min_tokens masks a token outside the vocabulary"):
        decode_request(forward_request(3, [VOCAB + 1]), False, limits)


def test_a_rewritten_slot_counts_the_token_sampled_but_unseen(tiny_llama_dir):
    """Overlap schedule: a row rewritten (is_new) while its last sample is still in flight
    to the scheduler feeds that token back; it counts toward min_tokens (and penalties)."""
    runner = ModelRunner(
        WorkerConfig(
            model_path=str(tiny_llama_dir),
            device="cpu",
            max_total_tokens=64,
            max_running_requests=2,
        )
    )
    prompt, sp = [5, 17, 42, 8], greedy(min_tokens=2, stop_token_ids=[3])
    first = engine_pb2.ForwardRequest(
        req_slot=0, input_ids=pack_i32(prompt), out_slots=pack_i32([1, 2, 3, 4]), is_new=True,
        sample=True, sampling=sp,
    )  # fmt: skip
    wire.forward(runner, engine_pb2.ForwardBatch(batch_id=1, reqs=[first]))
    again = engine_pb2.ForwardRequest(
        req_slot=0, prefix_len=4, out_slots=pack_i32([5]), is_new=True, sample=True,
        prefix_slots=pack_i32([1, 2, 3, 4]), sampling=sp, use_last_sampled=True,
    )  # fmt: skip
    batch = engine_pb2.ForwardBatch(batch_id=2, is_decode=True, reqs=[again])
    wire.forward(runner, batch)
    assert runner.sampler.num_generated[0] == 2 and not runner.sampler.below_min
