"""The plain-PyTorch attention backend: the CPU default and the reference for the kernels.

float32 / bfloat16 on CPU: C kernels (kernels/cpu/decode_attention.py, extend_attention.py)
read each context's K/V in place through the request-to-slot table, since gathering cost
more than the attention; an extend whose requests have a few rows each (a verify step's)
takes the decode kernel's rows entry, longer ones the extend kernel. Elsewhere: decode
gathers a padded [B, Lmax] slot matrix plus a length mask; extend runs SDPA per request
with the causal mask shifted by prefix_len. A mixed batch's trailing one-row requests go
to the decode kernel together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu import decode_attention as cpu_decode_attention
from kernels.cpu import extend_attention as cpu_extend_attention
from services.worker.attention.base import AttentionBackend, AttentionMeta, register_backend

_KV = tuple[torch.Tensor, torch.Tensor]  # (K, V)


@dataclass
class _ExtendItem:
    q_start: int
    q_end: int
    kv_slots: torch.Tensor | None  # [seq_len] context slots; None when there is no prefix
    mask: torch.Tensor | None  # [extend, seq_len] bool; None: plain causal


@register_backend
class TorchBackend(AttentionBackend):
    name = "torch"
    # Tests switch the C kernels off for the torch path.
    use_cpu_kernel = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float):
        super().__init__(num_heads, num_kv_heads, head_dim, sm_scale)
        self.group = num_heads // num_kv_heads
        self._kernel = cpu_decode_attention.load() if self.use_cpu_kernel else None
        self._extend_kernel = cpu_extend_attention.load() if self.use_cpu_kernel else None
        self._rows_kernel = cpu_decode_attention.load_rows() if self.use_cpu_kernel else None
        self._few_rows = False  # every extend request left for a kernel has few rows
        self._decode_meta: AttentionMeta | None = None
        self._req_slots = self._seq_lens = torch.empty(0, dtype=torch.int32)  # [B] (kernel)
        self._decode_slots: torch.Tensor | None = None  # [B, Lmax] int64 (torch path)
        self._decode_mask: torch.Tensor | None = None  # [B, 1, 1, Lmax] additive float
        self._qo: list[int] = []  # the extend batch's qo_indptr
        self._extend: list[_ExtendItem] | None = None  # SDPA path, built on demand
        # (req_slots, qo_indptr, prefix_lens) int32 for the extend kernel.
        self._extend_args: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # (first row, rows, req_slots, seq_lens) of the trailing (decode) one-row requests.
        self._singles: tuple[int, int, torch.Tensor, torch.Tensor] | None = None

    def prepare(self, meta: AttentionMeta) -> None:
        if meta.is_decode:
            self._prepare_decode(meta)
        else:
            self._prepare_extend(meta)

    def _prepare_decode(self, meta: AttentionMeta) -> None:
        # The kernel reads contiguous int32 [B] vectors by pointer.
        self._req_slots = meta.req_slots.to(torch.int32).contiguous()
        self._seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        self._decode_meta = meta
        self._decode_slots = self._decode_mask = None  # built by the torch path on demand

    def _prepare_gather(self, meta: AttentionMeta) -> None:
        seq_lens = meta.seq_lens.long()
        cols = torch.arange(meta.max_seq_len, device=seq_lens.device)[None, :]  # [1, Lmax]
        valid = cols < seq_lens[:, None]  # [B, Lmax]
        rows = meta.req_to_token[:, : meta.max_seq_len].index_select(0, meta.req_slots.long())
        self._decode_slots = rows.long().masked_fill_(~valid, 0)
        mask = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
        self._decode_mask = mask.masked_fill_(~valid, float("-inf"))[:, None, None, :]

    def _prepare_extend(self, meta: AttentionMeta) -> None:
        qo = self._qo = meta.qo_indptr.tolist()
        self._singles = self._single_rows(meta, qo) if self._kernel is not None else None
        kernel_from = len(qo) - 1 - (self._singles[1] if self._singles else 0)
        rows = max((qo[i + 1] - qo[i] for i in range(kernel_from)), default=0)
        self._few_rows = rows * self.group <= cpu_decode_attention.MAX_LANES
        self._extend_args = None
        if self._extend_kernel is not None:
            # forward builds slots and masks if the kernel cannot read the tensors after all.
            i32 = torch.int32
            self._extend_args = (
                meta.req_slots.to(i32).contiguous(),
                meta.qo_indptr.to(i32).contiguous(),
                meta.prefix_lens.to(i32).contiguous(),
            )
            self._extend = None
        else:  # the decode kernel's requests get no context of their own
            self._extend = self._items(meta, qo, range(kernel_from))

    @staticmethod
    def _items(meta: AttentionMeta, qo: list[int], batch: range) -> list[_ExtendItem]:
        """Per request: its rows, and with a prefix its context slots and shifted causal mask."""
        prefix, req_rows = meta.prefix_lens.tolist(), meta.req_slots.tolist()
        dev = meta.req_to_token.device
        items = []
        for b in batch:
            p, n_new = prefix[b], qo[b + 1] - qo[b]
            if p == 0:
                items.append(_ExtendItem(qo[b], qo[b + 1], None, None))
                continue
            rows = torch.arange(n_new, device=dev)[:, None] + p
            mask = torch.arange(p + n_new, device=dev)[None, :] <= rows
            slots = meta.req_to_token[req_rows[b], : p + n_new].long()
            items.append(_ExtendItem(qo[b], qo[b + 1], slots, mask))
        return items

    @staticmethod
    def _single_rows(
        meta: AttentionMeta, qo: list[int]
    ) -> tuple[int, int, torch.Tensor, torch.Tensor] | None:
        """The trailing run of requests with one new row each (a mixed batch's decodes)."""
        b = len(qo) - 1
        first = b
        while first > 0 and qo[first] - qo[first - 1] == 1:
            first -= 1
        if first == b:
            return None
        req_slots = meta.req_slots[first:].to(torch.int32).contiguous()
        seq_lens = meta.seq_lens[first:].to(torch.int32).contiguous()
        return qo[first], b - first, req_slots, seq_lens

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        meta: AttentionMeta,
    ) -> torch.Tensor:
        k_pool.index_copy_(0, meta.out_slots, k)
        v_pool.index_copy_(0, meta.out_slots, v)
        if meta.is_decode:
            return self._decode(q, k_pool, v_pool)
        return self._extend_attention(q, (k, v), (k_pool, v_pool), meta)

    def _decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        meta = self._decode_meta
        assert meta is not None, "prepare() a decode batch first"
        if self._kernel is not None and cpu_decode_attention.supports(q, k_pool, meta.req_to_token):
            return self._kernel(
                q, k_pool, v_pool, meta.req_to_token, self._req_slots, self._seq_lens, self.sm_scale
            )
        if self._decode_slots is None:  # once per batch: later layers reuse it
            self._prepare_gather(meta)
        slots, mask = self._decode_slots, self._decode_mask
        assert slots is not None and mask is not None
        if mask.dtype != q.dtype:  # once per batch: later layers find it cast
            mask = self._decode_mask = mask.to(q.dtype)
        b, lmax = slots.shape
        flat = slots.view(-1)
        # index_select copies whole rows (memcpy); advanced indexing is ~10x slower on CPU.
        keys = k_pool.index_select(0, flat).view(b, lmax, self.num_kv_heads, self.head_dim)
        values = v_pool.index_select(0, flat).view(b, lmax, self.num_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.view(b, self.num_heads, 1, self.head_dim),  # [B, H, 1, D]
            keys.transpose(1, 2),  # [B, KVH, Lmax, D] (a view)
            values.transpose(1, 2),
            attn_mask=mask,  # [B, 1, 1, Lmax] 0 / -inf
            scale=self.sm_scale,
            enable_gqa=self.group > 1,
        )
        return out.view(b, self.num_heads, self.head_dim)

    def _extend_attention(
        self, q: torch.Tensor, new: _KV, pools: _KV, meta: AttentionMeta
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D] contiguous
        n = self._extend_decodes(q, pools, meta, out)  # requests 0 .. n are left
        if n == 0:
            return out
        args = self._extend_args
        if args is not None and cpu_extend_attention.supports(q, pools[0], meta.req_to_token):
            req_slots, qo, prefix = args
            kernel = (self._few_rows and self._rows_kernel) or self._extend_kernel
            assert kernel is not None
            kernel(
                q, *pools, meta.req_to_token, req_slots[:n], qo[: n + 1], prefix[:n],
                self.sm_scale, out=out,
            )  # fmt: skip
            return out
        if self._extend is None or len(self._extend) != n:  # once per batch
            self._extend = self._items(meta, self._qo, range(n))
        for item in self._extend:
            s, e = item.q_start, item.q_end
            kh, vh = self._context_kv(item, new, pools)  # each [1, KVH, S, D]
            o = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1)[None],  # [1, H, E, D]
                kh,
                vh,
                attn_mask=item.mask,
                is_causal=item.mask is None,
                scale=self.sm_scale,
                enable_gqa=self.group > 1,
            )
            out[s:e] = o[0].transpose(0, 1)  # [1, H, E, D] -> [E, H, D]
        return out

    def _extend_decodes(
        self, q: torch.Tensor, pools: _KV, meta: AttentionMeta, out: torch.Tensor
    ) -> int:
        """Runs the trailing one-row requests on the decode kernel; returns how many remain."""
        b = len(self._qo) - 1
        single = self._singles
        if single is None or self._kernel is None:
            return b
        if not cpu_decode_attention.supports(q, pools[0], meta.req_to_token):
            return b
        start, n, req_slots, seq_lens = single
        out[start : start + n] = self._kernel(
            q[start : start + n], *pools, meta.req_to_token, req_slots, seq_lens, self.sm_scale
        )
        return b - n

    @staticmethod
    def _context_kv(item: _ExtendItem, new: _KV, pools: _KV) -> _KV:
        """K and V of the item's context: its new rows, or gathered from the pool."""
        if item.kv_slots is None:
            k, v = new[0][item.q_start : item.q_end], new[1][item.q_start : item.q_end]
        else:
            k, v = pools[0].index_select(0, item.kv_slots), pools[1].index_select(0, item.kv_slots)
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [S, KVH, D] -> [1, KVH, S, D]
