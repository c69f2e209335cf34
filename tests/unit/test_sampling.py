"""The sampler: greedy, seeds, truncation (top-k/top-p/min-p), penalties, allowed mask,
logprobs; and the wire's SamplingParams -> SamplingSpec defaults."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.internal.v1 import engine_pb2
from services.worker.sampling import Sampler, SamplingSpec, exponential_noise, step_seed
from services.worker.wire import sampling_spec

VOCAB = 50
ROWS = 64


def sampler_with(
    params: engine_pb2.SamplingParams, rows: int = ROWS, output_ids=(), seed: int = 0
) -> Sampler:
    s = Sampler(rows, VOCAB, torch.device("cpu"), random_seed=seed)
    for r in range(rows):
        s.reset_slot(r, sampling_spec(params), np.asarray(output_ids, dtype=np.int32))
    return s


def logits_rows(rows: int = ROWS, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def draw(s: Sampler, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> list[int]:
    return s.sample(logits, list(range(logits.shape[0])), allowed).token_ids


def test_defaults_of_unset_fields():
    spec = sampling_spec(engine_pb2.SamplingParams())
    assert (spec.temperature, spec.top_p, spec.top_k, spec.min_p) == (1.0, 1.0, 0, 0.0)
    assert (spec.repetition_penalty, spec.frequency_penalty, spec.presence_penalty) == (
        1.0,
        0.0,
        0.0,
    )
    assert spec.seed is None and not spec.greedy and not spec.logprobs


def test_temperature_zero_is_argmax():
    logits = logits_rows()
    s = sampler_with(engine_pb2.SamplingParams(temperature=0.0))
    assert draw(s, logits) == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_and_retraction_proof():
    params = engine_pb2.SamplingParams(temperature=1.0, seed=1234)
    logits = [logits_rows(4, seed=i) for i in range(6)]
    a, b = sampler_with(params, rows=4), sampler_with(params, rows=4, seed=99)
    run_a = [draw(a, x) for x in logits]
    assert run_a == [draw(b, x) for x in logits]  # worker seed does not matter
    # Back after a retraction with 3 tokens generated: step 3 onwards draws the same.
    c = sampler_with(params, rows=4, output_ids=[1, 2, 3])
    assert [draw(c, x) for x in logits[3:]] == run_a[3:]
    other = sampler_with(engine_pb2.SamplingParams(temperature=1.0, seed=4321), rows=4)
    assert [draw(other, x) for x in logits] != run_a
    assert step_seed(1, 0) != step_seed(1, 1) != step_seed(2, 0)


def test_sampling_covers_support_without_truncation():
    s = sampler_with(engine_pb2.SamplingParams(temperature=1.0))
    flat = torch.zeros(ROWS, VOCAB)
    seen = {t for _ in range(5) for t in draw(s, flat)}
    assert len(seen) > 25


@pytest.mark.parametrize(
    "params, allowed",
    [
        (engine_pb2.SamplingParams(top_k=3), {0, 1, 2}),
        (engine_pb2.SamplingParams(top_p=0.7), {0, 1}),  # 0.4 + 0.3 reaches 0.7
        (engine_pb2.SamplingParams(min_p=0.5), {0, 1}),  # p >= 0.5 * 0.4
    ],
)
def test_truncation_restricts_support(params, allowed):
    probs = torch.tensor([0.4, 0.3, 0.1] + [0.2 / (VOCAB - 3)] * (VOCAB - 3))
    logits = probs.log().expand(ROWS, VOCAB).clone()
    s = sampler_with(params)
    seen = {t for _ in range(10) for t in draw(s, logits)}
    assert seen == allowed


def test_penalties_change_logits_as_specified():
    params = engine_pb2.SamplingParams(
        repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    s = sampler_with(params, rows=1, output_ids=[3, 3, 3, 7])
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 7], logits[0, 9] = 4.0, -1.0, 2.0
    out = s.apply_penalties(logits, [0])[0]
    assert out[3].item() == pytest.approx(4.0 / 2 - 0.5 * 3 - 0.25)
    assert out[7].item() == pytest.approx(-1.0 * 2 - 0.5 * 1 - 0.25)
    assert out[9].item() == 2.0  # never generated: untouched
    assert logits[0, 3].item() == 4.0  # input not modified


def test_penalty_counts_follow_generated_tokens():
    s = sampler_with(engine_pb2.SamplingParams(temperature=0.0, presence_penalty=2.0), rows=1)
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 1.0, 0.5
    assert draw(s, logits) == [5]
    assert draw(s, logits) == [6]  # 5 now penalised below 6


def test_allowed_mask_is_respected():
    allowed = torch.zeros(2, VOCAB, dtype=torch.bool)
    allowed[0, [3, 17]] = True
    allowed[1] = True  # an unconstrained row
    logits = logits_rows(2)
    logits[:, 3], logits[:, 17] = -5.0, -6.0  # allowed, but far from the max
    before = logits.clone()
    s = sampler_with(engine_pb2.SamplingParams(temperature=0.0), rows=2)
    assert draw(s, logits, allowed) == [3, int(logits[1].argmax())]
    assert torch.equal(logits, before)  # the caller's logits are not modified
    sampled = sampler_with(engine_pb2.SamplingParams(temperature=1.0))
    only = allowed[:1].expand(ROWS, VOCAB)
    seen = {t for _ in range(3) for t in draw(sampled, logits_rows(), only)}
    assert seen <= {3, 17}


def test_logprobs_are_log_softmax_of_raw_logits():
    params = engine_pb2.SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5)
    logits = logits_rows(3)
    out = sampler_with(params, rows=3).sample(logits, [0, 1, 2])
    ref = torch.log_softmax(logits, -1)
    for i in range(3):
        assert out.logprobs[i] == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-6)
        vals, ids = ref[i].topk(5)
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert [v for _, v in out.top_logprobs[i]] == pytest.approx(vals.tolist(), abs=1e-6)
    plain = sampler_with(engine_pb2.SamplingParams(temperature=0.0), rows=1).sample(logits[:1], [0])
    assert plain.logprobs == [None] and plain.top_logprobs == [None]


def test_seeded_generation_ignores_batch_company(tiny_llama_dir):
    """Through the runner: a seeded request draws the same tokens alone or batched."""
    from services.common.config import WorkerConfig
    from services.worker.model_runner import ModelRunner
    from services.worker.offline import generate

    runner = ModelRunner(
        WorkerConfig(
            model_path=str(tiny_llama_dir),
            device="cpu",
            max_total_tokens=512,
            max_running_requests=4,
        )
    )
    params = engine_pb2.SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    prompt, other = [5, 6, 7, 8], [40, 41]
    alone = generate(runner, [prompt], 10, params, stop_at_eos=False)[0]
    batched = generate(runner, [other, prompt], 10, params, stop_at_eos=False)[1]
    assert alone == batched
    assert len(set(alone)) > 3


def test_batched_noise_draws_follow_the_probabilities():
    """argmax(p / Exp(1)) with the hashed noise picks token i with probability p_i (one
    batched call of 40,000 rows, each with its own key), and the noise is a pure function of
    (key, token): the same bits again, and independent of the batch around a row."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    keys = torch.arange(40_000, dtype=torch.int64) * 7919 + 12345
    noise = exponential_noise(keys, 4)
    picks = torch.argmax(probs[None, :] / noise, dim=-1)
    freq = torch.bincount(picks, minlength=4).double() / len(keys)
    torch.testing.assert_close(freq, probs.double(), atol=0.01, rtol=0)
    assert torch.equal(exponential_noise(keys[5:9], 4), noise[5:9])
    assert (noise > 0).all() and torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 1.0) < 0.02  # Exp(1)


@pytest.mark.parametrize("temperature", [1e-38, 1e-20, 1e-6])
def test_tiny_temperature_is_greedy_not_nan(temperature):
    sampler = Sampler(2, 50, torch.device("cpu"), random_seed=0)
    sampler.reset_slot(0, SamplingSpec(temperature=temperature), np.zeros(0, np.int32))
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3)) * 30
    assert sampler.sample(logits, [0]).token_ids == [int(logits.argmax())]
