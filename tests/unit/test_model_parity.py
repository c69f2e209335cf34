"""radixserve's model runner against transformers on tiny random-weight models (float32, CPU).

Logits within 1e-4, and greedy tokens identical: in one mixed-length batch, on top of a
prefix whose KV an earlier request computed, and with the prefill split into chunks.
The runner packs its linears for oneDNN on CPU by default (services/worker/cpu_linear.py),
so these tests run the packed path; test_linears_are_packed proves it, and the greedy batch
also runs with --cpu-linear plain (F.linear).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import load_hf_model, make_tiny_model

from radixserve.internal.v1 import engine_pb2
from services.common.config import WorkerConfig
from services.common.transport import pack_i32
from services.worker import wire
from services.worker.cpu_linear import onednn_fp32_available
from services.worker.layers import Linear
from services.worker.model_runner import ModelRunner
from services.worker.offline import generate

MAX_NEW = 32


def make_runner(folder, **overrides) -> ModelRunner:
    cfg = dict(
        model_path=str(folder),
        device="cpu",
        dtype="float32",
        max_total_tokens=8192,
        max_running_requests=24,
    )
    return ModelRunner(WorkerConfig(**{**cfg, **overrides}))


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 9, 17, 1, 40, 23, 6, 31][:n]
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


def hf_greedy(hf, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    """Each prompt alone, so no padding enters the reference."""
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def logits_of(runner: ModelRunner, batch: engine_pb2.ForwardBatch) -> torch.Tensor:
    """The logits of every new token of a wire batch, decoded as the worker process does."""
    return runner.logits(wire.decode_batch(batch, wire.Limits.of(runner.info())))


def prefill_batch(prompts, req_slots, slot_starts) -> engine_pb2.ForwardBatch:
    batch = engine_pb2.ForwardBatch(batch_id=1)
    for p, r, s in zip(prompts, req_slots, slot_starts, strict=True):
        batch.reqs.add(
            req_slot=r,
            input_ids=pack_i32(p),
            prefix_len=0,
            out_slots=pack_i32(range(s, s + len(p))),
            is_new=True,
            sample=True,
        )
    return batch


# ---- a tiny driver: chunked prefill, cached prefixes, mixed batches ------------------


class Job:
    def __init__(
        self,
        req_slot: int,
        prompt: list[int],
        first_slot: int,
        prefix_slots: list[int] | None = None,
    ):
        self.req_slot, self.prompt = req_slot, prompt
        cached = len(prefix_slots or [])
        # KV slot of every position: the cached prefix's slots, then fresh ones.
        self.slots = list(prefix_slots or []) + list(
            range(first_slot, first_slot + len(prompt) + MAX_NEW - cached)
        )
        self.done_prompt = cached  # prompt tokens whose KV is in the pool
        self.started = False
        self.output: list[int] = []

    def finished(self, eos: set[int]) -> bool:
        return len(self.output) >= MAX_NEW or bool(self.output and self.output[-1] in eos)

    def next_request(self, chunk: int) -> engine_pb2.ForwardRequest:
        if self.done_prompt < len(self.prompt):
            ids = self.prompt[self.done_prompt : self.done_prompt + chunk]
        else:
            ids = [self.output[-1]]
        start = (
            self.done_prompt
            if self.done_prompt < len(self.prompt)
            else len(self.prompt) + len(self.output) - 1
        )
        req = engine_pb2.ForwardRequest(
            req_slot=self.req_slot,
            input_ids=pack_i32(ids),
            prefix_len=start,
            out_slots=pack_i32(self.slots[start : start + len(ids)]),
            sample=start + len(ids) >= len(self.prompt),
        )
        if not self.started:
            req.is_new = True
            req.prefix_slots = pack_i32(self.slots[:start])
            req.sampling.CopyFrom(engine_pb2.SamplingParams(temperature=0.0))
        self.started = True
        if self.done_prompt < len(self.prompt):
            self.done_prompt += len(ids)
        return req


def drive(runner: ModelRunner, jobs: list[Job], chunk: int = 1 << 30) -> list[list[int]]:
    eos = set(runner.info().eos_token_ids)
    step = 0
    while True:
        active = [j for j in jobs if not j.finished(eos)]
        if not active:
            return [j.output for j in jobs]
        reqs = [j.next_request(chunk) for j in active]
        batch = engine_pb2.ForwardBatch(batch_id=step, reqs=reqs)
        batch.is_decode = all(
            j.started and j.done_prompt >= len(j.prompt) and j.output for j in active
        )
        result = wire.forward(runner, batch)
        for j, req, tok in zip(active, reqs, result.tokens, strict=True):
            if req.sample:
                j.output.append(tok.token_id)
            else:
                assert tok.token_id == -1
        step += 1


# ---- fixtures ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_case(request):
    folder = request.getfixturevalue(f"tiny_{request.param}_dir")
    hf = load_hf_model(folder)
    prompts = make_prompts(8, hf.config.vocab_size)
    return folder, hf, prompts, [hf_greedy(hf, p) for p in prompts]


# ---- logits -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_prefill_and_decode_logits_match_transformers(arch, request):
    folder = request.getfixturevalue(f"tiny_{arch}_dir")
    hf, runner = load_hf_model(folder), make_runner(folder)
    prompts = make_prompts(3, hf.config.vocab_size, seed=1)
    starts = [1, 200, 400]
    logits = logits_of(runner, prefill_batch(prompts, [0, 1, 2], starts))  # [T, V], prompt order
    rows = torch.split(logits, [len(p) for p in prompts])
    for p, got in zip(prompts, rows, strict=True):
        assert (got - hf_logits(hf, p)).abs().max().item() <= 1e-4
    # Three decode steps over the pool: each request feeds tokens of its own choosing.
    seqs = [list(p) for p in prompts]
    for step in range(3):
        batch = engine_pb2.ForwardBatch(batch_id=10 + step, is_decode=True)
        for r, (seq, s) in enumerate(zip(seqs, starts, strict=True)):
            tok = (7 * step + 11 * r + 5) % hf.config.vocab_size
            batch.reqs.add(
                req_slot=r,
                input_ids=pack_i32([tok]),
                prefix_len=len(seq),
                out_slots=pack_i32([s + len(seq)]),
                sample=True,
            )
            seq.append(tok)
        got = logits_of(runner, batch)
        for r, seq in enumerate(seqs):
            assert (got[r] - hf_logits(hf, seq)[-1]).abs().max().item() <= 1e-4


def test_llama3_rope_scaling_logits_match(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    folder = make_tiny_model(tmp_path / "llama3", "llama", rope_parameters=rope)
    hf, runner = load_hf_model(folder), make_runner(folder)
    prompt = make_prompts(5, hf.config.vocab_size, seed=2)[4]  # 40 tokens, past the ramp
    logits = logits_of(runner, prefill_batch([prompt], [0], [1]))
    assert (logits - hf_logits(hf, prompt)).abs().max().item() <= 1e-4


# ---- greedy generation ---------------------------------------------------------------


@pytest.mark.parametrize("cpu_linear", ["auto", "packed", "hybrid", "plain"])
def test_greedy_batch_matches_transformers(model_case, cpu_linear):
    """hybrid (auto here: tiny models) runs batches of few rows through the C kernel."""
    folder, _, prompts, expected = model_case
    runner = make_runner(folder, cpu_linear=cpu_linear)
    assert (runner.packed_linears > 0) == (cpu_linear != "plain" and onednn_fp32_available())
    assert generate(runner, prompts, MAX_NEW) == expected


@pytest.mark.skipif(not onednn_fp32_available(), reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_linears_are_packed(arch, request):
    """Every projection (and an untied lm_head) runs packed, its dense weight dropped; a
    tied lm_head runs oneDNN beside the embedding table, which stays dense for the lookup."""
    runner = make_runner(request.getfixturevalue(f"tiny_{arch}_dir"), cpu_linear="packed")
    model = runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert (
        runner.packed_linears
        == len(linears)
        == 4 * len(model.model.layers) + (model.lm_head is not None)
    )
    assert all(m.packed is not None and m.weight.is_meta for m in linears)
    assert not model.model.embed_tokens.weight.is_meta
    assert (model.tied_head is not None) == model.tie_word_embeddings


@pytest.mark.skipif(not onednn_fp32_available(), reason="this torch build has no oneDNN linear")
def test_a_large_tied_head_runs_on_the_dense_table(tiny_qwen2_dir, monkeypatch):
    """Past TIED_HEAD_COPY_MAX_BYTES (Qwen2's 544 MB table) the tied head has no copy: the C
    kernel on the dense table for few rows, oneDNN over it for more; greedy is unchanged."""
    from services.worker.models import llama

    folder, hf = tiny_qwen2_dir, load_hf_model(tiny_qwen2_dir)
    assert hf.config.tie_word_embeddings  # the tiny Qwen2 (tests/conftest.py) ties its head
    prompts = make_prompts(8, hf.config.vocab_size)
    expected = [hf_greedy(hf, p) for p in prompts]
    monkeypatch.setattr(llama, "TIED_HEAD_COPY_MAX_BYTES", 0)
    runner = make_runner(folder)
    model = runner.model
    assert model.tied_head is not None and not hasattr(model.tied_head, "path")
    table = model.model.embed_tokens.weight
    for rows in (1, 3, llama.TIED_HEAD_KERNEL_ROWS + 5):
        x = torch.randn(rows, table.shape[1])
        ref = torch.nn.functional.linear(x.double(), table.double())
        assert (model.compute_logits(x).double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert generate(runner, prompts, MAX_NEW) == expected


def test_greedy_with_cached_prefix_matches(model_case):
    folder, _, prompts, expected = model_case
    runner = make_runner(folder)
    # Earlier requests (rows 0..7) compute each prompt's first half; their KV stays in the pool.
    warm = [Job(i, p[: max(1, len(p) // 2)], first_slot=1 + 100 * i) for i, p in enumerate(prompts)]
    drive(runner, warm)
    # New requests (rows 8..15) reuse those slots and prefill only the rest.
    jobs = [
        Job(
            8 + i,
            p,
            first_slot=2000 + 100 * i,
            prefix_slots=w.slots[: min(len(w.prompt), len(p) - 1)],
        )
        for i, (p, w) in enumerate(zip(prompts, warm, strict=True))
    ]
    assert drive(runner, jobs) == expected


@pytest.mark.parametrize("chunk", [5])
def test_greedy_with_chunked_prefill_matches(model_case, chunk):
    folder, _, prompts, expected = model_case
    runner = make_runner(folder)
    jobs = [Job(i, p, first_slot=1 + 100 * i) for i, p in enumerate(prompts)]
    assert drive(runner, jobs, chunk=chunk) == expected


def test_generation_is_not_degenerate(model_case):
    """Guards the tests above: the reference outputs differ between prompts and vary."""
    _, _, _, expected = model_case
    assert len({tuple(e) for e in expected}) == len(expected)
    assert sum(len(set(e)) for e in expected) > 3 * len(expected)
