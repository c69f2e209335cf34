"""Verify steps in the worker (speculative decoding): a request's last token plus k drafts
run as one small extend over its cached KV, and what comes back is exactly what decoding
one token per step would have produced.

- greedy: the accepted drafts are the longest prefix equal to the target's argmax, plus its
  next token; a whole chain of verify steps (drafts right, wrong, partly right) gives the
  tokens of plain decoding, penalties, logit_bias and min_tokens included;
- sampling: on a tiny vocabulary (16) the committed tokens follow the target's distribution
  (chi-square, fixed seed), and a seeded request draws the same tokens as without drafts;
- the wire: drafts are refused where they cannot be verified.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import make_tiny_model

from radixserve.internal.v1 import engine_pb2
from services.common.config import WorkerConfig
from services.common.transport import pack_i32
from services.worker import wire
from services.worker.model_runner import ModelRunner
from services.worker.sampling import Sampler

PROMPT = [5, 17, 42, 8, 99, 23, 61, 7, 5, 17]
STEPS = 12


def _runner(folder, slots: int = 512, rows: int = 4) -> ModelRunner:
    cfg = WorkerConfig(
        model_path=str(folder),
        device="cpu",
        dtype="float32",
        max_total_tokens=slots,
        max_running_requests=rows,
    )
    return ModelRunner(cfg)


class Seq:
    """One request driven by hand: slot row ``row``, KV slot of position p is base + p."""

    def __init__(self, runner: ModelRunner, row: int, prompt: list[int], sampling, base: int):
        self.runner, self.row, self.base = runner, row, base
        self.tokens = list(prompt)
        self.output: list[int] = []
        self.batch_id = 0
        req = self._req(prompt, 0, sample=True)
        req.is_new = True
        req.sampling.CopyFrom(sampling)
        self._commit(self._run([req], is_decode=False)[0])

    def _req(self, ids: list[int], prefix_len: int, sample: bool) -> engine_pb2.ForwardRequest:
        slots = range(self.base + prefix_len, self.base + prefix_len + len(ids))
        return engine_pb2.ForwardRequest(
            req_slot=self.row,
            input_ids=pack_i32(ids),
            prefix_len=prefix_len,
            out_slots=pack_i32(slots),
            sample=sample,
        )

    def _run(self, reqs, is_decode: bool) -> list[engine_pb2.SampledToken]:
        self.batch_id += 1
        batch = engine_pb2.ForwardBatch(batch_id=self.batch_id, is_decode=is_decode, reqs=reqs)
        return list(wire.forward(self.runner, batch).tokens)

    def _commit(self, tok: engine_pb2.SampledToken) -> list[int]:
        got = [tok.token_id, *tok.extra_token_ids]
        self.output += got
        self.tokens += got
        return got

    def decode(self) -> int:
        req = self._req([self.tokens[-1]], len(self.tokens) - 1, sample=True)
        return self._commit(self._run([req], is_decode=True)[0])[0]

    def verify_req(self, drafts: list[int]) -> engine_pb2.ForwardRequest:
        pos = len(self.tokens) - 1
        req = self._req([self.tokens[-1]], pos, sample=True)
        req.out_slots = pack_i32(range(self.base + pos, self.base + pos + 1 + len(drafts)))
        req.draft_tokens = pack_i32(drafts)
        return req

    def verify(self, drafts: list[int]) -> engine_pb2.SampledToken:
        tok = self._run([self.verify_req(drafts)], is_decode=False)[0]
        self._commit(tok)
        return tok


def _plain(runner, sampling, n: int = STEPS) -> list[int]:
    seq = Seq(runner, 0, PROMPT, sampling, base=1)
    while len(seq.output) < n:
        seq.decode()
    return seq.output[:n]


def _speculated(runner, sampling, reference: list[int], pattern: list[int]) -> list[int]:
    """Verify steps whose drafts copy the reference continuation, corrupted where ``pattern``
    says (k drafts, the (i % k)-th wrong when pattern[step] == i, all right when -1)."""
    seq = Seq(runner, 0, PROMPT, sampling, base=1)
    step = 0
    while len(seq.output) < len(reference):
        at = len(seq.output)
        k = min(3, len(reference) - at - 1)
        drafts = list(reference[at : at + k])
        wrong = pattern[step % len(pattern)]
        if 0 <= wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % 300
        before = len(seq.output)
        tok = seq.verify(drafts)
        want_accepted = k if wrong < 0 or wrong >= k else wrong
        assert len(tok.extra_token_ids) == want_accepted
        assert len(seq.output) - before == want_accepted + 1
        step += 1
    return seq.output[: len(reference)]


SAMPLINGS = {
    "greedy": engine_pb2.SamplingParams(temperature=0.0),
    "penalties": engine_pb2.SamplingParams(
        temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2
    ),
    "bias_min_tokens": engine_pb2.SamplingParams(
        temperature=0.0,
        min_tokens=6,
        stop_token_ids=[17],
        logit_bias=[engine_pb2.LogitBias(token_id=17, bias=8.0)],
    ),
    "seeded": engine_pb2.SamplingParams(temperature=0.9, top_p=0.9, seed=1234),
    "seeded_top_k_penalty": engine_pb2.SamplingParams(
        temperature=1.1, top_k=20, min_p=0.01, seed=7, repetition_penalty=1.2
    ),
}


@pytest.mark.parametrize("name", SAMPLINGS)
def test_verify_chain_equals_plain_decoding(tiny_llama_dir, name):
    sampling = SAMPLINGS[name]
    reference = _plain(_runner(tiny_llama_dir), sampling)
    for pattern in ([-1], [0], [1, -1, 2, 0]):
        got = _speculated(_runner(tiny_llama_dir), sampling, reference, pattern)
        assert got == reference, (name, pattern)


def test_verify_logprobs_are_the_decode_logprobs(tiny_llama_dir):
    sampling = engine_pb2.SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    plain = Seq(_runner(tiny_llama_dir), 0, PROMPT, sampling, base=1)
    lps = []
    for _ in range(5):
        req = plain._req([plain.tokens[-1]], len(plain.tokens) - 1, sample=True)
        tok = plain._run([req], is_decode=True)[0]
        plain._commit(tok)
        lps.append(tok.logprob)
    spec = Seq(_runner(tiny_llama_dir), 0, PROMPT, sampling, base=1)
    tok = spec.verify(plain.output[1:5])  # all 4 right: 5 tokens committed
    got = [tok.logprob, *tok.extra_logprobs]
    assert [lp.token_id for lp in got] == plain.output[1:6]
    for a, b in zip(got, lps, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]


def test_batch_mixes_verify_plain_and_prefill(tiny_llama_dir):
    """One batch: a verify step, a plain one-token step and a new prompt's prefill."""
    greedy = SAMPLINGS["greedy"]
    ref = _plain(_runner(tiny_llama_dir), greedy, 6)
    runner = _runner(tiny_llama_dir)
    a = Seq(runner, 0, PROMPT, greedy, base=1)
    b = Seq(runner, 1, PROMPT, greedy, base=101)
    c_prompt = [9, 8, 7, 6]
    plain_c = Seq(_runner(tiny_llama_dir), 0, c_prompt, greedy, base=1).output[0]
    reqs = [a.verify_req(ref[1:4]), b._req([b.tokens[-1]], len(b.tokens) - 1, sample=True)]
    c = engine_pb2.ForwardRequest(
        req_slot=2,
        input_ids=pack_i32(c_prompt),
        prefix_len=0,
        out_slots=pack_i32(range(201, 205)),
        is_new=True,
        sample=True,
        sampling=greedy,
    )
    toks = a._run([*reqs, c], is_decode=False)
    assert [toks[0].token_id, *toks[0].extra_token_ids] == ref[1:5]
    assert toks[1].token_id == ref[1] and not toks[1].extra_token_ids
    assert toks[2].token_id == plain_c


