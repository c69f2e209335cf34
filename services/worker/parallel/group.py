"""The ranks' process group: torch.distributed on NCCL (CUDA) or gloo (CPU), with a timeout.

A ``TpGroup`` is handed to every layer that communicates (never a global); at world size 1
each collective is a no-op and torch.distributed is never initialised, so TP=1 runs the
code it ran before. Ranks meet through a FileStore in a private folder (no port); step
inputs travel on gloo even beside NCCL. The timeout makes a hung rank fail the others'
next collective instead of hanging the engine forever.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TpGroup:
    """One rank's view of the group (device: the model's collectives; cpu: gloo, for step
    inputs). Group ranks are global ranks."""

    rank: int = 0
    world: int = 1
    device_group: dist.ProcessGroup | None = field(default=None, repr=False)
    cpu_group: dist.ProcessGroup | None = field(default=None, repr=False)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        if self.world > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., N d]: every rank's x side by side."""
        if self.world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def gather_last(self, x: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
        """Like all_gather_last, but only rank ``dst`` receives (None elsewhere)."""
        if self.world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == dst else None
        dist.gather(x.contiguous(), parts, dst=dst, group=self.device_group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_cpu(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x (a CPU tensor) from rank ``src`` to every rank, in place."""
        if self.world > 1:
            dist.broadcast(x, src=src, group=self.cpu_group)
        return x

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.cpu_group)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(
    rank: int, world: int, store_path: str, device: torch.device, timeout_s: float
) -> TpGroup:
    """Joins the group, blocking until all ``world`` ranks have. On CUDA rank r takes GPU r."""
    if world == 1:
        return TpGroup()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=timeout_s)
    store = dist.FileStore(store_path, world)
    backend = backend_for(device)
    kwargs: dict = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)  # eager: NCCL connects here
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs
    )
    world_group = dist.group.WORLD
    cpu = world_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return TpGroup(rank, world, world_group, cpu)


def destroy_group(group: TpGroup) -> None:
    if group.world > 1 and dist.is_initialized():
        dist.destroy_process_group()
