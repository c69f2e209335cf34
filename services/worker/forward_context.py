"""What every layer of one forward step shares, built once per batch (so a CUDA graph
recomputes the rotary tables on every replay). Passed explicitly, never a global: two
runners in one process stay apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.attention.base import AttentionBackend, AttentionMeta
from services.worker.kv_pool import KVPool


@dataclass(frozen=True)
class ForwardContext:
    positions: torch.Tensor  # [T] int64: position of each new token in its sequence
    cos: torch.Tensor  # [T, head_dim // 2]: rotary tables at those positions
    sin: torch.Tensor  # [T, head_dim // 2]
    attn: AttentionMeta  # slots, offsets and lengths of the batch (attention/base.py)
    backend: AttentionBackend
    kv_pool: KVPool

    def attention(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Stores this layer's new K/V, then attends: q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
        k_pool, v_pool = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
        return self.backend.forward(q, k, v, k_pool, v_pool, self.attn)
