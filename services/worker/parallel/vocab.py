"""The vocabulary split across the ranks: the embedding table and the lm_head.

Rank r holds rows [r P, r P + P), P = ceil(V / N); rows past V are padding, never looked up
and cut off after the gather. Logits are gathered whole (to rank 0, which samples), so the
tokens do not depend on N. A tied head reads the embedding's own slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers import Linear
from services.worker.parallel.group import TpGroup
from services.worker.parallel.linear import SliceTarget
from services.worker.parallel.partition import vocab_span


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TpGroup):
        super().__init__()
        self.span, per_rank = vocab_span(vocab_size, tp.rank, tp.world)
        self.vocab_size, self.tp = vocab_size, tp
        self.weight = nn.Parameter(torch.empty(per_rank, hidden))  # [P, hidden]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.span.start
        foreign = (local < 0) | (local >= self.span.size)  # held by another rank
        x = F.embedding(local.masked_fill(foreign, 0), self.weight)  # [T, hidden]
        x.masked_fill_(foreign.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)  # exactly one rank adds a nonzero row: exact

    def slices(self) -> list[SliceTarget]:
        return [SliceTarget(0, "weight", 0, self.span, self.weight.data[: self.span.size])]

    def zero_padding(self) -> None:
        """Zeroes the rows past the vocabulary, so nothing uninitialised lies in the model."""
        self.weight.data[self.span.size :].zero_()


class ParallelLMHead(nn.Module):
    """hidden -> logits [T, V] float32 on rank ``gather_to`` (None: every rank), [T, 0]
    elsewhere. ``tied``: the embedding's table is the head."""

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        tp: TpGroup,
        tied: VocabParallelEmbedding | None = None,
        gather_to: int | None = 0,
    ):
        super().__init__()
        self.span, per_rank = vocab_span(vocab_size, tp.rank, tp.world)
        self.vocab_size, self.tp, self.gather_to = vocab_size, tp, gather_to
        self.proj = Linear(hidden, per_rank, bias=False) if tied is None else None
        # Not a submodule: the table stays the embedding's one parameter.
        self._tied: list[VocabParallelEmbedding] = [tied] if tied is not None else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.proj(x) if self.proj is not None else F.linear(x, self._tied[0].weight)
        if self.gather_to is None:
            full: torch.Tensor | None = self.tp.all_gather_last(local)
        else:
            full = self.tp.gather_last(local, self.gather_to)
        if full is None:
            return x.new_empty(x.shape[0], 0, dtype=torch.float32)
        return full[:, : self.vocab_size].float()  # [T, V]

    def slices(self) -> list[SliceTarget]:
        if self.proj is None:
            return []  # tied: the embedding loads the table
        return [SliceTarget(0, "weight", 0, self.span, self.proj.weight.data[: self.span.size])]

    def zero_padding(self) -> None:
        if self.proj is not None:
            self.proj.weight.data[self.span.size :].zero_()
