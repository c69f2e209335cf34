"""The draft sources for speculative decoding without a draft model (issue 39, part 1):
prompt lookup, the suffix index over the cache, the adaptive speculation length, and the
scheduler's one call that picks between them."""

from __future__ import annotations

from array import array

import pytest

from services.scheduler.spec_drafts import (
    ALGORITHMS,
    AdaptiveLength,
    DraftIndex,
    DraftIndexError,
    ngram_draft,
    propose,
)


def index_of(*seqs: list[int], min_prob: float = 0.1) -> DraftIndex:
    """An index holding seqs as s0, s1, ... in namespace "" (the last one the most recent)."""
    index = DraftIndex(max_depth=8, min_prob=min_prob)
    for i, s in enumerate(seqs):
        index.add("", f"s{i}", s)
    index.check_integrity()
    return index


# -- ngram_draft ----------------------------------------------------------------------


def test_ngram_draft_takes_the_longest_suffix_seen_before():
    toks = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]  # [1, 2, 3] at 0 beats [2, 3] at 5
    assert ngram_draft(toks, 3) == [4, 9, 2]


def test_ngram_draft_follows_the_most_recent_sighting():
    assert ngram_draft([1, 2, 7, 1, 2, 8, 1, 2], 2) == [8, 1]


def test_ngram_draft_edges():
    assert ngram_draft([5, 5, 5], 4) == [5]  # what follows runs into the end
    assert ngram_draft([1, 2, 3, 4], 3) == []  # nothing repeats
    assert ngram_draft([1, 2, 1, 2], 0) == []
    assert ngram_draft([], 3) == [] and ngram_draft([1], 3) == []
    assert ngram_draft([4, 1, 2, 3, 1], 2) == []  # a 1-token suffix is below min_n
    assert ngram_draft([4, 1, 2, 3, 1], 2, min_n=1) == [2, 3]


def test_ngram_draft_skips_byte_matches_that_straddle_tokens():
    # int32 0x01000000 then two zeros hold the bytes of [1, 0] three bytes in: not a sighting.
    toks = array("i", [9, 1, 0, 7, 0x01000000, 0, 0, 1, 0])
    assert ngram_draft(toks, 1) == [7]


# -- DraftIndex -----------------------------------------------------------------------


def test_propose_takes_the_most_frequent_continuation():
    index = index_of([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5])
    assert index.propose("", [9, 1, 2, 3], 1) == [4]
    draft = index.draft("", [9, 1, 2, 3], 1)
    assert (draft.match_len, draft.prob) == (3, pytest.approx(2 / 3))


def test_ties_go_to_the_most_recent():
    index = index_of([1, 2, 3, 4], [1, 2, 3, 5])
    assert index.propose("", [1, 2, 3], 1) == [5]
    index.add("", "s0", [1, 2, 3, 4])  # s0 again: now the most recent
    assert index.propose("", [1, 2, 3], 1) == [4]


def test_the_draft_stops_where_its_probability_falls_below_min_prob():
    # after [1]: 5 (2 of 3), then 6 or 7 (1 of 2): 2/3, then 1/3 in all
    seqs = ([1, 5, 6], [1, 5, 7], [1, 8])
    assert index_of(*seqs, min_prob=0.4).propose("", [0, 1], 3) == [5]
    assert index_of(*seqs, min_prob=0.3).propose("", [0, 1], 3) == [5, 7]
    assert index_of(*seqs, min_prob=0.7).propose("", [0, 1], 3) == []


def test_the_draft_ends_with_the_windows():
    index = index_of([1, 2, 3, 7], [1, 2, 3, 8], [1, 2, 3, 9])
    assert index.propose("", [0, 1, 2], 3) == [3, 9]  # 1/3 each after 3; nothing after


def test_the_requests_own_tail_is_no_evidence_against_a_token():
    index = index_of([1, 2, 7], [5, 1, 2])  # s1 is the running request
    draft = index.draft("", [5, 1, 2], 1)
    assert draft.tokens == [7] and draft.prob == 1.0 and draft.match_len == 2


def test_a_draft_never_comes_from_another_namespace():
    index = DraftIndex(max_depth=8)
    index.add("a", "x", [1, 2, 3])
    assert index.propose("b", [1, 2], 1) == []
    index.add("b", "y", [1, 2, 4])
    assert index.propose("b", [1, 2], 1) == [4]
    assert index.propose("a", [1, 2], 1) == [3]


def test_exclude_leaves_a_sequence_out_of_the_counts():
    index = index_of([1, 2, 9], [1, 2, 3, 1, 2])  # s1 is the running request
    assert index.propose("", [1, 2, 3, 1, 2], 3) == [3, 1, 2]  # a tie: s1 is more recent
    assert index.propose("", [1, 2, 3, 1, 2], 3, exclude="s1") == [9]
    index.remove("s0")
    assert index.propose("", [1, 2, 3, 1, 2], 3, exclude="s1") == []


def test_exclude_when_the_excluded_sequence_ends_inside_the_draft():
    index = index_of([4, 1, 2, 3], [1, 2, 3, 5])
    assert index.propose("", [1, 2], 3, exclude="s0") == [3, 5]


def test_lru_eviction_and_a_sequence_longer_than_max_tokens():
    index = DraftIndex(max_tokens=10, max_depth=4)
    index.add("", "a", [1, 2, 3, 4])
    index.add("", "b", [5, 6, 7, 8])
    index.extend("", "a", [9])  # a is used after b now
    index.add("", "c", [1, 1, 1])
    assert [sid for _, sid, _ in index.sequences()] == ["a", "c"]
    index.add("", "d", list(range(15)))
    assert list(index.sequences()) == [("", "d", list(range(5, 15)))]
    index.extend("", "d", [99])
    assert list(index.sequences()) == [("", "d", [*range(6, 15), 99])]
    assert index.num_tokens == 10 and len(index) == 1
    index.check_integrity()


