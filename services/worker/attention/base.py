"""The attention-backend interface and the per-batch metadata every backend reads.

A batch holds B requests. Request b computes ``extend_lens[b]`` new tokens whose positions
are ``prefix_lens[b] .. seq_lens[b] - 1``; its first ``prefix_lens[b]`` tokens are already
in the KV pool. The new tokens of all requests are concatenated into T rows:

    rows of request b:      qo_indptr[b] .. qo_indptr[b+1]             (T = qo_indptr[B])
    its whole context:      req_to_token[req_slots[b], 0 .. seq_lens[b]]
                            (one KV slot per position, in position order)
    slots of its new rows:  out_slots[qo_indptr[b] .. qo_indptr[b+1]]
                            == the last extend_lens[b] entries of its context row

Backends read the request-to-slot table (services/worker/req_table.py) directly, as
SGLang's kernels do: per-step host work stays O(batch), never O(total context).

A backend first stores the new K/V at ``out_slots`` and then attends: query row i of
request b (position prefix_lens[b] + i) sees context positions 0 .. prefix_lens[b] + i.
Decode is the case extend_lens == 1 for every request.
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
        """Once per batch, before the layers run (precompute what all layers share)."""

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
