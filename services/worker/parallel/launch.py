"""Starting ranks 1..N-1 beside rank 0, and going down together (docs/tensor-parallel.md).

A model split N ways cannot serve with a rank gone: followers die with rank 0
(PR_SET_PDEATHSIG, else ``ParentWatch``), rank 0 exits when any follower does
(``RankWatch``) so its supervisor restarts the engine, and a hung rank trips the
collectives' timeout. Popen must run on the main thread: PDEATHSIG fires when the
forking thread exits.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a follower imports this module first: ParentWatch must not wait for torch
    import torch

    from services.worker.parallel.group import TpGroup

log = logging.getLogger(__name__)

POLL_S = 0.2
EXIT_RANK_LOST = 70  # rank 0's exit status when another rank died (EX_SOFTWARE)


def rendezvous_dir() -> str:
    """A fresh private folder (0700) for the ranks' FileStore."""
    return tempfile.mkdtemp(prefix="radixserve-tp-")


def store_path(folder: str) -> str:
    return os.path.join(folder, "store")


def remove_rendezvous(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        pass  # ParentWatch covers it


def start_followers(
    commands: Sequence[Sequence[str]], env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    return [subprocess.Popen(list(cmd), preexec_fn=die_with_parent, env=env) for cmd in commands]


def stop_followers(procs: Sequence[subprocess.Popen], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


def _exit_now(rank: int, returncode: int) -> None:
    log.error(
        "tensor parallelism: rank %d is gone (%s); this engine goes down so that its "
        "supervisor restarts every rank",
        rank,
        describe_exit(returncode),
    )
    os._exit(EXIT_RANK_LOST)


class RankWatch(threading.Thread):
    """The first follower to exit calls ``on_lost(rank, returncode)``, by default os._exit
    (the main thread may be blocked in a collective). ``stop()`` before stopping them."""

    def __init__(
        self,
        procs: Sequence[subprocess.Popen],
        on_lost: Callable[[int, int], None] = _exit_now,
        poll_s: float = POLL_S,
    ):
        super().__init__(name="tp-rank-watch", daemon=True)
        self.procs, self.on_lost, self.poll_s = list(procs), on_lost, poll_s
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.poll_s):
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._stopped.is_set():
                    self.on_lost(rank, code)
                    return

    def stop(self) -> None:
        self._stopped.set()


class ParentWatch(threading.Thread):
    def __init__(self, poll_s: float = POLL_S):
        super().__init__(name="tp-parent-watch", daemon=True)
        self.parent, self.poll_s = os.getppid(), poll_s

    def run(self) -> None:
        while os.getppid() == self.parent:
            threading.Event().wait(self.poll_s)
        log.error("tensor parallelism: rank 0 is gone; this rank exits")
        os._exit(EXIT_RANK_LOST)


@dataclass
class Ranks:
    folder: str
    procs: list[subprocess.Popen]
    watch: RankWatch
    group: TpGroup

    @classmethod
    def start(
        cls,
        commands: Callable[[str], list[list[str]]],
        env: dict[str, str],
        device: torch.device,
        timeout_s: float,
    ) -> Ranks:
        """Starts ranks 1..N-1 and joins their group as rank 0."""
        from services.worker.parallel.group import init_group

        folder = rendezvous_dir()
        procs = start_followers(commands(store_path(folder)), env)
        watch = RankWatch(procs)
        watch.start()
        group = init_group(0, len(procs) + 1, store_path(folder), device, timeout_s)
        return cls(folder, procs, watch, group)

    def stop(self) -> None:
        from services.worker.parallel.group import destroy_group

        self.watch.stop()
        stop_followers(self.procs)
        destroy_group(self.group)
        remove_rendezvous(self.folder)
