"""A large CPU prefill runs as groups of whole requests (models/llama.py, issue 18): the
groups cover every row once, and the logits are those of the batch run whole."""

from __future__ import annotations

import random

import torch
from conftest import load_hf_model

from radixserve.internal.v1 import engine_pb2
from services.common.config import WorkerConfig
from services.common.transport import pack_i32
from services.worker import wire
from services.worker.attention.base import AttentionMeta
from services.worker.model_runner import ModelRunner
from services.worker.models import llama


def _meta(extend: list[int], prefix: list[int]) -> AttentionMeta:
    i32 = torch.int32
    qo = torch.tensor([0, *torch.tensor(extend).cumsum(0).tolist()], dtype=i32)
    ext, pre = torch.tensor(extend, dtype=i32), torch.tensor(prefix, dtype=i32)
    return AttentionMeta(
        is_decode=False,
        out_slots=torch.arange(1, 1 + sum(extend)),
        qo_indptr=qo,
        req_to_token=torch.zeros(8, 64, dtype=i32),
        req_slots=torch.arange(len(extend), dtype=i32),
        prefix_lens=pre,
        extend_lens=ext,
        seq_lens=pre + ext,
        max_seq_len=int((pre + ext).max()),
        max_extend_len=max(extend),
    )


def test_groups_cover_each_row_once_with_whole_requests():
    extend, prefix = [3, 7, 20, 1, 9, 2], [0, 5, 0, 30, 1, 0]
    meta = _meta(extend, prefix)
    groups = list(llama.split_extend(meta, 10))
    assert [(s, e) for s, e, _ in groups] == [(0, 10), (10, 30), (30, 40), (40, 42)]
    for s, e, sub in groups:
        n = sub.batch_size
        assert sub.qo_indptr.tolist()[0] == 0 and sub.qo_indptr.tolist()[-1] == e - s
        assert e - s <= 10 or n == 1  # a request longer than the cap goes alone
        assert torch.equal(sub.out_slots, meta.out_slots[s:e])
        assert sub.max_seq_len == int(sub.seq_lens.max())
        assert sub.max_extend_len == int(sub.extend_lens.max())
    assert torch.cat([g.req_slots for _, _, g in groups]).tolist() == list(range(6))
    assert torch.cat([g.prefix_lens for _, _, g in groups]).tolist() == prefix


def _prefill(prompts: list[list[int]]) -> engine_pb2.ForwardBatch:
    batch = engine_pb2.ForwardBatch(batch_id=1)
    start = 1
    for r, p in enumerate(prompts):
        batch.reqs.add(
            req_slot=r,
            input_ids=pack_i32(p),
            prefix_len=0,
            out_slots=pack_i32(range(start, start + len(p))),
            is_new=True,
            sample=True,
            sampling=engine_pb2.SamplingParams(temperature=0.0),
        )
        start += len(p)
    return batch


def test_split_prefill_gives_the_whole_batch_logits(tiny_llama_dir, monkeypatch):
    vocab = load_hf_model(tiny_llama_dir).config.vocab_size
    rng = random.Random(3)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 40, 17, 3, 29)]
    logits = []
    for cap in (10_000, 24):  # whole; groups of at most 24 rows (the 40-token prompt alone)
        monkeypatch.setattr(llama, "CPU_EXTEND_ROWS", cap)
        runner = ModelRunner(
            WorkerConfig(model_path=str(tiny_llama_dir), device="cpu", dtype="float32",
                         max_total_tokens=1024, max_running_requests=8)
        )  # fmt: skip
        batch = wire.decode_batch(_prefill(prompts), wire.Limits.of(runner.info()))
        logits.append(runner.logits(batch))
    assert logits[0].shape[0] == sum(map(len, prompts))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
