"""Speculative decoding, the scheduler's half: which requests draft, how many tokens, and
what a verify step's result commits.

The drafts come from the request's own tokens and, with ``suffix``, from a suffix index
over every sequence the engine has seen in the request's namespace (spec_drafts.py); the
worker verifies them in one forward (a verify step: the last token plus k drafts, an
extend over the request's cached KV) and returns the accepted ones plus its own next token.

    one decode step of a request with k drafts (S = seq_len before the step)

    position:   S-1        S .......... S+k-1
    input:      last token d_0 ........ d_{k-1}           KV slots grown: 1 + k
    returns:    e_0        e_1 ........ e_m               m <= k drafts accepted (e_i == d_i, i < m)
    after:      kv_len = S + m (the m rejected slots of d_m.. are freed at once), seq_len = S+m+1

Who does not speculate (k = 0 every step; a plain one-token step):
- ``--speculative-algorithm none`` (the default), or a request with
  ``SamplingParams.disable_speculation``;
- a request whose remaining max_tokens (or context) leaves no room for one draft plus the
  target's own token.
Everything else speculates, exactly: sampled requests (the worker's verify is the same
draw as a one-token step, sampling.py), penalties, min_tokens, logit_bias, logprobs and
top logprobs (each committed token's logprobs are computed at its own row), constrained
decoding (the worker masks each row with the grammar's state after the drafts before it
and drops the drafts the grammar refuses: services/worker/grammar/slots.py).

The overlap schedule pauses while speculation is live: a lookahead step is built before the
current step's tokens are known, and after a verify step even the position of the next
token is unknown (it depends on how many drafts were accepted). So no lookahead is queued
behind a verify step, nor behind a plain step when some request would draft in the next
one (predicted from its tokens known so far); once every request's adaptive length has
fallen to 0, or their text offers nothing to draft, the lookahead chain runs as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from services.common.config import SchedulerConfig
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request import Req
from services.scheduler.spec_drafts import ALGORITHMS, AdaptiveLength, DraftIndex, propose

FEED_TOKENS_PER_STEP = 64  # tokens a request adds to the draft index per step, at most
START_OFF_BELOW = 0.2  # a new request starts probing below this engine-wide acceptance
# (algorithm, index, namespace, seq_id, tokens, k) -> up to k drafts (spec_drafts.propose).
DraftFn = Callable[[str, DraftIndex | None, str, str, Sequence[int], int], list[int]]


def algorithm_names() -> list[str]:
    """--speculative-algorithm's choices (the registry lives in spec_drafts.py)."""
    return list(ALGORITHMS)


@dataclass(eq=False)
class SpecState:
    """A request's speculation: its index sequence and adaptive length."""

    seq_id: str
    length: AdaptiveLength
    indexed: int = 0  # tokens of the request's fill_ids already in the draft index
    # k decided for the next step ahead of it (the lookahead's prediction); None: not yet.
    planned: int | None = None


