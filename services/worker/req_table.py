"""The worker's mirror of the request-slot table: (request slot, position) -> KV slot.

    table[r, p] = KV slot holding the K/V of position p of the request in row r

The scheduler owns the bookkeeping; the worker only writes what each ForwardRequest
says (prefix_slots when is_new, out_slots always) and gathers each request's context.
Everything here is vectorised: no Python loop per token. Index tensors may live on the host
(the runner computes them there, sizes known without a device sync); they move to the
table's device for the indexing itself.
"""

from __future__ import annotations

import torch


def segment_arange(lens: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenated ``starts[b] + arange(lens[b])`` for every b, without a Python loop.

    lens [B] int64 (>= 0) -> [sum(lens)] int64."""
    total = int(lens.sum())
    offsets = torch.cumsum(lens, 0) - lens  # first index of each segment
    idx = torch.arange(total, device=lens.device) - torch.repeat_interleave(
        offsets, lens, output_size=total
    )
    if starts is not None:
        idx += torch.repeat_interleave(starts, lens, output_size=total)
    return idx


class ReqToTokenTable:
    def __init__(self, max_running_requests: int, max_context: int, device: torch.device):
        self.max_running_requests = max_running_requests
        self.max_context = max_context
        # int32 halves the table; gathered slots are widened to int64 for indexing.
        self.table = torch.zeros(
            (max_running_requests, max_context), dtype=torch.int32, device=device
        )

    def write(
        self, req_slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Row req_slots[b], positions starts[b] .. starts[b]+lens[b]-1 <- the next lens[b]
        of slots.

        req_slots, starts, lens: [B] int64; slots: [sum(lens)]."""
        if slots.numel() == 0:
            return
        rows = torch.repeat_interleave(req_slots, lens, output_size=slots.numel())
        cols = segment_arange(lens, starts)
        dev = self.table.device
        self.table[rows.to(dev), cols.to(dev)] = slots.to(device=dev, dtype=self.table.dtype)

    def gather(self, req_slots: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Each request's slots of positions [0, seq_lens[b]), concatenated.

        -> [sum(seq_lens)] int64."""
        rows = torch.repeat_interleave(req_slots, seq_lens, output_size=int(seq_lens.sum()))
        cols = segment_arange(seq_lens)
        dev = self.table.device
        return self.table[rows.to(dev), cols.to(dev)].long()
