"""The paged KV pool: K and V of every layer, indexed by KV slot.

    k[layer]: [num_slots + 1, kv_heads, head_dim]     (v alike)
    slot 0    padding: always zeros, never handed out by the scheduler; padded gathers
              read it (zeros, so a masked-out score times V can never make NaN)
    slots 1.. what the scheduler's allocator hands out (max_total_num_tokens of them)

Sizing: an explicit --max-total-tokens wins. Otherwise a share (--mem-fraction-static) of
the device memory holds weights + KV, and the KV gets what the weights leave; on CPU the
"device memory" is what this process may use: physical RAM or the cgroup limit, whichever
is smaller. The pool is then capped at max_running_requests * context_length: more slots
than every running row could fill only hold cached prefixes, and reserving gigabytes of
RAM for a tiny model helps nobody.

On CUDA, what is allocated after the pool is budgeted before it (``RuntimeReserve``): the
sampler's per-slot tables, the captured graphs' static logits, the activations of the
largest prefill batch and the workspaces the first kernels create. Without it a high
--mem-fraction-static sizes the pool fine and then fails at graph capture or at the first
long prefill; with it start-up refuses at once, naming the numbers.
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
        # Zeroed whole, which on CPU commits every page now: left to the first write of each
        # slot, the kernel zeroed each (huge) page inside the KV store of a forward, one
        # thread working while the other waited, until the pool had filled once. vLLM also
        # commits its pool at start-up. Slot 0 must be zeros anyway (above).
        self.k_buffer = torch.zeros(dims, dtype=shape.dtype, device=device)
        self.v_buffer = torch.zeros(dims, dtype=shape.dtype, device=device)
        # Per-layer views, what the attention layers index.
        self.k = list(self.k_buffer.unbind(0))
        self.v = list(self.v_buffer.unbind(0))

    def nbytes(self) -> int:
        return self.k_buffer.nbytes + self.v_buffer.nbytes


# Activations are budgeted for a prefill batch of this many tokens: what the scheduler's
# default --max-prefill-tokens (0) gives a GPU worker (DEFAULT_MAX_PREFILL_TOKENS in
# services/scheduler/prefill.py; a larger setting on a nearly full GPU needs a lower share).
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
        # Everything already allocated (weights, context) counts against the share.
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
    """An explicit --max-total-tokens must leave the runtime reserve free on the device."""
    free, _ = torch.cuda.mem_get_info(device)
    if pool_bytes + reserved > free:
        raise ValueError(
            f"--max-total-tokens needs {pool_bytes / 2**30:.2f} GiB of KV pool plus "
            f"{reserved / 2**30:.2f} GiB reserved for activations, CUDA graphs and the sampler, "
            f"but only {free / 2**30:.2f} GiB is free; lower it"
        )
