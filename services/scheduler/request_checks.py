"""What the scheduler checks itself on every request, whoever sent it: a peer skipping the
frontend must not put a bad row into a shared batch (it would fail the whole forward).
"""

from __future__ import annotations

import numpy as np

from radixserve.internal.v1 import engine_pb2
from services.common.sampling_limits import (
    prompt_logprobs_start_problem,
    sampling_bound_problem,
)


def token_problem(ids: np.ndarray, vocab_size: int, field: str) -> str:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        return f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})"
    return ""


def sampling_problem(sp: engine_pb2.SamplingParams, prompt_len: int) -> str:
    """The bounds the frontend enforces; max_tokens 0 (prefill only) is valid."""
    bound = sampling_bound_problem(sp)
    if bound is None and prompt_len:  # an empty prompt is refused by name elsewhere
        bound = prompt_logprobs_start_problem(sp, prompt_len)
    return "" if bound is None else f"{bound[0]}: {bound[1]}"


def request_problem(msg: engine_pb2.TokenizedRequest, ids: np.ndarray, vocab_size: int) -> str:
    """ "" when the request may join batches, else why it may not (INVALID_ARGUMENT)."""
    return (
        token_problem(ids, vocab_size, "input_ids")
        or token_problem(
            np.asarray(msg.sampling.stop_token_ids, dtype=np.int64), vocab_size, "stop_token_ids"
        )
        or token_problem(
            np.asarray([e.token_id for e in msg.sampling.logit_bias], dtype=np.int64),
            vocab_size,
            "logit_bias",
        )
        or sampling_problem(msg.sampling, len(ids))
    )
