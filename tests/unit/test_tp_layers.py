"""Column/row-parallel linears, the vocabulary-parallel embedding and lm_head, and the
slice loader, on 2 and 4 gloo ranks against plain float32 math (within 1e-5).

One small checkpoint per shape, named as a Llama decoder layer is (q/k/v/o, gate/up/down,
embed_tokens, lm_head); each rank reads only its slices of it (parallel/checkpoint.py) and
runs one layer's worth of TP pieces: the embedding, q/k/v with a toy head-wise mixing in
place of attention (so a q head paired with the wrong kv head shows), o (all-reduce), the
gated MLP (all-reduce) and the gathered logits. Each shape runs eagerly, then with the
linears packed for oneDNN (layers.Linear.pack), as a CPU worker runs them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from tp_util import run_ranks

from services.worker.layers import Linear
from services.worker.parallel.checkpoint import ShardedCheckpoint, load_sharded
from services.worker.parallel.group import TpGroup
from services.worker.parallel.linear import (
    down_parallel,
    gate_up_parallel,
    o_parallel,
    qkv_parallel,
)
from services.worker.parallel.vocab import ParallelLMHead, VocabParallelEmbedding

TOL = 1e-5
STACKED = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
P = "model.layers.0."


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int = 4
    hidden: int = 32
    intermediate: int = 48
    vocab: int = 101
    tied: bool = False
    bias: bool = True  # q/k/v bias (Qwen2) and, to test the row-parallel bias, o's


def make_checkpoint(folder: Path, shape: Shape, seed: int) -> Path:
    g = torch.Generator().manual_seed(seed)

    def w(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g) * 0.2

    s, d = shape, shape.head_dim
    tensors = {
        "model.embed_tokens.weight": w(s.vocab, s.hidden),
        P + "self_attn.q_proj.weight": w(s.heads * d, s.hidden),
        P + "self_attn.k_proj.weight": w(s.kv_heads * d, s.hidden),
        P + "self_attn.v_proj.weight": w(s.kv_heads * d, s.hidden),
        P + "self_attn.o_proj.weight": w(s.hidden, s.heads * d),
        P + "mlp.gate_proj.weight": w(s.intermediate, s.hidden),
        P + "mlp.up_proj.weight": w(s.intermediate, s.hidden),
        P + "mlp.down_proj.weight": w(s.hidden, s.intermediate),
    }
    if s.bias:
        for name, rows in (("q", s.heads * d), ("k", s.kv_heads * d), ("v", s.kv_heads * d)):
            tensors[P + f"self_attn.{name}_proj.bias"] = w(rows)
        tensors[P + "self_attn.o_proj.bias"] = w(s.hidden)
    if not s.tied:
        tensors["lm_head.weight"] = w(s.vocab, s.hidden)
    path = folder / f"shape{seed}.safetensors"
    save_file(tensors, str(path))
    return path


class Pieces(nn.Module):
    """The TP modules of one decoder layer, under the checkpoint's names."""

    def __init__(self, s: Shape, tp: TpGroup):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(s.vocab, s.hidden, tp)
        attn, mlp, layer = nn.Module(), nn.Module(), nn.Module()
        attn.qkv_proj = qkv_parallel(s.hidden, s.heads, s.kv_heads, s.head_dim, s.bias, tp)
        attn.o_proj = o_parallel(s.heads, s.head_dim, s.hidden, s.bias, tp)
        mlp.gate_up_proj = gate_up_parallel(s.hidden, s.intermediate, False, tp)
        mlp.down_proj = down_parallel(s.intermediate, s.hidden, False, tp)
        layer.self_attn, layer.mlp = attn, mlp
        self.model.layers = nn.ModuleList([layer])
        tied = self.model.embed_tokens if s.tied else None
        self.lm_head = ParallelLMHead(s.vocab, s.hidden, tp, tied=tied, gather_to=None)
        self.s = s

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.model.layers[0]
        x = self.model.embed_tokens(ids)
        qkv = layer.self_attn.qkv_proj(x)
        q_size, kv_size = layer.self_attn.qkv_proj.shard_sizes[:2]
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        h = x + layer.self_attn.o_proj(mix_heads(q, k, v, self.s.head_dim))
        gate, up = layer.mlp.gate_up_proj(h).chunk(2, dim=-1)
        h = h + layer.mlp.down_proj(F.silu(gate) * up)
        return h, self.lm_head(h)


