"""The worker's mirror of the request-slot table: (request slot, position) -> KV slot.

    table[r, p] = KV slot holding the K/V of position p of the request in row r

The scheduler owns the bookkeeping; the worker only writes what each ForwardRequest
says (prefix_slots when is_new, out_slots always). The attention backends read rows of this
table directly (AttentionMeta.req_to_token), so a step never lists every context slot: its
host work is O(new tokens), whatever the context lengths.

One extra row, ``padding_row``, stays all zeros: padded rows of a CUDA-graph batch point at
it and read slot 0 (the pool's padding slot) as their one-token context.
"""

from __future__ import annotations

import torch


class ReqToTokenTable:
    def __init__(self, max_running_requests: int, max_context: int, device: torch.device):
        self.max_running_requests = max_running_requests
        self.max_context = max_context
        self.padding_row = max_running_requests
        # int32 halves the table; the kernels widen slots to int64 before addressing the pool.
        self.table = torch.zeros(
            (max_running_requests + 1, max_context), dtype=torch.int32, device=device
        )

    def write_tokens(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """table[rows[i], cols[i]] <- slots[i]: the slots of a step's new tokens (rows, cols
        and slots [T], already on the table's device)."""
        if slots.numel():
            self.table[rows, cols] = slots.to(self.table.dtype)

    def write_prefix(self, row: int, slots: torch.Tensor) -> None:
        """Positions [0, len(slots)) of row: a cached prefix taken by a new request."""
        self.table[row, : slots.numel()] = slots.to(
            device=self.table.device, dtype=self.table.dtype
        )

    def row(self, row: int, length: int) -> torch.Tensor:
        """Slots of positions [0, length) of row, int64 (tests and debugging)."""
        return self.table[row, :length].long()