def test_drafts_refused_where_they_cannot_be_verified(tiny_llama_dir):
    runner = _runner(tiny_llama_dir)
    seq = Seq(runner, 0, PROMPT, SAMPLINGS["greedy"], base=1)
    req = seq.verify_req([3, 4])
    with pytest.raises(ValueError, match="is_decode"):
        wire.forward(runner, engine_pb2.ForwardBatch(batch_id=9, is_decode=True, reqs=[req]))
    req.sample = False
    with pytest.raises(ValueError, match="sample"):
        wire.forward(runner, engine_pb2.ForwardBatch(batch_id=9, reqs=[req]))
    req = seq.verify_req([3, 4])
    req.out_slots = pack_i32([50, 51])
    with pytest.raises(ValueError, match="out_slots"):
        wire.forward(runner, engine_pb2.ForwardBatch(batch_id=9, reqs=[req]))
    req = seq.verify_req([3, 400])
    with pytest.raises(ValueError, match="vocabulary"):
        wire.forward(runner, engine_pb2.ForwardBatch(batch_id=9, reqs=[req]))


# ---- the sampled distribution --------------------------------------------------------------

TINY_VOCAB = 16
SLOTS = 4096  # sampler rows per call
CALLS = 5  # 20,480 samples of the first token
TEMPERATURE, TOP_K = 0.7, 10


def _chi2_critical(df: int, z: float = 3.090) -> float:
    """The chi-square quantile at 1 - alpha (z = the normal quantile; 3.090: alpha 0.001),
    by Wilson and Hilferty's cube-root approximation (no scipy here)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the cells the target can reach, and its degrees of freedom
    (a cell of probability 0 must stay empty: checked)."""
    live = probs > 0
    assert counts[~live].sum() == 0, "a token the target never draws was drawn"
    n = counts.sum()
    expected = n * probs[live]
    return float(((counts[live] - expected) ** 2 / expected).sum()), int(live.sum()) - 1


def _target_probs(logits: torch.Tensor) -> np.ndarray:
    """The target distribution of one row, computed apart from the sampler: temperature,
    then top-k."""
    scaled = logits.double() / TEMPERATURE
    keep = scaled.topk(TOP_K).indices
    masked = torch.full_like(scaled, float("-inf"))
    masked[keep] = scaled[keep]
    return torch.softmax(masked, dim=-1).numpy()


