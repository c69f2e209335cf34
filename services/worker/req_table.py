"""The worker's mirror of the request-slot table: table[r, p] = KV slot of position p of
the request in row r. The worker only writes what each ForwardRequest says. The extra
``padding_row`` stays zeros: padded CUDA-graph rows read slot 0 through it.
"""

from __future__ import annotations

import torch


class ReqToTokenTable:
    def __init__(self, max_running_requests: int, max_context: int, device: torch.device):
        self.max_running_requests = max_running_requests
        self.max_context = max_context
        self.padding_row = max_running_requests
        # int32 halves the table; kernels widen slots to int64 before addressing the pool.
        self.table = torch.zeros(
            (max_running_requests + 1, max_context), dtype=torch.int32, device=device
        )

    def write_tokens(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """table[rows[i], cols[i]] <- slots[i], all [T] on the table's device."""
        if slots.numel():
            self.table[rows, cols] = slots.to(self.table.dtype)

    def write_prefix(self, row: int, slots: torch.Tensor) -> None:
        """Positions [0, len(slots)) of row: a cached prefix taken by a new request."""
        self.table[row, : slots.numel()] = slots.to(
            device=self.table.device, dtype=self.table.dtype
        )

    def row(self, row: int, length: int) -> torch.Tensor:
        return self.table[row, :length].long()
