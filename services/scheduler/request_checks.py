"""What the scheduler checks itself on every request, whoever sent it.

The frontend validates first, but the scheduler's socket is an internal port: a peer that
skips the frontend must not be able to put a token id the model cannot embed, or sampling
values the worker cannot honour, into a batch shared with other users' requests (one bad
row fails the whole forward). A request that fails here ends alone, before any KV.
"""

from __future__ import annotations

import math

import numpy as np

from radixserve.internal.v1 import engine_pb2

MAX_TOP_LOGPROBS = 20


def token_problem(ids: np.ndarray, vocab_size: int, field: str) -> str:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        return f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})"
    return ""


def sampling_problem(sp: engine_pb2.SamplingParams) -> str:
    """The bounds the frontend enforces, as far as the worker depends on them."""
    checks = [
        (sp.HasField("max_tokens") and sp.max_tokens < 1, "max_tokens must be >= 1"),
        (
            sp.HasField("temperature")
            and not (math.isfinite(sp.temperature) and 0 <= sp.temperature <= 100),
            "temperature must be in [0, 100]",
        ),
        (sp.HasField("top_p") and not 0 < sp.top_p <= 1, "top_p must be in (0, 1]"),
        (sp.HasField("top_k") and sp.top_k < 0, "top_k must be >= 0"),
        (sp.HasField("min_p") and not 0 <= sp.min_p <= 1, "min_p must be in [0, 1]"),
        (
            sp.HasField("repetition_penalty") and not 0 < sp.repetition_penalty <= 2,
            "repetition_penalty must be in (0, 2]",
        ),
        (
            sp.HasField("frequency_penalty") and not -2 <= sp.frequency_penalty <= 2,
            "frequency_penalty must be in [-2, 2]",
        ),
        (
            sp.HasField("presence_penalty") and not -2 <= sp.presence_penalty <= 2,
            "presence_penalty must be in [-2, 2]",
        ),
        (
            sp.HasField("top_logprobs") and not 0 <= sp.top_logprobs <= MAX_TOP_LOGPROBS,
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]",
        ),
    ]
    return next((f"sampling.{msg}" for bad, msg in checks if bad), "")


def request_problem(msg: engine_pb2.TokenizedRequest, ids: np.ndarray, vocab_size: int) -> str:
    """ "" when the request may join batches, else why it may not (INVALID_ARGUMENT)."""
    return (
        token_problem(ids, vocab_size, "input_ids")
        or token_problem(
            np.asarray(msg.sampling.stop_token_ids, dtype=np.int64), vocab_size, "stop_token_ids"
        )
        or sampling_problem(msg.sampling)
    )
