"""Property tests of the draft sources (issue 39): random add/extend/remove/propose runs
against a slow model of the index.

The model holds each sequence's tokens in LRU order, with the index's eviction and
trimming rules; from it a rebuild from scratch counts every prefix of every window. After
each step the index holds what the model holds, with exactly those counts, and every
proposal is the greedy walk over those counts (any of the tied tokens at a tie).
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.scheduler.spec_drafts import DraftIndex, ngram_draft

NS_OF = {"a": "", "b": "", "c": "", "d": "salt", "e": "salt"}  # a sequence keeps its namespace
SEQ_IDS = sorted(NS_OF)
tokens = st.lists(st.integers(0, 2), max_size=16)  # a small alphabet, so windows collide
Counts = Counter[tuple[str, tuple[int, ...]]]


def rebuilt_counts(seqs: dict[str, tuple[str, list[int]]], depth: int) -> Counts:
    """{(namespace, path): windows with that prefix}, from scratch."""
    out: Counts = Counter()
    for ns, toks in seqs.values():
        for i in range(len(toks)):
            window = toks[i : i + depth]
            for d in range(1, len(window) + 1):
                out[ns, tuple(window[:d])] += 1
    return out


def continuations(counts: Counts, ns: str, path: list[int]) -> dict[int, int]:
    return {t: c for t in range(3) if (c := counts[ns, (*path, t)])}


def check_proposal(
    counts: Counts, ns: str, ctx: list[int], k: int, index: DraftIndex, got: list[int], m: int
) -> None:
    """`got` (continuing the last m tokens of ctx) is what the rule drafts from `counts`."""
    ctx = ctx[-index.max_depth :]
    longest = min(len(ctx), max(1, index.max_depth - k))
    want_m = max(
        (d for d in range(1, longest + 1) if continuations(counts, ns, ctx[-d:])), default=0
    )
    assert m == (want_m if got else 0)
    if not want_m:
        assert got == []
        return
    path, prob = ctx[-want_m:], 1.0
    for i in range(k):
        nxt = continuations(counts, ns, path)
        if not nxt:
            assert len(got) == i, "drafted past the end of every window"
            return
        top = max(nxt.values())
        p = top / sum(nxt.values())
        if prob * p < index.min_prob:
            assert len(got) == i, "drafted below the probability threshold"
            return
        if i == len(got):
            raise AssertionError(f"stopped at {i} of {k} with a continuation of p={prob * p}")
        assert nxt.get(got[i]) == top, "not the most frequent continuation"
        prob *= p
        path.append(got[i])
    assert len(got) == k


def occurs(seqs: list[list[int]], pattern: list[int], depth: int) -> bool:
    """pattern lies inside one window (at most `depth` tokens) of one of seqs."""
    n = len(pattern)
    return n <= depth and any(s[i : i + n] == pattern for s in seqs for i in range(len(s)))


class DraftIndexMachine(RuleBasedStateMachine):
    @initialize(
        max_tokens=st.sampled_from([6, 24, 60]),
        max_depth=st.integers(2, 6),
        min_prob=st.sampled_from([0.1, 0.3, 0.6]),
        seqs=st.lists(st.tuples(st.sampled_from(SEQ_IDS), tokens), max_size=5),
    )
    def setup(
        self, max_tokens: int, max_depth: int, min_prob: float, seqs: list[tuple[str, list[int]]]
    ) -> None:
        """An index with a few sequences in it already (proposals to an empty one are dull)."""
        self.index = DraftIndex(max_tokens=max_tokens, max_depth=max_depth, min_prob=min_prob)
        self.model: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()  # LRU first
        for sid, toks in seqs:
            self.add(sid, toks)

    # -- the model: the index's eviction rules, spelled out -----------------------------
    def held(self) -> int:
        return sum(len(t) for _, t in self.model.values())

    def make_room(self, n: int, keep: str | None) -> None:
        while self.model and self.held() + n > self.index.max_tokens:
            oldest = next(iter(self.model))
            if oldest == keep:
                return
            del self.model[oldest]

    def model_add(self, sid: str, toks: list[int]) -> None:
        self.model.pop(sid, None)
        toks = toks[len(toks) - min(len(toks), self.index.max_tokens) :]
        self.make_room(len(toks), None)
        self.model[sid] = (NS_OF[sid], toks)

    # -- rules --------------------------------------------------------------------------
    @rule(sid=st.sampled_from(SEQ_IDS), toks=tokens)
    def add(self, sid: str, toks: list[int]) -> None:
        self.index.add(NS_OF[sid], sid, toks)
        self.model_add(sid, toks)

    @rule(sid=st.sampled_from(SEQ_IDS), new=st.lists(st.integers(0, 2), max_size=3))
    def extend(self, sid: str, new: list[int]) -> None:
        self.index.extend(NS_OF[sid], sid, new)
        if sid not in self.model or len(new) >= self.index.max_tokens:
            self.model_add(sid, new)
            return
        self.model.move_to_end(sid)
        self.make_room(len(new), sid)
        toks = self.model[sid][1] + new
        self.model[sid] = (NS_OF[sid], toks[len(toks) - min(len(toks), self.index.max_tokens) :])

    @rule(sid=st.sampled_from(SEQ_IDS))
    def remove(self, sid: str) -> None:
        self.index.remove(sid)
        self.model.pop(sid, None)

    @rule()
    def remove_all(self) -> None:
        for sid in SEQ_IDS:
            self.index.remove(sid)
        self.model.clear()
        assert self.index.num_nodes == 0 and self.index.num_tokens == 0 and len(self.index) == 0

    @rule(
        ns=st.sampled_from(["", "salt"]),
        ctx=tokens,
        k=st.integers(1, 3),
        exclude=st.sampled_from([None, *SEQ_IDS]),
    )
    def propose(self, ns: str, ctx: list[int], k: int, exclude: str | None) -> None:
        self.check_propose(ns, ctx, k, exclude)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), k=st.integers(1, 3), exclude=st.booleans())
    def propose_own(self, data: st.DataObject, k: int, exclude: bool) -> None:
        """As the scheduler does: a held request's own tokens, itself excluded or not."""
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self.check_propose(NS_OF[sid], self.model[sid][1], k, sid if exclude else None)

    def check_propose(self, ns: str, ctx: list[int], k: int, exclude: str | None) -> None:
        draft = self.index.draft(ns, ctx, k, exclude=exclude)
        counted = {s: v for s, v in self.model.items() if s != exclude}
        counts = rebuilt_counts(counted, self.index.max_depth)
        check_proposal(counts, ns, ctx, k, self.index, draft.tokens, draft.match_len)
        assert self.index.propose(ns, ctx, k, exclude=exclude) == draft.tokens
        if draft.tokens:  # a continuation some counted sequence of this namespace holds
            others = [t for n, t in counted.values() if n == ns]
            seen = ctx[len(ctx) - draft.match_len :] + draft.tokens
            assert occurs(others, seen, self.index.max_depth)

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def index_is_the_rebuild(self) -> None:
        if not hasattr(self, "index"):
            return
        self.index.check_integrity()
        assert self.index.num_tokens <= self.index.max_tokens
        assert [(sid, ns, t) for ns, sid, t in self.index.sequences()] == [
            (sid, ns, t) for sid, (ns, t) in self.model.items()
        ]
        assert self.index.path_counts() == dict(rebuilt_counts(self.model, self.index.max_depth))


TestDraftIndex = DraftIndexMachine.TestCase
TestDraftIndex.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


@settings(max_examples=200, deadline=None)
@given(
    toks=st.lists(st.integers(0, 3), max_size=30),
    k=st.integers(0, 5),
    min_n=st.integers(1, 3),
    max_n=st.integers(1, 5),
)
def test_ngram_draft_is_the_definition(toks: list[int], k: int, min_n: int, max_n: int) -> None:
    """The longest suffix (max_n down to min_n) seen before; what followed its latest sighting."""
    want: list[int] = []
    for n in range(max_n, min_n - 1, -1):
        if n >= len(toks) or k <= 0:
            continue
        starts = [i for i in range(len(toks) - n) if toks[i : i + n] == toks[-n:]]
        if starts:
            want = toks[starts[-1] + n : starts[-1] + n + k]
            break
    assert ngram_draft(toks, k, min_n, max_n) == want