@pytest.fixture(scope="module")
def tiny_vocab_dir(tmp_path_factory):
    # A sharper model (larger init) so some token is likely enough to be accepted often.
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-vocab16"), "llama", vocab_size=TINY_VOCAB,
        initializer_range=0.5, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def _model_rows(folder) -> tuple[torch.Tensor, int, int]:
    """The tiny model's logits [3, V] after a prompt + t, + t d, + t d e (a verify step's
    rows, through the runner), with d the likeliest token after t and e p1's second."""
    runner = _runner(folder, slots=64, rows=1)
    seq = Seq(runner, 0, [3, 9, 4, 12, 7, 5], SAMPLINGS["greedy"], base=1)
    limits = wire.Limits.of(runner.info())

    def rows(drafts: list[int]) -> torch.Tensor:
        req = seq.verify_req(drafts)
        return runner.logits(wire.decode_batch(engine_pb2.ForwardBatch(reqs=[req]), limits))

    d = int(rows([0, 0])[0].argmax())
    p1 = rows([d, 0])[1]
    e = int(p1.argsort()[-2])
    return rows([d, e]), d, e


def test_speculative_sampling_follows_the_target_distribution(tiny_vocab_dir):
    """First committed token ~ p0 (the target after the context) whatever the draft; the
    second, given the first draft d was accepted, ~ p1 (the target after context + d). The
    rows are the tiny model's (vocabulary 16); the sampler runs them as a verify step of
    SLOTS requests at once, CALLS times.

    Power: at alpha = 0.001 (df <= 9, critical value <= 27.9) with 20,480 samples, moving 1 %
    of the mass between two tokens of probability 0.1 gives a non-centrality of
    20,480 * 2 * 0.01^2 / 0.1 = 41: detected with probability > 0.9. The bugs this guards
    against are far larger: accepting a draft without testing it moves p(d) to 1; a rejected
    row drawn from p instead of p without d puts (1 - p(d)) p(d) back on d."""
    logits, d, e = _model_rows(tiny_vocab_dir)
    p0, p1 = _target_probs(logits[0]), _target_probs(logits[1])
    sampler = Sampler(SLOTS, TINY_VOCAB, torch.device("cpu"), random_seed=11)
    spec = wire.sampling_spec(engine_pb2.SamplingParams(temperature=TEMPERATURE, top_k=TOP_K))
    for slot in range(SLOTS):
        sampler.reset_slot(slot, spec, np.zeros(0, dtype=np.int32))
    drafts = [np.array([d, e], dtype=np.int32)] * SLOTS
    first = np.zeros(TINY_VOCAB, dtype=np.int64)
    second = np.zeros(TINY_VOCAB, dtype=np.int64)
    accepted = 0
    for _ in range(CALLS):
        out = sampler.sample(logits.repeat(SLOTS, 1), list(range(SLOTS)), drafts=drafts)
        for tok, extra in zip(out.token_ids, out.extra_token_ids, strict=True):
            got = [tok, *extra]
            first[got[0]] += 1
            if got[0] == d:
                second[got[1]] += 1
            accepted += len(extra)
    for counts, probs in ((first, p0), (second, p1)):
        stat, df = _chi2(counts, probs)
        assert stat < _chi2_critical(df), (stat, df, counts, probs)
    n = first.sum()
    assert second.sum() > 0.1 * n  # the first draft was accepted often enough to test p1
    # Acceptance is p(d) for the first draft, p(d) p(e) for both.
    assert abs(first[d] / n - p0[d]) < 4 * math.sqrt(p0[d] * (1 - p0[d]) / n)
    both = p0[d] * p1[e]
    assert abs((accepted - first[d]) / n - both) < 4 * math.sqrt(both * (1 - both) / n)


def test_seeded_verify_repeats_and_matches_one_token_steps():
    """A seeded slot draws, row by row, the tokens one-token steps draw at those positions
    (the draw key is (seed, position)); two runs of the same verify step agree."""
    rng = torch.Generator().manual_seed(5)
    logits = torch.randn(5, TINY_VOCAB, generator=rng)
    spec = wire.sampling_spec(engine_pb2.SamplingParams(temperature=1.0, seed=99))

    def fresh(seed: int) -> Sampler:
        s = Sampler(1, TINY_VOCAB, torch.device("cpu"), random_seed=seed)
        s.reset_slot(0, spec, np.zeros(0, dtype=np.int32))
        return s

    plain = fresh(0)
    one_by_one = [plain.sample(logits[i : i + 1], [0]).token_ids[0] for i in range(5)]
    drafts = [np.array(one_by_one[:4], dtype=np.int32)]
    for worker_seed in (1, 2):  # the worker's own seed never matters to a seeded request
        out = fresh(worker_seed).sample(logits, [0], drafts=drafts)
        assert [out.token_ids[0], *out.extra_token_ids[0]] == one_by_one
