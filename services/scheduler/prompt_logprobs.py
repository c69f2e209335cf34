"""Prompt logprobs (SamplingParams.prompt_logprobs): which prompt positions the worker
scores in each prefill chunk, how far the radix cache may match, and stitching the
worker's answers across chunks and retractions into one list for the frontend.

    prompt p[0 .. n-1]; asked from s = max(prompt_logprobs_start, 1) (p[0] has no logit)
    entry k           logprob of p[s + k] under the logits at position s + k - 1
    next              s + (entries collected so far): the next position to score
    cache match       at most next - 1 tokens: a cached position has no logits, so the
                      logits of every position still to score come from this request
    chunk [a, a + m)  its new token a + r (row r) predicts p[a + r + 1]; the chunk scores
                      p[q] for q in [max(next, a + 1), min(a + m + 1, n))

The whole prompt is still inserted into the tree after the prefill (only the match is
limited), so a later request hits it. The list goes out once, complete, on the first
delta after the prefill (the one with the first token, or the only one with max_tokens 0).
"""

from __future__ import annotations

from radixserve.internal.v1 import engine_pb2
from services.common.transport import pack_i32
from services.scheduler.batch import Item
from services.scheduler.request import Req


def first_position(req: Req) -> int:
    """s: the first prompt position scored (position 0 has nothing before it)."""
    sp = req.sampling
    return max(sp.prompt_logprobs_start if sp.HasField("prompt_logprobs_start") else 0, 1)


def next_position(req: Req) -> int:
    return first_position(req) + len(req.prompt_logprobs)


def pending(req: Req) -> bool:
    """Asked for, and some prompt position is not scored yet."""
    if req.prompt_logprobs_done:
        return False
    return next_position(req) < len(req.input_ids)


def match_limit(req: Req) -> int | None:
    """The most prompt tokens the cache may supply; None: no limit."""
    return next_position(req) - 1 if pending(req) else None


def targets(req: Req, start: int, n: int) -> tuple[int, list[int]]:
    """For the chunk of new tokens [start, start + n): the first row to score and the
    prompt token each scored row predicts (empty when none)."""
    if not pending(req):
        return 0, []
    lo = max(next_position(req), start + 1)
    hi = min(start + n + 1, len(req.input_ids))
    if lo >= hi:
        return 0, []
    return lo - start - 1, req.input_ids[lo:hi].tolist()


def collect(req: Req, logprobs: list[engine_pb2.TokenLogprob]) -> None:
    """A chunk's scores, in order (the chunks of a request come back in the order sent)."""
    if logprobs and pending(req):
        req.prompt_logprobs.extend(logprobs)


def fill_delta(req: Req, delta: engine_pb2.TokenDelta) -> None:
    """Puts the whole list on the delta once, when complete (an abort mid-prefill sends none)."""
    if req.prompt_logprobs_done or pending(req):
        return
    delta.prompt_logprobs.extend(req.prompt_logprobs)
    delta.prompt_logprobs_start = first_position(req)
    req.prompt_logprobs_done = True
    req.prompt_logprobs = []  # sent: a retraction later does not score the prompt again


def fill_request(fr: engine_pb2.ForwardRequest, it: Item) -> None:
    """The rows of a prefill chunk the worker scores (none when the request asks none)."""
    row, scored = targets(it.req, it.start, it.n)
    if scored:
        fr.prompt_logprob_row = row
        fr.prompt_logprob_targets = pack_i32(scored)
        fr.prompt_top_logprobs = it.req.sampling.top_logprobs
