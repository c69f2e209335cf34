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
        # torch.empty: on CPU the pages are committed only when written.
        self.k_buffer = torch.empty(dims, dtype=shape.dtype, device=device)
        self.v_buffer = torch.empty(dims, dtype=shape.dtype, device=device)
        self.k_buffer[:, 0].zero_()
        self.v_buffer[:, 0].zero_()
        # Per-layer views, what the attention layers index.
        self.k = list(self.k_buffer.unbind(0))
        self.v = list(self.v_buffer.unbind(0))

    def nbytes(self) -> int:
        return self.k_buffer.nbytes + self.v_buffer.nbytes


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
) -> int:
    """KV slots to allocate (slot 0 excluded)."""
    if max_total_tokens > 0:
        return max_total_tokens
    budget = kv_budget_bytes(device, mem_fraction, weight_bytes)
    tokens = budget // shape.bytes_per_token()
    if tokens <= 0:
        raise ValueError(
            f"--mem-fraction-static leaves no memory for the KV cache (budget {budget} bytes after "
            f"{weight_bytes} bytes of weights); raise it or set --max-total-tokens"
        )
    if tokens > cap_tokens:
        log.info("KV pool capped at %d tokens (memory would allow %d)", cap_tokens, tokens)
    return int(min(tokens, cap_tokens))
