"""The ``triton`` attention backend: the kernels of ``kernels/`` over the paged KV pool.

Compiled on CUDA; on a machine without CUDA, Triton's interpreter runs the same kernels on
CPU tensors (slowly: meant for tests, the ``torch`` backend is the CPU choice).
"""

from __future__ import annotations

import torch

from kernels.triton.decode_attention import decode_attention
from kernels.triton.extend_attention import extend_attention
from kernels.triton.kv_store import store_kv
from services.worker.attention.base import AttentionBackend, AttentionMeta, register_backend


def choose_num_kv_splits(batch_size: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per context in decode (flash-decoding): enough programs to cover every SM a
    few times. Shapes alone, never context lengths, so a captured CUDA graph stays valid."""
    if device.type != "cuda":
        return 2
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(4, min(16, -(-4 * sms // (batch_size * num_kv_heads))))


@register_backend
class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sm_scale: float,
        num_kv_splits: int | None = None,
    ):
        super().__init__(num_heads, num_kv_heads, head_dim, sm_scale)
        self.num_kv_splits = num_kv_splits  # None: choose_num_kv_splits per batch

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_pool: torch.Tensor,  # [num_slots + 1, num_kv_heads, head_dim]
        v_pool: torch.Tensor,
        meta: AttentionMeta,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        store_kv(k_pool, v_pool, meta.out_slots, k, v)
        if meta.is_decode:
            splits = self.num_kv_splits or choose_num_kv_splits(
                q.shape[0], self.num_kv_heads, q.device
            )
            return decode_attention(
                q,
                k_pool,
                v_pool,
                meta.req_to_token,
                meta.req_slots,
                meta.seq_lens,
                self.sm_scale,
                splits,
            )
        return extend_attention(
            q,
            k_pool,
            v_pool,
            meta.qo_indptr,
            meta.req_to_token,
            meta.req_slots,
            meta.prefix_lens,
            self.sm_scale,
            meta.max_extend_len,
        )
