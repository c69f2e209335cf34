"""The host tier of the hierarchical cache: K and V of every layer in host memory, indexed
by host slot (slot 0 unused), and the copies the scheduler orders between it and the
device pool, run in order before the batch's forward. On CUDA the buffer is pinned and
copies run on their own stream, so the worker's thread never waits for the GPU.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import numpy as np
import torch

from services.worker.kv_pool import KVPool, KVShape, cpu_memory_bytes
from services.worker.page_store import PageStore, split_keys

log = logging.getLogger(__name__)

# The rest is weights, activations and, on CPU, the device pool itself.
MAX_HOST_SHARE = 0.8
# No protobuf import here (the GPU check's image lacks the stubs); a test checks they agree.
D2H, H2D, D2S, S2H, CLEAR = 1, 2, 3, 4, 5  # engine.proto KVCopy.Direction


class KVCopyMsg(Protocol):
    """engine_pb2.KVCopy, as far as the copies read it."""

    direction: int
    src_slots: bytes
    dst_slots: bytes
    keys: bytes
    load_id: int


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
    def __init__(self, shape: KVShape, num_slots: int, pin: bool, store: PageStore | None = None):
        self.num_slots = num_slots
        dims = (shape.num_layers, num_slots + 1, shape.num_kv_heads, shape.head_dim)
        self.k_buffer = torch.zeros(dims, dtype=shape.dtype, pin_memory=pin)
        self.v_buffer = torch.zeros(dims, dtype=shape.dtype, pin_memory=pin)
        self.store = store
        self.cuda: _CudaCopies | None = None  # set at the first copy from a CUDA pool
        self.bytes_moved: dict[int, int] = dict.fromkeys((D2H, H2D, D2S, S2H, CLEAR), 0)
        self.seconds_moving: dict[int, float] = dict.fromkeys((D2H, H2D, D2S, S2H, CLEAR), 0.0)

    def nbytes(self) -> int:
        return self.k_buffer.nbytes + self.v_buffer.nbytes

    def apply(self, copies: list[KVCopyMsg], pool: KVPool) -> list[tuple[int, int]]:
        """Runs the copies in order; returns (load_id, pages found) of each storage load.
        Raises ValueError, having copied nothing, when any is malformed."""
        plan = [self._checked(c, pool.num_slots) for c in copies]
        if pool.k_buffer.is_cuda and self.cuda is None:
            self.cuda = _CudaCopies(pool.k_buffer.device)
        if self.cuda is not None:
            self.cuda.finish(self)  # last batch's demotions land before anything reads them
        loads = []
        for c, (src, dst, keys) in zip(copies, plan, strict=True):
            start = time.perf_counter()
            if c.direction == D2H:
                self._to_host(pool, src, dst)
            elif c.direction == H2D:
                self._to_device(pool, src, dst)
            elif c.direction == CLEAR:
                assert self.store is not None
                log.info("storage tier: %d pages deleted (FlushCache)", self.store.clear())
            elif c.direction == D2S:
                assert self.store is not None
                index = torch.from_numpy(src).to(pool.k_buffer.device, non_blocking=True)
                k, v = (b.index_select(1, index).to("cpu") for b in (pool.k_buffer, pool.v_buffer))
                self.store.write(keys, k, v)
            else:
                loads.append((c.load_id, self._from_store(keys, dst)))
                src = dst[: loads[-1][1] * self.page_tokens]
            self.bytes_moved[c.direction] += len(src) * self._bytes_per_slot()
            self.seconds_moving[c.direction] += time.perf_counter() - start
        return loads

    def _to_host(self, pool: KVPool, src: np.ndarray, dst: np.ndarray) -> None:
        if self.cuda is not None:
            self.cuda.to_host(pool, src, dst)
            return
        index = torch.from_numpy(src).to(pool.k_buffer.device, non_blocking=True)
        out = torch.from_numpy(dst)
        for dev, host in ((pool.k_buffer, self.k_buffer), (pool.v_buffer, self.v_buffer)):
            host[:, out] = dev.index_select(1, index).to("cpu")

    def _to_device(self, pool: KVPool, src: np.ndarray, dst: np.ndarray) -> None:
        if self.cuda is not None:
            self.cuda.finish(self)  # a demotion of this same batch may be what it reloads
            self.cuda.to_device(self, pool, src, dst)
            return
        index = torch.from_numpy(src)
        out = torch.from_numpy(dst).to(pool.k_buffer.device, non_blocking=True)
        for dev, host in ((pool.k_buffer, self.k_buffer), (pool.v_buffer, self.v_buffer)):
            dev[:, out] = host.index_select(1, index).to(dev.device, non_blocking=True)

    def _from_store(self, keys: list[bytes], dst: np.ndarray) -> int:
        assert self.store is not None
        pages = self.store.read_leading(keys)
        p = self.page_tokens
        for i, (k, v) in enumerate(pages):
            out = torch.from_numpy(dst[i * p : (i + 1) * p])
            self.k_buffer[:, out] = k
            self.v_buffer[:, out] = v
        return len(pages)

    @property
    def page_tokens(self) -> int:
        return self.store.page_tokens if self.store is not None else 0

    def _bytes_per_slot(self) -> int:
        return 2 * self.k_buffer[:, 0].nbytes

    def _checked(
        self, c: KVCopyMsg, device_slots: int
    ) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
        if c.direction not in (D2H, H2D, D2S, S2H, CLEAR):
            raise ValueError(f"KVCopy: unknown direction {c.direction}")
        keys: list[bytes] = []
        if c.direction == CLEAR:
            if self.store is None:
                raise ValueError("KVCopy: this worker has no storage tier (--hicache-storage-dir)")
            return _slots(b""), _slots(b""), keys
        if c.direction in (D2S, S2H):
            if self.store is None:
                raise ValueError("KVCopy: this worker has no storage tier (--hicache-storage-dir)")
            keys = split_keys(c.keys)
            slots = _slots(c.src_slots if c.direction == D2S else c.dst_slots)
            if len(slots) != len(keys) * self.store.page_tokens:
                raise ValueError(
                    f"KVCopy: {len(keys)} pages of {self.store.page_tokens} tokens but "
                    f"{len(slots)} slots"
                )
            src, dst = (slots, slots[:0]) if c.direction == D2S else (slots[:0], slots)
        else:
            src, dst = _slots(c.src_slots), _slots(c.dst_slots)
            if len(src) != len(dst):
                raise ValueError(f"KVCopy: {len(src)} source slots but {len(dst)} destinations")
        src_top = device_slots if c.direction in (D2H, D2S) else self.num_slots
        dst_top = self.num_slots if c.direction in (D2H, S2H) else device_slots
        for name, slots, top in (("source", src, src_top), ("destination", dst, dst_top)):
            if len(slots) and (slots.min() < 1 or slots.max() > top):
                raise ValueError(f"KVCopy: a {name} slot is outside 1..{top}")
        return src, dst, keys


class _CudaCopies:
    """Host <-> device copies on their own CUDA stream, ordered against forwards by events.
    Demotions land in pinned staging that reaches the host buffer at the next ``finish``,
    so no copy blocks the worker's thread."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pending: list[tuple[torch.cuda.Event, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def _begin(self) -> torch.cuda.Stream:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        return compute

    def _end(self, compute: torch.cuda.Stream) -> torch.cuda.Event:
        event = self.stream.record_event()
        compute.wait_event(event)
        return event

    def to_host(self, pool: KVPool, src: np.ndarray, dst: np.ndarray) -> None:
        compute = self._begin()
        with torch.cuda.stream(self.stream):
            index = torch.from_numpy(src).to(self.device, non_blocking=True)
            staged = []
            for dev in (pool.k_buffer, pool.v_buffer):
                rows = dev.index_select(1, index)
                out = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                out.copy_(rows, non_blocking=True)
                staged.append(out)
        self.pending.append((self._end(compute), staged[0], staged[1], torch.from_numpy(dst)))

    def to_device(self, host: HostPool, pool: KVPool, src: np.ndarray, dst: np.ndarray) -> None:
        index = torch.from_numpy(src)
        rows = [b.index_select(1, index).pin_memory() for b in (host.k_buffer, host.v_buffer)]
        compute = self._begin()
        with torch.cuda.stream(self.stream):
            out = torch.from_numpy(dst).to(self.device, non_blocking=True)
            for dev, r in zip((pool.k_buffer, pool.v_buffer), rows, strict=True):
                dev[:, out] = r.to(self.device, non_blocking=True)
        self._end(compute)

    def finish(self, host: HostPool) -> None:
        """Demotions staged so far into the host buffer (waits for their DMA)."""
        for event, k, v, dst in self.pending:
            event.synchronize()
            host.k_buffer[:, dst] = k
            host.v_buffer[:, dst] = v
        self.pending.clear()
