"""Which part of each weight a rank owns: plain arithmetic, refused with the numbers.

Megatron's split as vLLM and SGLang make it (rules: docs/tensor-parallel.md). With kv heads
replicated, rank r's q heads all read kv head r KVH / N, the one their GQA group maps to,
so the unsharded model's grouping is kept exactly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """Rows [start, start + size) of a dimension."""

    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size


@dataclass(frozen=True)
class HeadShard:
    """One rank's q and kv heads (global indices) and how many ranks hold each kv head."""

    q: Span
    kv: Span
    kv_replicas: int


def even_span(size: int, rank: int, world: int, what: str) -> Span:
    """Rank's 1/world of ``size`` rows; ValueError naming ``what`` when it does not divide."""
    if size % world:
        raise ValueError(
            f"tensor parallelism: {what} ({size}) is not divisible by --tp-size {world}"
        )
    part = size // world
    return Span(rank * part, part)


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadShard:
    check_heads(num_heads, num_kv_heads, world)
    q = even_span(num_heads, rank, world, "num_attention_heads")
    if num_kv_heads >= world:
        return HeadShard(q, even_span(num_kv_heads, rank, world, "num_key_value_heads"), 1)
    replicas = world // num_kv_heads
    return HeadShard(q, Span(rank // replicas, 1), replicas)


def check_heads(num_heads: int, num_kv_heads: int, world: int) -> None:
    if num_heads % world:
        raise ValueError(
            f"tensor parallelism: num_attention_heads ({num_heads}) is not divisible by "
            f"--tp-size {world}; use a --tp-size that divides it"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads "
            f"({num_kv_heads})"
        )
    if num_kv_heads >= world and num_kv_heads % world:
        raise ValueError(
            f"tensor parallelism: num_key_value_heads ({num_kv_heads}) is not divisible by "
            f"--tp-size {world}"
        )
    if num_kv_heads < world and world % num_kv_heads:
        raise ValueError(
            f"tensor parallelism: --tp-size {world} is not a multiple of num_key_value_heads "
            f"({num_kv_heads}), so the kv heads cannot be copied evenly across the ranks"
        )


def vocab_span(vocab_size: int, rank: int, world: int) -> tuple[Span, int]:
    """Rank's vocabulary rows (maybe short or empty) and the padded per-rank row count, so
    gathered logits have one shape."""
    per_rank = -(-vocab_size // world)
    start = min(rank * per_rank, vocab_size)
    return Span(start, min(per_rank, vocab_size - start)), per_rank
