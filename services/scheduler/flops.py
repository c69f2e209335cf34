"""Estimated FLOPs and bytes of a forward batch, from the model's shape alone: 2 per weight
per token, the attention term growing with context, the LM head for sampled tokens.
"""

from __future__ import annotations

from radixserve.internal.v1 import engine_pb2

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def linear_params_per_layer(info: engine_pb2.WorkerInfo) -> int:
    h, d = info.hidden_size, info.head_dim
    q, kv = info.num_attention_heads * d, info.num_key_value_heads * d
    return h * q + 2 * h * kv + q * h + 3 * h * info.intermediate_size


def batch_cost(
    info: engine_pb2.WorkerInfo, items: list[tuple[int, int, bool]]
) -> tuple[float, float, float]:
    """(flops, read_bytes, write_bytes) for items of (first position, new tokens, sampled)."""
    layers = info.num_layers
    per_token = 2 * layers * linear_params_per_layer(info)
    attn_unit = 4 * layers * info.num_attention_heads * info.head_dim
    kv_token_bytes = (
        2 * layers * info.num_key_value_heads * info.head_dim * DTYPE_BYTES.get(info.dtype, 4)
    )
    flops = read = write = 0.0
    for start, n, sample in items:
        context_sum = n * start + n * (n + 1) // 2  # sum over new tokens of (position + 1)
        flops += per_token * n + attn_unit * context_sum
        if sample:
            flops += 2 * info.hidden_size * info.vocab_size
        read += kv_token_bytes * (start + n)
        write += kv_token_bytes * n
    read += info.num_parameters * DTYPE_BYTES.get(info.dtype, 4)  # weights, once per batch
    return flops, read, write
