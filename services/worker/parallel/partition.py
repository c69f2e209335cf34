"""Which part of each weight a rank owns: plain arithmetic, refused with the numbers.

Megatron's split, as vLLM and SGLang make it:

    q heads       H / N per rank, contiguous           (H % N == 0)
    kv heads      KVH >= N: KVH / N per rank            (KVH % N == 0)
                  KVH <  N: one per rank, each kept by N / KVH ranks (N % KVH == 0)
    intermediate  I / N per rank                        (I % N == 0)
    vocabulary    ceil(V / N) rows per rank, the last rank's tail padded with zeros

With kv heads replicated, rank r's q heads [r H/N, (r+1) H/N) all read kv head
r KVH / N (integer division), which is the one their GQA group maps to: the grouping of
the unsharded model is kept exactly.
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
    """One rank's attention heads: q heads and kv heads (global indices), and how many
    ranks hold a copy of each of its kv heads (1 when kv heads are split, not copied)."""

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
    """Rank's heads (module docstring). ValueError names the numbers it cannot split."""
    check_heads(num_heads, num_kv_heads, world)
    q = even_span(num_heads, rank, world, "num_attention_heads")
    if num_kv_heads >= world:
        return HeadShard(q, even_span(num_kv_heads, rank, world, "num_key_value_heads"), 1)
    replicas = world // num_kv_heads
    return HeadShard(q, Span(rank // replicas, 1), replicas)


def check_heads(num_heads: int, num_kv_heads: int, world: int) -> None:
    """Refuses a head layout tensor parallelism cannot split, naming the numbers."""
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
    """Rank's rows of the vocabulary (the last rank's may be short, even empty) and the
    padded per-rank row count every rank allocates, so gathered logits have one shape."""
    per_rank = -(-vocab_size // world)
    start = min(rank * per_rank, vocab_size)
    return Span(start, min(per_rank, vocab_size - start)), per_rank