def test_removing_everything_leaves_no_nodes():
    index = index_of([1, 2, 3, 1, 2], [2, 3, 4], [])
    index.extend("", "s1", [2, 3])
    index.extend("", "new", [7, 7])  # unknown: added
    assert len(index) == 4 and index.num_nodes > 0
    for sid in ("s0", "s1", "s2", "new", "never-added"):
        index.remove(sid)
        index.check_integrity()
    assert index.num_nodes == 0 and index.num_tokens == 0 and len(index) == 0


def test_extend_in_another_namespace_is_refused():
    index = index_of([1, 2])
    with pytest.raises(ValueError, match="namespace"):
        index.extend("other", "s0", [3])


def test_check_integrity_finds_a_wrong_count():
    index = index_of([1, 2, 3], [1, 2, 4])
    index.check_integrity()
    children = index._roots[""].children
    assert children is not None
    children[1].count += 1
    with pytest.raises(DraftIndexError):
        index.check_integrity()


# -- AdaptiveLength -------------------------------------------------------------------


def test_adaptive_length_grows_shrinks_and_switches_off():
    a = AdaptiveLength(4, probe_every=3)
    assert a.next_k() == 4
    a.observe(4, 4)
    assert a.k == 4  # full acceptance, at max_k already
    a.observe(4, 1)
    assert a.k == 4  # partly accepted: held until one divergence, k stays
    a.observe(4, 0)
    assert a.k == 2  # rejected: halved
    a.observe(2, 2)
    assert a.k == 3  # fully accepted: one more
    a.observe(3, 0)
    assert a.k == 1  # rejected: halved
    a.observe(0, 0)
    assert a.k == 1  # nothing drafted: nothing learned
    a.observe(1, 0)
    assert a.k == 0 and a.next_k() == 0


def test_adaptive_length_probes_its_way_back_from_zero():
    a = AdaptiveLength(4, probe_every=3)
    for drafted in (4, 2, 1):
        a.observe(drafted, 0)
    assert a.k == 0
    assert [a.next_k() for _ in range(6)] == [0, 0, 1, 0, 0, 1]
    a.observe(1, 0)  # a failed probe: still off, the next one after twice the wait
    assert [a.next_k() for _ in range(6)] == [0, 0, 0, 0, 0, 1]
    a.observe(1, 1)  # an accepted probe: back on
    assert a.next_k() == 2
    a.observe(2, 2)
    assert a.next_k() == 3
    a.observe(3, 0)  # rejected: halved; the waits start again from probe_every
    a.observe(1, 0)
    assert [a.next_k() for _ in range(3)] == [0, 0, 1]


def test_adaptive_length_goes_off_when_few_drafts_hold():
    a = AdaptiveLength(4, min_rate=0.9)
    a.observe(4, 3)  # share accepted 0.7 x 1 + 0.3 x 0.75 = 0.925: on
    assert a.k == 4
    a.observe(4, 2)  # 0.7 x 0.925 + 0.3 x 0.5 = 0.80 < 0.9: off, though k would stay 4
    assert a.k == 0


def test_adaptive_length_may_start_off():
    a = AdaptiveLength(4, probe_every=2, start_off=True)
    assert [a.next_k() for _ in range(2)] == [0, 1]
    a.observe(1, 1)
    assert a.k == 2


def test_adaptive_length_probe_waits_are_capped():
    a = AdaptiveLength(2, probe_every=2, max_probe_every=8)
    a.observe(2, 0)
    a.observe(1, 0)
    assert a.k == 0
    waits = []
    for _ in range(5):
        n = 1
        while a.next_k() == 0:
            n += 1
        waits.append(n)
        a.observe(1, 0)
    assert waits == [2, 4, 8, 8, 8]


def test_adaptive_length_of_zero_never_probes():
    a = AdaptiveLength(0, probe_every=1)
    assert [a.next_k() for _ in range(3)] == [0, 0, 0]


# -- propose --------------------------------------------------------------------------


def test_propose_by_algorithm():
    assert ALGORITHMS == ("none", "ngram", "suffix")
    index = index_of([1, 2, 9, 9, 9])
    own = [1, 2, 3, 1, 2]
    assert propose("none", index, "", "r", own, 3) == []
    assert propose("ngram", index, "", "r", own, 3) == [3, 1, 2]
    assert propose("suffix", index, "", "r", own, 3) == [3, 1, 2]  # own tokens: k of them
    fresh = [7, 1, 2]  # nothing of its own to look up: the index drafts
    assert propose("ngram", index, "", "r", fresh, 3) == []
    assert propose("suffix", index, "", "r", fresh, 3) == [9, 9, 9]
    assert propose("suffix", None, "", "r", fresh, 3) == []
    assert propose("suffix", index, "other", "r", fresh, 3) == []
    with pytest.raises(ValueError, match="unknown draft algorithm"):
        propose("eagle", index, "", "r", own, 3)


def test_propose_excluding_the_requests_own_windows():
    index = index_of([1, 2, 9, 9, 9], [1, 2, 1, 2])  # s1 is the running request
    toks = [1, 2, 1, 2]
    assert ngram_draft(toks, 3) == [1, 2]  # short of k: the index is asked
    # Its own [1, 2] -> 1 ties the other's [1, 2] -> 9 and is more recent: no longer draft.
    assert propose("suffix", index, "", "s1", toks, 3) == [1, 2]
    assert propose("suffix", index, "", "s1", toks, 3, exclude_own=True) == [9, 9, 9]
