"""The process of ranks 1..N-1 (`radixserve worker --tp-rank K`), started by rank 0, never
by hand. It has no socket: the scheduler only ever talks to rank 0.
"""

from __future__ import annotations

import logging
import signal

import torch

from services.common.config import WorkerConfig
from services.worker.cpu_threads import default_threads
from services.worker.model_loader import load_config, resolve_dtype
from services.worker.model_runner import backend_class, resolve_device
from services.worker.parallel.group import destroy_group, init_group
from services.worker.parallel.launch import ParentWatch
from services.worker.parallel.rank_runner import RankModel

log = logging.getLogger("radixserve.worker")


def rank_device(cfg: WorkerConfig) -> torch.device:
    """GPU K on CUDA, else the CPU."""
    device = resolve_device(cfg.device)
    return torch.device("cuda", cfg.tp_rank) if device.type == "cuda" else device


def follow(cfg: WorkerConfig) -> None:
    # The ranks leave together: on rank 0's STOP, or when it dies (PDEATHSIG, ParentWatch).
    # A signal meant for the engine (Ctrl-C in a terminal) must not end one rank alone.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    ParentWatch().start()
    device = rank_device(cfg)
    torch.set_num_threads(default_threads(cfg.cpu_threads, cfg.tp_size))
    tp = init_group(cfg.tp_rank, cfg.tp_size, cfg.tp_store, device, cfg.tp_timeout)
    dtype = resolve_dtype(cfg.dtype, load_config(cfg.model_path), device)
    backend = backend_class(cfg.attention_backend, device)
    rank = RankModel(cfg.model_path, tp, device, None, backend, dtype, cfg.cpu_linear)
    log.info("tensor parallelism: rank %d of %d ready on %s", tp.rank, tp.world, device)
    steps = rank.follow()
    log.info("tensor parallelism: rank %d stops after %d steps", tp.rank, steps)
    destroy_group(tp)
