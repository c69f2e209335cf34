"""Runs a function on N gloo ranks (CPU processes) for the tensor-parallel tests.

``run_ranks(fn, world, *args)`` spawns ``world`` processes; each joins the group through a
FileStore in a fresh folder and calls ``fn(tp, *args)``; any rank's exception fails the
test with its traceback. ``fn`` must be importable (module level). One torch thread per
rank: the test machines have two cores.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

from services.worker.parallel.group import destroy_group, init_group
from services.worker.parallel.launch import store_path


def _rank_main(
    rank: int, fn, world: int, store: str, timeout_s: float, settle: bool, args: tuple
) -> None:
    faulthandler.enable()  # a rank that aborts in C++ shows where its Python was
    torch.set_num_threads(1)
    tp = init_group(rank, world, store, torch.device("cpu"), timeout_s)
    try:
        fn(tp, *args)
        if settle:  # no rank tears the group down while another still uses it
            tp.barrier()
    finally:
        destroy_group(tp)
    # Done and checked: leave without the interpreter's teardown, where a gloo thread still
    # joinable now and then aborted a rank that had passed ("terminate called without an
    # active exception", SIGABRT after the work, under a loaded full suite).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, *args, timeout_s: float = 30.0, settle: bool = True) -> None:
    """settle=False: no closing barrier (a test whose group is broken on purpose)."""
    with tempfile.TemporaryDirectory(prefix="radixserve-tp-test-") as folder:
        mp.spawn(
            _rank_main, args=(fn, world, store_path(folder), timeout_s, settle, args), nprocs=world
        )
