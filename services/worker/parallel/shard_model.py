"""Turns a Llama-family model built on the meta device into one rank's shard and fills it
from the checkpoint's slices, so tensor parallelism stays out of the model file. The split
is in docs/tensor-parallel.md; norms and rotary stay whole, and a rank's KV pool holds its
own kv heads under shared slot numbers. AWQ checkpoints are refused with the reason.
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
    """Refuses, naming the numbers, what --tp-size cannot split."""
    if getattr(config, "quantization_config", None):
        raise ValueError(
            "tensor parallelism: AWQ checkpoints are not split yet (their int4 groups would "
            "have to align with each rank's rows); run them with --tp-size 1"
        )
    local_heads(config, tp)
    even_span(config.intermediate_size, tp.rank, tp.world, "intermediate_size")


def shard_model(model: LlamaForCausalLM, tp: TpGroup) -> LlamaForCausalLM:
    """Swaps in this rank's parallel projections, on the meta device before ``to_empty``."""
    config = model.config
    check_shardable(config, tp)
    with torch.device("meta"):
        embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
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
    """This rank's shard, filled from its slices only; the bytes it read."""
    with torch.device("meta"):
        model = get_model_class(architecture_of(config))(config)
    shard_model(model, tp).to(dtype).to_empty(device=device)
    bytes_read = load_shard(model, ShardedCheckpoint(safetensors_files(model_path)), _STACKED)
    return model.eval(), bytes_read


def load_for_rank(
    model_path: str, config, dtype: torch.dtype, device: torch.device, tp: TpGroup
) -> tuple[LlamaForCausalLM, int]:
    """The whole model with one rank (exactly TP=1's loader), else this rank's shard; the
    bytes read under TP (0 otherwise)."""
    if tp.world == 1:
        return load_model(model_path, dtype, device, config=config, progress=False)[0], 0
    return load_rank_model(model_path, config, dtype, device, tp)
