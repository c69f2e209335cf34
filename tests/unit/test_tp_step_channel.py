"""Rank 0's step inputs reach the other ranks as int64 tensors, whole and in order
(services/worker/parallel/step_channel.py), on 2 gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tp_util import run_ranks

from services.worker.parallel.group import TpGroup
from services.worker.parallel.rank_runner import RankShape
from services.worker.parallel.step_channel import (
    HEADER_WORDS,
    ForwardStep,
    Message,
    Op,
    StepChannel,
)
from services.worker.step_inputs import StepStager, host_arrays


def a_batch(seed: int):
    """A mixed batch: new tokens, cached prefixes, the rows to take logits of."""
    rng = np.random.default_rng(seed)
    lens = [5, 1, 12, 1]
    ids = [rng.integers(0, 1000, n) for n in lens]
    out_slots = [rng.integers(0, 4096, n) for n in lens]
    req_slots, prefix = [3, 0, 7, 1], [0, 30, 4, 9]
    return ids, out_slots, req_slots, prefix


def forward_step(seed: int) -> ForwardStep:
    ids, out_slots, req_slots, prefix = a_batch(seed)
    arrays, t, b = host_arrays(
        ids, out_slots, np.asarray(req_slots, np.int64), np.asarray(prefix, np.int64)
    )
    return ForwardStep(
        flat=np.concatenate(arrays),
        t=t,
        b=b,
        max_seq_len=int(arrays[7].max()),
        max_extend_len=int(arrays[6].max()),
        is_decode=False,
        prefix_rows=np.array([0, 7], np.int64),
        prefix_lens=np.array([30, 4], np.int64),
        prefix_slots=np.arange(34, dtype=np.int64) + 100,
        logit_rows=np.cumsum([len(i) for i in ids]) - 1,
    )


def talk(tp: TpGroup) -> None:
    channel = StepChannel(tp)
    sizes = RankShape(num_slots=4097, max_running_requests=48, max_context=2048)
    if tp.is_first:
        sizes.send(channel)
    else:
        assert RankShape.recv(channel) == sizes
    for seed in range(3):
        step = forward_step(seed)
        if tp.is_first:
            step.send(channel)
            continue
        got = ForwardStep.of(channel.recv())
        assert got.t == step.t and got.b == step.b and not got.is_decode
        assert np.array_equal(got.flat, step.flat)
        assert np.array_equal(got.logit_rows, step.logit_rows)
        assert [r for r, _ in got.prefixes()] == [0, 7]
        assert np.array_equal(got.prefixes()[1][1], np.arange(30, 34) + 100)
        # the inputs rank 0's stager made from the same batch
        want = StepStager(torch.device("cpu")).stage(*a_batch(seed))
        have = got.inputs(torch.device("cpu"))
        for name in ("input_ids", "positions", "out_slots", "token_rows", "req_slots"):
            assert torch.equal(getattr(have, name), getattr(want, name)), name
        for name in ("prefix_lens", "extend_lens", "seq_lens", "qo_indptr"):
            assert torch.equal(getattr(have, name), getattr(want, name)), name
        assert (have.max_seq_len, have.max_extend_len) == (want.max_seq_len, want.max_extend_len)
    if tp.is_first:  # a message with no arrays (one broadcast), then the last word
        channel.send(Op.LOGITS, [7], [])
        channel.send(Op.STOP, [], [])
    else:
        assert channel.recv() == Message(Op.LOGITS, [7], [])
        assert channel.recv().op == Op.STOP


def test_steps_reach_the_other_rank() -> None:
    run_ranks(talk, 2)  # more receivers are gloo's broadcast; test_tp_layers runs 4 ranks


def test_an_oversized_header_is_refused() -> None:
    with pytest.raises(ValueError, match="header words"):
        StepChannel(TpGroup()).send(Op.FORWARD, list(range(HEADER_WORDS)), [])
