"""The attention-backend interface and the per-batch metadata every backend reads.

Request b's new tokens are rows qo_indptr[b] .. qo_indptr[b+1] at positions
prefix_lens[b] .. seq_lens[b] - 1; its whole context is req_to_token[req_slots[b], :seq_lens[b]].
Backends read that table directly, so per-step host work is O(batch), never O(context).
A backend stores the new K/V at ``out_slots``, then attends causally; decode is
extend_lens == 1 for every request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMeta:
    is_decode: bool
    out_slots: torch.Tensor  # [T] int64: KV slot of each new token
    qo_indptr: torch.Tensor  # [B+1] int32: row offsets of each request's new tokens
    req_to_token: torch.Tensor  # [R, C] int32: the whole table (row, position) -> KV slot
    req_slots: torch.Tensor  # [B] int32: each request's row of req_to_token
    prefix_lens: torch.Tensor  # [B] int32: tokens already in the pool before this batch
    extend_lens: torch.Tensor  # [B] int32: new tokens in this batch
    seq_lens: torch.Tensor  # [B] int32: prefix_lens + extend_lens
    max_seq_len: int
    max_extend_len: int

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])


class AttentionBackend:
    """Stores new K/V into the pool and computes attention reading the pool by slot."""

    name = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sm_scale = sm_scale

    def prepare(self, meta: AttentionMeta) -> None:
        """Once per batch, before the layers run."""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_pool: torch.Tensor,  # [num_slots + 1, num_kv_heads, head_dim] (this layer's)
        v_pool: torch.Tensor,  # [num_slots + 1, num_kv_heads, head_dim]
        meta: AttentionMeta,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        raise NotImplementedError


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: makes a backend selectable by ``--attention-backend <cls.name>``."""
    _BACKENDS[cls.name] = cls
    return cls


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(
            f"--attention-backend {name!r} is unknown; choose one of {backend_names()}"
        )
    return _BACKENDS[name]
