"""Which heads, rows and vocabulary entries each rank owns (services/worker/parallel/
partition.py), and the layouts refused, naming their numbers. No processes."""

from __future__ import annotations

import pytest

from services.worker.parallel.partition import Span, even_span, head_shard, vocab_span

# (heads, kv heads, ranks): GQA 7:1 (Qwen2.5-7B's 28:4), kv heads fewer than the ranks,
# multi-head, multi-query.
SHAPES = [(28, 4, 2), (28, 4, 4), (14, 2, 2), (8, 2, 4), (8, 2, 8), (16, 16, 4), (8, 1, 4)]


@pytest.mark.parametrize("heads,kv,world", SHAPES)
def test_every_q_head_keeps_its_kv_head(heads: int, kv: int, world: int) -> None:
    """Rank r's q heads read the kv heads their GQA group maps to in the whole model."""
    group = heads // kv
    seen_q = []
    for rank in range(world):
        s = head_shard(heads, kv, rank, world)
        for h in range(s.q.start, s.q.stop):
            local_kv = (h - s.q.start) // (s.q.size // s.kv.size)
            assert s.kv.start + local_kv == h // group
        seen_q += range(s.q.start, s.q.stop)
        assert s.kv_replicas == max(1, world // kv)
    assert seen_q == list(range(heads))


@pytest.mark.parametrize(
    "heads,kv,world,words",
    [
        (14, 2, 4, ["num_attention_heads (14)", "--tp-size 4"]),
        (24, 6, 4, ["num_key_value_heads (6)", "--tp-size 4"]),
        (24, 4, 3, ["num_key_value_heads (4)", "--tp-size 3"]),
        (12, 4, 8, ["num_attention_heads (12)", "--tp-size 8"]),
    ],
)
def test_unsplittable_heads_are_refused_with_numbers(
    heads: int, kv: int, world: int, words: list[str]
) -> None:
    with pytest.raises(ValueError) as e:
        head_shard(heads, kv, 0, world)
    for w in words:
        assert w in str(e.value)


def test_kv_heads_fewer_than_ranks_need_ranks_a_multiple() -> None:
    with pytest.raises(ValueError, match=r"--tp-size 6 is not a multiple of num_key_value"):
        head_shard(12, 4, 0, 6)  # 12 % 6 == 0, 4 < 6, 6 % 4 != 0


def test_even_span_names_the_dimension() -> None:
    assert even_span(12, 2, 3, "intermediate_size") == Span(8, 4)
    with pytest.raises(ValueError, match=r"intermediate_size \(10\) .* --tp-size 4"):
        even_span(10, 0, 4, "intermediate_size")


@pytest.mark.parametrize("vocab,world", [(100, 2), (101, 2), (97, 4), (3, 4), (1000, 3)])
def test_vocab_spans_cover_the_vocabulary_once(vocab: int, world: int) -> None:
    spans = [vocab_span(vocab, r, world) for r in range(world)]
    per_rank = spans[0][1]
    assert all(p == per_rank for _, p in spans) and per_rank * world >= vocab
    covered = [i for s, _ in spans for i in range(s.start, s.stop)]
    assert covered == list(range(vocab))
    assert all(0 <= s.size <= per_rank for s, _ in spans)
