"""Speculative decoding, the scheduler's half: which requests draft, how many tokens, and
what a verify step's result commits (the verify step itself: docs/speculative.md).

Every request speculates except with ``--speculative-algorithm none``, with
``disable_speculation``, or when max_tokens or the context leaves no room for a draft; a
whole step runs plain when the gate (spec_gate.py) expects fewer tokens per second from it.
The overlap schedule pauses while speculation is live: after a verify step even the
position of the next token is unknown.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from services.common.config import SchedulerConfig
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request import Req
from services.scheduler.spec_drafts import ALGORITHMS, AdaptiveLength, DraftIndex, propose
from services.scheduler.spec_gate import SpecGate
from services.scheduler.tokens import Tokens

# Indexing costs ~10-40 us a token, so it is rationed: once every step, while the worker
# computes (plain or verify alike, so the gate compares like with like), this many tokens
# of running requests' text not indexed yet, all of them together, taken in turn; a
# request's own text drafts through ngram_draft meanwhile. Finished requests' text not
# indexed yet waits in a backlog: this many tokens of it are indexed per step, this many
# per idle loop turn.
FEED_TOKENS_PER_STEP = 32
BACKLOG_TOKENS_PER_STEP = 16
BACKLOG_TOKENS_IDLE = 1024
START_OFF_BELOW = 0.2  # a new request starts probing below this engine-wide acceptance
# (algorithm, index, namespace, seq_id, tokens, k) -> up to k drafts
DraftFn = Callable[[str, DraftIndex | None, str, str, Sequence[int], int], list[int]]


def _forget_plans(reqs: Iterable[Req]) -> None:
    for req in reqs:
        if req.spec is not None:
            req.spec.planned = None


def algorithm_names() -> list[str]:
    return list(ALGORITHMS)


@dataclass(eq=False)
class SpecState:
    seq_id: str
    length: AdaptiveLength
    indexed: int = 0  # tokens of the request's fill_ids in the draft index, or skipped
    added: bool = False  # whether the index holds the sequence yet
    # k decided ahead for the next step (the lookahead's prediction); None: not yet.
    planned: int | None = None


@dataclass(eq=False)
class Speculator:
    algorithm: str
    max_k: int
    metrics: SchedulerMetrics
    index: DraftIndex | None = None
    draft_fn: DraftFn = propose  # tests put an oracle here
    gate: SpecGate = field(default_factory=SpecGate)
    accept_rate: float = 1.0  # moving share of drafted tokens accepted, every request
    # Finished requests whose text is not all indexed yet, oldest first, and how many
    # tokens they still have to index.
    backlog: deque[tuple[SpecState, str, Tokens]] = field(default_factory=deque)
    backlog_tokens: int = 0
    _ids: itertools.count = field(default_factory=itertools.count)
    _feed_turn: int = 0  # where the next ration starts among the running requests

    @classmethod
    def of(cls, cfg: SchedulerConfig, metrics: SchedulerMetrics) -> Speculator:
        index = None
        if cfg.speculative_algorithm == "suffix":
            index = DraftIndex(max_tokens=cfg.speculative_index_tokens)
        return cls(
            cfg.speculative_algorithm, cfg.speculative_num_draft_tokens, metrics, index,
            gate=SpecGate(cfg.speculative_gate),
        )  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.algorithm != "none" and self.max_k > 0

    def may_speculate(self, req: Req) -> bool:
        s = req.sampling
        return self.enabled and not s.disable_speculation

    def _state(self, req: Req) -> SpecState:
        if req.spec is None:
            # Recent drafts mostly failed: start probing, as verify steps slow the batch.
            start_off = self.accept_rate < START_OFF_BELOW
            length = AdaptiveLength(self.max_k, start_off=start_off)
            req.spec = SpecState(f"{req.rid}#{next(self._ids)}", length, self._skip(req))
        return req.spec

    def _skip(self, req: Req) -> int:
        """Leading tokens of the request not to index: the prompt prefix it found cached on
        this engine is the text of an earlier request of its namespace, indexed with that
        one (a turn's history, a shared document); the last max_depth of them are indexed
        again so that windows across the end of the prefix exist. KV that came from storage
        may have been written by another engine, whose text this index never saw."""
        if self.index is None:
            return 0
        here = req.cached_tokens - req.cached_storage_tokens
        return max(0, here - self.index.max_depth)

    def _room(self, req: Req, max_model_len: int) -> int:
        return min(req.remaining_new_tokens - 1, max_model_len - req.seq_len)

    # -- a step -----------------------------------------------------------------------
    # The gate is asked before anything is proposed: where it runs steps of this size plain,
    # proposing for every request each step (tens of us each) would only tax the forward.

    def _next_k(self, req: Req, st: SpecState, max_model_len: int) -> int:
        """The request's draft length for its next step (0: none), the lookahead's if set."""
        if st.planned is None:
            st.planned = st.length.next_k()
        return min(st.planned, self._room(req, max_model_len))

    def _propose(self, req: Req, st: SpecState, k: int) -> list[int]:
        ids = req.fill_ids
        return self.draft_fn(self.algorithm, self.index, req.namespace, st.seq_id, ids, k)[:k]

    def _due(self, reqs: Sequence[Req], max_model_len: int) -> list[tuple[Req, SpecState, int]]:
        """(request, state, k) of each request due to draft in the next step, k > 0."""
        due = []
        for req in reqs:
            if self.may_speculate(req):
                st = self._state(req)
                if (k := self._next_k(req, st, max_model_len)) > 0:
                    due.append((req, st, k))
        return due

    def step_drafts(self, reqs: Sequence[Req], max_model_len: int) -> dict[Req, list[int]]:
        """Each decoding request's drafts for the next step; none when the gate declines."""
        due = self._due(reqs, max_model_len)
        _forget_plans(reqs)  # this step uses them
        if not due or self._declined(len(reqs)):
            return {}
        return {req: d for req, st, k in due if (d := self._propose(req, st, k))}

    def _declined(self, batch: int) -> bool:
        """The gate runs this step of ``batch`` requests plain (counted)."""
        if self.gate.worth(batch):
            return False
        self.metrics.on_declined_step()
        return True

    def would_verify(self, reqs: Sequence[Req], max_model_len: int) -> bool:
        """Whether the next step is likely to verify drafts; decides each one's k for it."""
        due = self._due(reqs, max_model_len)
        found = bool(due) and not self._declined(len(reqs))
        found = found and any(self._propose(req, st, k) for req, st, k in due)
        if not found:  # the lookahead goes out: that step of each was a plain one
            _forget_plans(reqs)
        return found

    def verified(self, req: Req, drafted: int, accepted: int) -> None:
        self._state(req).length.observe(drafted, accepted)
        self.metrics.on_verify(drafted, accepted)
        if drafted > 0:
            self.accept_rate = 0.9 * self.accept_rate + 0.1 * accepted / drafted

    # -- the draft index ----------------------------------------------------------------
    def feed(self, running: Iterable[Req], budget: int = FEED_TOKENS_PER_STEP) -> None:
        """Indexes up to ``budget`` tokens of the decoding requests' text not indexed yet,
        starting one request further each call, so every request gets its turn."""
        reqs = [r for r in running if not r.in_prefill and self.may_speculate(r)]
        if self.index is None or not reqs:
            return
        self._feed_turn = (self._feed_turn + 1) % len(reqs)
        for req in itertools.chain(reqs[self._feed_turn :], reqs[: self._feed_turn]):
            st = self._state(req)
            if st.indexed < req.seq_len:
                budget -= self._index(st, req.namespace, req.fill_ids, budget)
            if budget <= 0:
                return

    def _index(self, st: SpecState, namespace: str, ids: Tokens, limit: int) -> int:
        """Indexes up to ``limit`` more of ``ids``; returns how many."""
        if self.index is None:
            return 0
        start = st.indexed
        end = min(len(ids), start + limit)
        if start < end and not st.added:
            self.index.add(namespace, st.seq_id, ids[start:end])
            st.added = True
        elif start < end:
            self.index.extend(namespace, st.seq_id, ids[start:end])
        st.indexed = max(start, end)
        return st.indexed - start

    def finished(self, req: Req) -> None:
        """A request's whole text stays in the index for its namespace to draft from: what
        is not indexed yet joins the backlog (index_backlog), oldest dropped beyond the
        index's own bound."""
        if self.index is None or not req.output_ids:
            return
        st = self._state(req)
        ids = req.fill_ids
        if st.indexed >= len(ids):
            return
        self.backlog.append((st, req.namespace, ids))
        self.backlog_tokens += len(ids) - st.indexed
        while self.backlog_tokens > self.index.max_tokens:
            old, _, old_ids = self.backlog.popleft()
            self.backlog_tokens -= len(old_ids) - old.indexed

    def index_backlog(self, budget: int) -> None:
        """Indexes up to ``budget`` tokens of finished requests' text, oldest first."""
        while budget > 0 and self.backlog:
            st, namespace, ids = self.backlog[0]
            n = self._index(st, namespace, ids, budget)
            budget -= n
            self.backlog_tokens -= n
            if st.indexed >= len(ids):
                self.backlog.popleft()

    def upkeep(self, running: Iterable[Req]) -> None:
        """Once a step, while a batch is in flight (verify steps have no overlap schedule
        to hide scheduler work behind): a little of the running requests' text and of the
        backlog is indexed. While drafts keep failing engine-wide (text that repeats
        nothing), or the gate runs steps of this size plain, neither is: the ration would
        tax every step (on a 2-core machine, the forward beside it) for drafts not
        verified; running text joins the backlog when it finishes, and the backlog is
        indexed while the engine idles."""
        running = list(running)
        decoding = sum(not r.in_prefill for r in running)
        if self.accept_rate < START_OFF_BELOW or not self.gate.verifying(decoding):
            return
        self.feed(running)
        if self.backlog:
            self.index_backlog(BACKLOG_TOKENS_PER_STEP)

    def idle(self) -> None:
        """The engine has nothing to run: the gate's chain breaks, the backlog drains."""
        self.gate.idle()
        self.index_backlog(BACKLOG_TOKENS_IDLE)

    def reset(self) -> None:
        """Forgets every indexed sequence (FlushCache, with no request running)."""
        if self.index is not None:
            self.index = DraftIndex(max_tokens=self.index.max_tokens)
        self.backlog.clear()
        self.backlog_tokens = 0
