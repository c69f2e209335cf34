"""Megatron's two linears: column-parallel (split output rows, no communication) and
row-parallel (split input columns, one all-reduce of the partial sums).

In a decoder layer q/k/v and gate/up are column-parallel, o and down row-parallel, so the
activations between them stay split and each layer communicates twice: one all-reduce
after attention, one after the MLP.

    x [T, hidden] --qkv (column)--> [T, (H + 2 KVH) D / N] --attention--> [T, H D / N]
                  --o (row)--> partial [T, hidden] --all-reduce--> [T, hidden]

Both are layers.Linear underneath, so a CPU rank packs them for oneDNN like any other.
A module says which slice of which checkpoint tensor fills each of its tensors
(``slices``); the loader (checkpoint.py) reads just those bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.worker.layers import FusedLinear, Linear
from services.worker.parallel.group import TpGroup
from services.worker.parallel.partition import Span, even_span, head_shard


@dataclass(frozen=True)
class SliceTarget:
    """Checkpoint tensor ``shard`` (of a fused module; else 0), leaf ``leaf`` (weight,
    bias): rows ``span`` along ``dim`` (dim None: the whole tensor) go into ``target``."""

    shard: int
    leaf: str
    dim: int | None
    span: Span | None
    target: torch.Tensor


class ColumnParallelLinear(FusedLinear):
    """Output rows split: of each checkpoint tensor stacked in it (q, k, v or gate, up)
    this rank keeps the rows in ``spans``. Its output is this rank's slice; no collective."""

    def __init__(self, in_features: int, spans: list[Span], bias: bool, tp: TpGroup):
        super().__init__(in_features, [s.size for s in spans], bias=bias)
        self.spans, self.tp = list(spans), tp

    def slices(self) -> list[SliceTarget]:
        out = []
        for shard, span in enumerate(self.spans):
            out.append(SliceTarget(shard, "weight", 0, span, self._view("weight", shard)))
            if self.bias is not None:
                out.append(SliceTarget(shard, "bias", 0, span, self._view("bias", shard)))
        return out

    def _view(self, leaf: str, shard: int) -> torch.Tensor:
        return self.shard_view(leaf, getattr(self, leaf).data, shard)


class RowParallelLinear(Linear):
    """Input columns split (``span`` of them, the rank's slice of the activations): the
    partial products are summed over the ranks, then the bias, which is whole on every
    rank, is added once."""

    def __init__(self, span: Span, out_features: int, bias: bool, tp: TpGroup):
        super().__init__(span.size, out_features, bias=False)  # the bias after the reduce
        self.span, self.tp = span, tp
        self.reduced_bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(super().forward(x))  # [T, out], summed over ranks
        return y if self.reduced_bias is None else y + self.reduced_bias

    def slices(self) -> list[SliceTarget]:
        out = [SliceTarget(0, "weight", 1, self.span, self.weight.data)]
        if self.reduced_bias is not None:
            out.append(SliceTarget(0, "bias", None, None, self.reduced_bias.data))
        return out


def qkv_parallel(
    hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, tp: TpGroup
) -> ColumnParallelLinear:
    """q, k and v fused, this rank's heads of each (partition.head_shard: kv heads split,
    or copied when fewer than the ranks)."""
    heads = head_shard(num_heads, num_kv_heads, tp.rank, tp.world)
    q = Span(heads.q.start * head_dim, heads.q.size * head_dim)
    kv = Span(heads.kv.start * head_dim, heads.kv.size * head_dim)
    return ColumnParallelLinear(hidden, [q, kv, kv], bias, tp)


def gate_up_parallel(
    hidden: int, intermediate: int, bias: bool, tp: TpGroup
) -> ColumnParallelLinear:
    span = even_span(intermediate, tp.rank, tp.world, "intermediate_size")
    return ColumnParallelLinear(hidden, [span, span], bias, tp)


def o_parallel(
    num_heads: int, head_dim: int, hidden: int, bias: bool, tp: TpGroup
) -> RowParallelLinear:
    """o_proj: its input is this rank's q heads' attention output."""
    heads = even_span(num_heads, tp.rank, tp.world, "num_attention_heads")
    return RowParallelLinear(Span(heads.start * head_dim, heads.size * head_dim), hidden, bias, tp)


def down_parallel(intermediate: int, hidden: int, bias: bool, tp: TpGroup) -> RowParallelLinear:
    span = even_span(intermediate, tp.rank, tp.world, "intermediate_size")
    return RowParallelLinear(span, hidden, bias, tp)
