"""The host tier of the hierarchical cache: K and V of every layer in host memory, indexed
by host slot, and the copies between it and the device pool that the scheduler decides.

    k_buffer: [num_layers, num_slots + 1, kv_heads, head_dim]   (v alike; slot 0 unused)

The scheduler owns which host slot holds what (services/scheduler/host_tier.py); this only
copies what it is told, in order, before the batch's forward. On CUDA the buffer is pinned,
so a copy is one DMA per direction; on CPU both tiers are RAM and a copy is a gather.
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np
import torch

from services.worker.kv_pool import KVPool, KVShape, cpu_memory_bytes

log = logging.getLogger(__name__)

# The host tier may take at most this share of the memory the process may use: the rest is
# the weights, the activations and, on CPU, the device pool itself.
MAX_HOST_SHARE = 0.8
# engine.proto's KVCopy.Direction values. This module imports no protobuf stubs (the GPU
# check runs the model runner on an image without them); a test checks they agree.
D2H = 1
H2D = 2


class KVCopyMsg(Protocol):
    """engine_pb2.KVCopy, as far as the copies read it."""

    direction: int
    src_slots: bytes
    dst_slots: bytes


def _slots(raw: bytes) -> np.ndarray:
    if len(raw) % 4:
        raise ValueError(f"KVCopy: {len(raw)} bytes of slots is not a whole number of int32")
    return np.frombuffer(raw, dtype="<i4").astype(np.int64)


def host_tier_tokens(shape: KVShape, device_slots: int, ratio: float, size_gib: float) -> int:
    """Slots of the host tier: --hicache-size GiB, else --hicache-ratio x the device pool."""
    if ratio < 0 or size_gib < 0:
        raise ValueError("--hicache-ratio and --hicache-size must be >= 0")
    per_token = shape.bytes_per_token()
    tokens = int(size_gib * 2**30) // per_token if size_gib > 0 else int(ratio * device_slots)
    limit = int(cpu_memory_bytes() * MAX_HOST_SHARE)
    if tokens * per_token > limit:
        raise ValueError(
            f"the host tier (--hicache-size / --hicache-ratio) needs "
            f"{tokens * per_token / 2**30:.2f} GiB, more than {MAX_HOST_SHARE:.0%} of the "
            f"{cpu_memory_bytes() / 2**30:.1f} GiB this process may use; lower it"
        )
    return tokens


class HostPool:
    def __init__(self, shape: KVShape, num_slots: int, pin: bool):
        self.num_slots = num_slots
        dims = (shape.num_layers, num_slots + 1, shape.num_kv_heads, shape.head_dim)
        self.k_buffer = torch.zeros(dims, dtype=shape.dtype, pin_memory=pin)
        self.v_buffer = torch.zeros(dims, dtype=shape.dtype, pin_memory=pin)
        self.bytes_moved: dict[int, int] = {D2H: 0, H2D: 0}

    def nbytes(self) -> int:
        return self.k_buffer.nbytes + self.v_buffer.nbytes

    def apply(self, copies: list[KVCopyMsg], pool: KVPool) -> None:
        """Runs the copies in order. Raises ValueError, having copied nothing, when any is
        malformed (unknown direction, lengths differ, a slot out of either pool)."""
        plan = [self._checked(c, pool.num_slots) for c in copies]
        for direction, src, dst in plan:
            if direction == D2H:
                index = torch.from_numpy(src).to(pool.k_buffer.device, non_blocking=True)
                out = torch.from_numpy(dst)
                for dev, host in ((pool.k_buffer, self.k_buffer), (pool.v_buffer, self.v_buffer)):
                    host[:, out] = dev.index_select(1, index).to("cpu")
            else:
                index = torch.from_numpy(src)
                out = torch.from_numpy(dst).to(pool.k_buffer.device, non_blocking=True)
                for dev, host in ((pool.k_buffer, self.k_buffer), (pool.v_buffer, self.v_buffer)):
                    dev[:, out] = host.index_select(1, index).to(dev.device, non_blocking=True)
            self.bytes_moved[direction] += len(src) * self._bytes_per_slot()

    def _bytes_per_slot(self) -> int:
        return 2 * self.k_buffer[:, 0].nbytes

    def _checked(self, c: KVCopyMsg, device_slots: int) -> tuple[int, np.ndarray, np.ndarray]:
        if c.direction not in (D2H, H2D):
            raise ValueError(f"KVCopy: unknown direction {c.direction}")
        src, dst = _slots(c.src_slots), _slots(c.dst_slots)
        if len(src) != len(dst):
            raise ValueError(f"KVCopy: {len(src)} source slots but {len(dst)} destinations")
        src_max, dst_max = (
            (device_slots, self.num_slots) if c.direction == D2H else (self.num_slots, device_slots)
        )
        for name, slots, top in (("source", src, src_max), ("destination", dst, dst_max)):
            if len(slots) and (slots.min() < 1 or slots.max() > top):
                raise ValueError(f"KVCopy: a {name} slot is outside 1..{top}")
        return c.direction, src, dst