@dataclass(eq=False)
class Speculator:
    algorithm: str
    max_k: int
    metrics: SchedulerMetrics
    index: DraftIndex | None = None
    draft_fn: DraftFn = propose  # tests put an oracle here
    accept_rate: float = 1.0  # moving share of drafted tokens accepted, every request
    _ids: itertools.count = field(default_factory=itertools.count)

    @classmethod
    def of(cls, cfg: SchedulerConfig, metrics: SchedulerMetrics) -> Speculator:
        index = None
        if cfg.speculative_algorithm == "suffix":
            index = DraftIndex(max_tokens=cfg.speculative_index_tokens)
        return cls(cfg.speculative_algorithm, cfg.speculative_num_draft_tokens, metrics, index)

    @property
    def enabled(self) -> bool:
        return self.algorithm != "none" and self.max_k > 0

    def may_speculate(self, req: Req) -> bool:
        """Whether the request drafts at all (module docstring: who does not)."""
        s = req.sampling
        return self.enabled and not s.disable_speculation

    def _state(self, req: Req) -> SpecState:
        if req.spec is None:
            # A new request starts probing when the engine's recent drafts mostly failed
            # (text that does not repeat): its first full-length drafts would fail too,
            # and each verify step of any request slows the whole batch.
            start_off = self.accept_rate < START_OFF_BELOW
            length = AdaptiveLength(self.max_k, start_off=start_off)
            req.spec = SpecState(f"{req.rid}#{next(self._ids)}", length)
        return req.spec

    def _room(self, req: Req, max_model_len: int) -> int:
        """Drafts that fit: each accepted one is an output token, and the target adds one
        more; every draft takes a position of the context."""
        return min(req.remaining_new_tokens - 1, max_model_len - req.seq_len)

    # -- a step -----------------------------------------------------------------------
    def drafts(self, req: Req, max_model_len: int) -> list[int]:
        """The drafts of the request's next step ([]: a plain step)."""
        if not self.may_speculate(req):
            return []
        st = self._state(req)
        k = st.length.next_k() if st.planned is None else st.planned
        st.planned = None
        k = min(k, self._room(req, max_model_len))
        if k <= 0:
            return []
        self._feed(req, st)
        return self._propose(req, st, k)

    def _propose(self, req: Req, st: SpecState, k: int) -> list[int]:
        ids = req.fill_ids
        return self.draft_fn(self.algorithm, self.index, req.namespace, st.seq_id, ids, k)[:k]

    def would_verify(self, reqs: Iterable[Req], max_model_len: int) -> bool:
        """Whether any of these decoding requests is likely to draft in its next step, judged
        on the tokens known now (the overlap schedule's lookahead asks; module docstring).
        Each one's length for that step is decided here, so it is counted once."""
        found = False
        decided: list[SpecState] = []
        for req in reqs:
            if not self.may_speculate(req):
                continue
            st = self._state(req)
            if st.planned is None:
                st.planned = st.length.next_k()
            decided.append(st)
            k = min(st.planned, self._room(req, max_model_len))
            if found or k <= 0:
                continue
            self._feed(req, st)
            found = bool(self._propose(req, st, k))
        if not found:  # the lookahead goes out: that step of each was a plain one
            for st in decided:
                st.planned = None
        return found

    def verified(self, req: Req, drafted: int, accepted: int) -> None:
        """A verify step came back: ``accepted`` of the ``drafted`` tokens were right."""
        self._state(req).length.observe(drafted, accepted)
        self.metrics.on_verify(drafted, accepted)
        if drafted > 0:
            self.accept_rate = 0.9 * self.accept_rate + 0.1 * accepted / drafted

    # -- the draft index ----------------------------------------------------------------
    def _feed(self, req: Req, st: SpecState, limit: int = FEED_TOKENS_PER_STEP) -> None:
        """The index catches up with the request's tokens, at most ``limit`` of them a call:
        indexing costs ~10 us a token, so a long prompt is spread over its first steps
        instead of stalling one (its own tokens draft through ngram meanwhile)."""
        if self.index is None:
            return
        ids = req.fill_ids
        end = min(len(ids), st.indexed + limit)
        if st.indexed == 0 and end:
            self.index.add(req.namespace, st.seq_id, ids[:end])
        elif st.indexed < end:
            self.index.extend(req.namespace, st.seq_id, ids[st.indexed : end])
        st.indexed = end

    def finished(self, req: Req) -> None:
        """A request ended: its whole text stays in the index (other requests of its
        namespace draft from it; the index's LRU bound evicts it in time). A request that
        never decoded (refused, prefill only) adds nothing."""
        if self.index is None or not req.output_ids:
            return
        self._feed(req, self._state(req), limit=len(req.fill_ids))

    def reset(self) -> None:
        """Forgets every indexed sequence (FlushCache, which runs only when no request
        does: drafts come from nothing seen before it)."""
        if self.index is not None:
            self.index = DraftIndex(max_tokens=self.index.max_tokens)
