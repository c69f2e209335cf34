"""Prompt logprobs: which prompt positions the worker scores in each prefill chunk, how
far the cache may match (a cached position has no logits), and one list stitched across
chunks and retractions, sent once complete. Entry k scores p[s + k], s >= 1.
"""

from __future__ import annotations

from radixserve.internal.v1 import engine_pb2
from services.common.transport import pack_i32
from services.scheduler.batch import Item
from services.scheduler.request import Req


def first_position(req: Req) -> int:
    """s: the first prompt position scored."""
    sp = req.sampling
    return max(sp.prompt_logprobs_start if sp.HasField("prompt_logprobs_start") else 0, 1)


def next_position(req: Req) -> int:
    return first_position(req) + len(req.prompt_logprobs)


def pending(req: Req) -> bool:
    if req.prompt_logprobs_done:
        return False
    return next_position(req) < len(req.input_ids)


def match_limit(req: Req) -> int | None:
    """The most prompt tokens the cache may supply; None: no limit."""
    return next_position(req) - 1 if pending(req) else None


def targets(req: Req, start: int, n: int) -> tuple[int, list[int]]:
    """For the chunk [start, start + n): the first row to score and the prompt token each
    scored row predicts (empty when none)."""
    if not pending(req):
        return 0, []
    lo = max(next_position(req), start + 1)
    hi = min(start + n + 1, len(req.input_ids))
    if lo >= hi:
        return 0, []
    return lo - start - 1, req.input_ids[lo:hi].tolist()


def collect(req: Req, logprobs: list[engine_pb2.TokenLogprob]) -> None:
    if logprobs and pending(req):
        req.prompt_logprobs.extend(logprobs)


def fill_delta(req: Req, delta: engine_pb2.TokenDelta) -> None:
    if req.prompt_logprobs_done or pending(req):
        return
    delta.prompt_logprobs.extend(req.prompt_logprobs)
    delta.prompt_logprobs_start = first_position(req)
    req.prompt_logprobs_done = True
    req.prompt_logprobs = []  # sent: a retraction later does not score the prompt again


def fill_request(fr: engine_pb2.ForwardRequest, it: Item) -> None:
    row, scored = targets(it.req, it.start, it.n)
    if scored:
        fr.prompt_logprob_row = row
        fr.prompt_logprob_targets = pack_i32(scored)
        fr.prompt_top_logprobs = it.req.sampling.top_logprobs