def mix_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: int) -> torch.Tensor:
    """A head-wise stand-in for attention: q head h times (k + v) of its kv group."""
    t = q.shape[0]
    q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)  # [T, H(KVH), D]
    group = q.shape[1] // k.shape[1]
    kv = (k + v).repeat_interleave(group, dim=1)  # [T, H, D]
    return (q * torch.tanh(kv)).reshape(t, -1)


def reference(s: Shape, w: dict[str, torch.Tensor], ids: torch.Tensor):
    """The same pieces on the whole tensors, with plain nn.Linear / nn.Embedding."""

    def linear(name: str) -> nn.Linear:
        weight = w[name + ".weight"]
        m = nn.Linear(weight.shape[1], weight.shape[0], bias=name + ".bias" in w)
        m.weight.data.copy_(weight)
        if m.bias is not None:
            m.bias.data.copy_(w[name + ".bias"])
        return m

    embed = nn.Embedding.from_pretrained(w["model.embed_tokens.weight"])
    a, m = P + "self_attn.", P + "mlp."
    with torch.no_grad():
        x = embed(ids)
        q, k, v = (linear(a + n + "_proj")(x) for n in "qkv")
        h = x + linear(a + "o_proj")(mix_heads(q, k, v, s.head_dim))
        h = h + linear(m + "down_proj")(
            F.silu(linear(m + "gate_proj")(h)) * linear(m + "up_proj")(h)
        )
        head = w["model.embed_tokens.weight"] if s.tied else w["lm_head.weight"]
        return h, F.linear(h, head)


def check_shapes(tp: TpGroup, cases: list[tuple[dict, str]]) -> None:
    for fields, path in cases:
        s = Shape(**fields)
        full = load_file(path)
        ids = torch.arange(s.vocab).flip(0)[: min(s.vocab, 40)]  # every rank's rows, the last
        want_h, want_logits = reference(s, full, ids)
        with torch.device("meta"):
            pieces = Pieces(s, tp)
        pieces.to_empty(device="cpu")
        ckpt = ShardedCheckpoint([Path(path)])
        read = load_sharded(pieces, ckpt, STACKED)
        whole = sum(t.nbytes for t in full.values())
        assert read < whole or tp.world == 1, "a rank read the whole checkpoint"
        for packed in (False, True):
            if packed:
                for m in pieces.modules():
                    if isinstance(m, Linear):
                        m.pack()
            with torch.inference_mode():
                h, logits = pieces(ids)
            where = f"rank {tp.rank}/{tp.world} {s} packed={packed}"
            assert logits.shape == (len(ids), s.vocab), where
            torch.testing.assert_close(h, want_h, atol=TOL, rtol=TOL, msg=where)
            torch.testing.assert_close(logits, want_logits, atol=TOL, rtol=TOL, msg=where)


def run_shapes(tmp_path: Path, world: int, shapes: list[Shape]) -> None:
    cases = [(asdict(s), str(make_checkpoint(tmp_path, s, i))) for i, s in enumerate(shapes)]
    run_ranks(check_shapes, world, cases)


def test_two_ranks(tmp_path: Path) -> None:
    run_shapes(
        tmp_path,
        2,
        [
            Shape(heads=28, kv_heads=4),  # GQA 7:1, vocabulary 101: odd
            Shape(heads=28, kv_heads=4, tied=True, bias=False, vocab=97),
            Shape(heads=4, kv_heads=1, head_dim=8, vocab=64),  # kv heads copied to both
        ],
    )


def test_four_ranks(tmp_path: Path) -> None:
    run_shapes(
        tmp_path,
        4,
        [
            Shape(heads=28, kv_heads=4, vocab=97),  # GQA 7:1, one kv head per rank
            Shape(heads=8, kv_heads=2, tied=True),  # each kv head on two ranks
        ],
    )


def test_one_rank_needs_no_process_group(tmp_path: Path) -> None:
    """World 1: the same modules, no torch.distributed, the same math."""
    shape = Shape(heads=4, kv_heads=2, tied=True)
    check_shapes(TpGroup(), [(asdict(shape), str(make_checkpoint(tmp_path, shape, 0)))])


def test_a_rank_is_refused_a_checkpoint_that_does_not_fit(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, Shape(heads=4, kv_heads=2), 0)
    with torch.device("meta"):
        pieces = Pieces(Shape(heads=8, kv_heads=2), TpGroup(rank=1, world=2))
    pieces.to_empty(device="cpu")
    with pytest.raises(ValueError, match=r"q_proj.weight.*needs rows \[16, 32\)"):
        load_sharded(pieces, ShardedCheckpoint([path]), STACKED)
