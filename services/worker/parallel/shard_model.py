"""Turns a Llama-family model (models/llama.py), built on the meta device, into one rank's
shard, and fills it from the checkpoint's slices: tensor parallelism stays out of the
model file (as gpt-fast keeps it), which runs unchanged on a rank's heads.

    embed_tokens          -> VocabParallelEmbedding   (all-reduce)
    self_attn.qkv_proj    -> column-parallel, this rank's q and kv heads
    self_attn.o_proj      -> row-parallel              (all-reduce: after attention)
    mlp.gate_up_proj      -> column-parallel, I / N
    mlp.down_proj         -> row-parallel              (all-reduce: after the MLP)
    lm_head (tied or not) -> ParallelLMHead            (logits gathered on rank 0)

Norms, rotary tables and q/k norms (Qwen3) stay whole on every rank. Each Attention and
GatedMLP is told its local head and row counts, and the runner sizes the backend and the
KV pool with ``local_heads``: a rank's pool holds its kv heads only, the slot numbers are
the same on every rank. AWQ checkpoints are refused here, with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.layers import Attention, GatedMLP
from services.worker.model_loader import architecture_of, load_model, safetensors_files
from services.worker.models import get_model_class
from services.worker.models.llama import _STACKED, LlamaForCausalLM
from services.worker.parallel.checkpoint import ShardedCheckpoint, load_sharded
from services.worker.parallel.group import TpGroup
from services.worker.parallel.linear import (
    down_parallel,
    gate_up_parallel,
    o_parallel,
    qkv_parallel,
)
from services.worker.parallel.partition import even_span, head_shard
from services.worker.parallel.vocab import ParallelLMHead, VocabParallelEmbedding


def local_heads(config, tp: TpGroup) -> tuple[int, int]:
    """(q heads, kv heads) a rank computes: what its backend and KV pool are sized for."""
    heads = config.num_attention_heads
    kv = config.num_key_value_heads or heads
    shard = head_shard(heads, kv, tp.rank, tp.world)
    return shard.q.size, shard.kv.size


def check_shardable(config, tp: TpGroup) -> None:
    """Refuses, naming the numbers, what --tp-size cannot split (before any weight loads)."""
    if getattr(config, "quantization_config", None):
        raise ValueError(
            "tensor parallelism: AWQ checkpoints are not split yet (their int4 groups would "
            "have to align with each rank's rows); run them with --tp-size 1"
        )
    local_heads(config, tp)
    even_span(config.intermediate_size, tp.rank, tp.world, "intermediate_size")


def shard_model(model: LlamaForCausalLM, tp: TpGroup) -> LlamaForCausalLM:
    """Replaces the model's projections by this rank's parallel ones (on the meta device,
    before ``to_empty``). Returns the model."""
    config = model.config
    check_shardable(config, tp)
    with torch.device("meta"):
        embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        # The parallel modules take the places of nn.Embedding and Linear: same calls.
        model.model.embed_tokens = embed  # type: ignore[assignment]
        for layer in model.model.layers:
            assert isinstance(layer.self_attn, Attention) and isinstance(layer.mlp, GatedMLP)
            _shard_attention(layer.self_attn, config, tp)
            _shard_mlp(layer.mlp, config, tp)
        tied = embed if model.lm_head is None else None
        head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, tied=tied)
        model.lm_head = head  # type: ignore[assignment]
    return model


def _shard_attention(attn: Attention, config, tp: TpGroup) -> None:
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    d, bias = attn.head_dim, attn.qkv_proj.bias is not None
    attn.qkv_proj = qkv_parallel(config.hidden_size, heads, kv_heads, d, bias, tp)
    o_bias = attn.o_proj.bias is not None
    attn.o_proj = o_parallel(heads, d, config.hidden_size, o_bias, tp)
    attn.num_heads, attn.num_kv_heads = local_heads(config, tp)
    attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d


def _shard_mlp(mlp: GatedMLP, config, tp: TpGroup) -> None:
    bias = mlp.down_proj.bias is not None
    mlp.gate_up_proj = gate_up_parallel(config.hidden_size, config.intermediate_size, bias, tp)
    down = down_parallel(config.intermediate_size, config.hidden_size, bias, tp)
    mlp.down_proj, mlp.intermediate = down, down.span.size


def load_shard(
    model: LlamaForCausalLM, ckpt: ShardedCheckpoint, stacked: Sequence[tuple[str, str, int]]
) -> int:
    """Fills a sharded model (after ``to_empty``) from its slices; the bytes this rank read."""
    return load_sharded(model, ckpt, stacked)


def load_rank_model(
    model_path: str, config, dtype: torch.dtype, device: torch.device, tp: TpGroup
) -> tuple[LlamaForCausalLM, int]:
    """This rank's shard, built on the meta device and filled from its slices of the
    checkpoint (no rank reads the whole of it); the bytes it read."""
    with torch.device("meta"):
        model = get_model_class(architecture_of(config))(config)
    shard_model(model, tp).to(dtype).to_empty(device=device)
    bytes_read = load_shard(model, ShardedCheckpoint(safetensors_files(model_path)), _STACKED)
    return model.eval(), bytes_read


def load_for_rank(
    model_path: str, config, dtype: torch.dtype, device: torch.device, tp: TpGroup
) -> tuple[LlamaForCausalLM, int]:
    """The whole model with one rank (the worker's own loader, exactly TP=1's), else this
    rank's shard; the bytes read under TP (0 otherwise)."""
    if tp.world == 1:
        return load_model(model_path, dtype, device, config=config, progress=False)[0], 0
    return load_rank_model(model_path, config, dtype, device, tp)
