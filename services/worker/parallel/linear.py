"""Megatron's two linears: column-parallel (split output rows, no communication) and
row-parallel (split input columns, one all-reduce of the partial sums).

Both are layers.Linear underneath, so a CPU rank packs them like any other. ``slices``
names the part of each checkpoint tensor a module needs; checkpoint.py reads just those.
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
    """Rows ``span`` along ``dim`` (None: whole) of checkpoint tensor ``shard``'s ``leaf``
    go into ``target``."""

    shard: int
    leaf: str
    dim: int | None
    span: Span | None
    target: torch.Tensor


class ColumnParallelLinear(FusedLinear):
    """Output rows split: of each stacked checkpoint tensor this rank keeps ``spans``."""

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
    """Input columns split: partial products summed over ranks, then the bias added once."""

    def __init__(self, span: Span, out_features: int, bias: bool, tp: TpGroup):
        super().__init__(span.size, out_features, bias=False)
        self.span, self.tp = span, tp
        self.reduced_bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(super().forward(x))
        return y if self.reduced_bias is None else y + self.reduced_bias

    def slices(self) -> list[SliceTarget]:
        out = [SliceTarget(0, "weight", 1, self.span, self.weight.data)]
        if self.reduced_bias is not None:
            out.append(SliceTarget(0, "bias", None, None, self.reduced_bias.data))
        return out


def qkv_parallel(
    hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, tp: TpGroup
) -> ColumnParallelLinear:
    """q, k and v fused, this rank's heads of each (kv heads copied if fewer than ranks)."""
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
    heads = even_span(num_heads, tp.rank, tp.world, "num_attention_heads")
    return RowParallelLinear(Span(heads.start * head_dim, heads.size * head_dim), hidden, bias, tp)


def down_parallel(intermediate: int, hidden: int, bias: bool, tp: TpGroup) -> RowParallelLinear:
    span = even_span(intermediate, tp.rank, tp.world, "intermediate_size")
    return RowParallelLinear(span, hidden, bias, tp)
