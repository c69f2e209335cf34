"""The paged KV pool: k[layer], v[layer] [num_slots + 1, kv_heads, head_dim] by KV slot.
Slot 0 is padding, always zeros (a masked-out score times V never makes NaN).

Sizing: --max-total-tokens, else a --mem-fraction-static share of device memory (on CPU
min(RAM, cgroup limit)) less the weights, capped at max_running_requests * context_length.
On CUDA what is allocated after the pool (``RuntimeReserve``) is budgeted first, so a too
high share is refused at start-up rather than at graph capture or a long prefill.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

DEFAULT_MEM_FRACTION = {"cuda": 0.85, "cpu": 0.3}


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


class KVPool:
    def __init__(self, shape: KVShape, num_slots: int, device: torch.device):
        self.shape = shape
        self.num_slots = num_slots
        dims = (shape.num_layers, num_slots + 1, shape.num_kv_heads, shape.head_dim)
        # Zeroed whole so CPU pages are committed now, not inside a forward's KV store.
        self.k_buffer = torch.zeros(dims, dtype=shape.dtype, device=device)
        self.v_buffer = torch.zeros(dims, dtype=shape.dtype, device=device)
        self.k = list(self.k_buffer.unbind(0))
        self.v = list(self.v_buffer.unbind(0))

    def nbytes(self) -> int:
        return self.k_buffer.nbytes + self.v_buffer.nbytes


# Activations are budgeted for a prefill of this many tokens (the scheduler's GPU default).
RESERVE_PREFILL_TOKENS = 8192
WORKSPACE_BYTES = 256 << 20  # cuBLAS / Triton workspaces, allocator slack


@dataclass(frozen=True)
class RuntimeReserve:
    """Device memory taken after the KV pool is sized, estimated from the model's shapes."""

    hidden_size: int
    intermediate_size: int
    qkv_size: int  # (q heads + 2 kv heads) * head_dim
    vocab_size: int
    dtype: torch.dtype
    max_running_requests: int
    graph_batch_rows: int  # sum of the captured CUDA-graph batch sizes (0: no graphs)

    def bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_token = (4 * self.hidden_size + 3 * self.intermediate_size + self.qkv_size) * elem
        prefill = RESERVE_PREFILL_TOKENS * per_token
        sampled_logits = 3 * self.max_running_requests * self.vocab_size * 4  # + softmax copies
        sampler_counts = self.max_running_requests * self.vocab_size * 4
        graph_logits = self.graph_batch_rows * self.vocab_size * 4
        return prefill + sampled_logits + sampler_counts + graph_logits + WORKSPACE_BYTES


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = open(path).read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:
            return int(raw)
    return None


def cpu_memory_bytes() -> int:
    """Memory this process may use: min(physical RAM, cgroup limit)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_limit()
    return min(physical, limit) if limit else physical


def kv_budget_bytes(device: torch.device, mem_fraction: float, weight_bytes: int) -> int:
    """Bytes the KV pool may take, the weights being already loaded."""
    frac = mem_fraction or DEFAULT_MEM_FRACTION.get(device.type, 0.3)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free - total * (1.0 - frac))
    return int(cpu_memory_bytes() * frac) - weight_bytes


def pool_size_tokens(
    shape: KVShape,
    device: torch.device,
    max_total_tokens: int,
    mem_fraction: float,
    weight_bytes: int,
    cap_tokens: int,
    reserve: RuntimeReserve | None = None,
) -> int:
    """KV slots to allocate (slot 0 excluded)."""
    reserved = reserve.bytes() if reserve is not None and device.type == "cuda" else 0
    if max_total_tokens > 0:
        if reserved:
            _check_fits(device, max_total_tokens * shape.bytes_per_token(), reserved)
        return max_total_tokens
    budget = kv_budget_bytes(device, mem_fraction, weight_bytes) - reserved
    tokens = budget // shape.bytes_per_token()
    if tokens <= 0:
        raise ValueError(
            f"--mem-fraction-static leaves no memory for the KV cache: {budget / 2**30:.2f} GiB "
            f"after {weight_bytes / 2**30:.2f} GiB of weights and {reserved / 2**30:.2f} GiB "
            "reserved for activations, CUDA graphs and the sampler; raise it, lower "
            "--max-running-requests / --cuda-graph-max-bs, or set --max-total-tokens"
        )
    if tokens > cap_tokens:
        log.info("KV pool capped at %d tokens (memory would allow %d)", cap_tokens, tokens)
    return int(min(tokens, cap_tokens))


def _check_fits(device: torch.device, pool_bytes: int, reserved: int) -> None:
    free, _ = torch.cuda.mem_get_info(device)
    if pool_bytes + reserved > free:
        raise ValueError(
            f"--max-total-tokens needs {pool_bytes / 2**30:.2f} GiB of KV pool plus "
            f"{reserved / 2**30:.2f} GiB reserved for activations, CUDA graphs and the sampler, "
            f"but only {free / 2**30:.2f} GiB is free; lower it"
        )
