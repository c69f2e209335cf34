"""How a CPU worker's OpenMP threads wait, and how many run.

Spinning at libgomp's barriers beats sleeping while cores are free, but holds cores other
processes want: the worker's own scheduler and frontend, a client, a neighbour. The default,
``adaptive``, spins and runs each batch size with every thread or one fewer, whichever it
measured faster. ``spin`` and ``passive`` fix the count; explicit ``OMP_WAIT_POLICY`` /
``GOMP_SPINCOUNT`` win.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from services.common.goodput import GoodputChoice

WAIT_MODES = ("adaptive", "spin", "passive")
# Longer than the gaps between a decode step's parallel regions, short enough to leave
# the cores to the frontend and scheduler between steps.
SPIN_COUNT = 30_000


def default_threads(requested: int, tp_size: int = 1) -> int:
    """--cpu-threads, or the usable cores split evenly between the tensor-parallel ranks."""
    return requested or max(1, len(process_cores()) // tp_size)


def set_openmp_wait(mode: str) -> None:
    """Before torch loads libgomp (it reads these once). An explicit setting wins."""
    if mode not in WAIT_MODES:
        raise ValueError(f"cpu_wait must be one of {', '.join(WAIT_MODES)}, got {mode!r}")
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    if mode == "passive":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)


# Set by hand, these win over --cpu-bind.
BIND_ENV = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
# Set with --cpu-bind's GOMP_CPU_AFFINITY: the cores the process could use before libgomp
# pinned its main thread (which then reports one core, and passes that one core on to the
# threads and processes it starts: TP ranks).
PROCESS_CORES_ENV = "RADIXSERVE_PROCESS_CORES"


def process_cores() -> list[int]:
    """The cores this process may use, as they were before --cpu-bind pinned it."""
    saved = os.environ.get(PROCESS_CORES_ENV)
    return parse_cores(saved) if saved else sorted(os.sched_getaffinity(0))


def _gpu_present() -> bool:
    """An NVIDIA driver is loaded (checked without torch: binding must be set before it)."""
    return os.path.exists("/proc/driver/nvidia/version")


def parse_cores(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6]."""
    cores: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"cpu_bind: {text!r} is not a core list such as 0-3 or 0,2,4")
        cores.extend(range(int(lo), int(hi if sep else lo) + 1))
    return cores


def bind_cores(mode: str, threads: int, tp_size: int = 1, rank: int = 0) -> list[int]:
    """The cores --cpu-bind pins `threads` OpenMP threads of TP rank `rank` to ([]: none)."""
    usable = process_cores()
    if mode == "none":
        return []
    if mode != "auto":
        cores = parse_cores(mode)
        if not set(cores) <= set(usable):
            raise ValueError(f"cpu_bind: cores {mode} are not all among those usable: {usable}")
        return cores
    # Only where the ranks' threads take every usable core, one each: fewer would all pin
    # the lowest cores, which a neighbour (another worker, another pod) may pin too.
    if threads * tp_size != len(usable):
        return []
    return usable[rank * threads : (rank + 1) * threads]


def set_openmp_bind(mode: str, requested: int, device: str, tp_size: int, rank: int) -> None:
    """Before torch loads libgomp, which reads GOMP_CPU_AFFINITY once (and pins the
    process's main thread to the first core: thread 0 of every parallel region)."""
    inherited = os.environ.pop(PROCESS_CORES_ENV, None)
    if inherited:  # a rank started by a pinned rank 0: that pinning is not this rank's
        os.environ.pop("GOMP_CPU_AFFINITY", None)
        os.sched_setaffinity(0, parse_cores(inherited))
    if any(k in os.environ for k in BIND_ENV):
        return
    # auto pins a CPU worker only; a core list given by hand is honoured on any device.
    if mode == "auto" and (device == "cuda" or (device == "auto" and _gpu_present())):
        return
    cores = bind_cores(mode, default_threads(requested, tp_size), tp_size, rank)
    if cores:
        os.environ[PROCESS_CORES_ENV] = ",".join(map(str, process_cores()))
        os.environ["GOMP_CPU_AFFINITY"] = " ".join(map(str, cores))


# A batch that came later than this after the previous result found the worker idle: no
# period spans the wait.
IDLE_S = 0.05
# first() calls a look at the other thread count lasts: three batches, two periods.
EXPLORE_CALLS = 3
# One thread fewer must measure this much faster to be chosen: 16 periods of each read
# 0.9-1.15x of each other where every thread serves ~1.1x faster (docs/benchmarks.md).
FEWER_MARGIN = 1.2
# Contention changes slowly: each look at the other count (a few slower batches) comes
# after this many batches of a size at least, 16x as many when one count is far ahead.
EXPLORE_EVERY = 128
MAX_EXPLORE_EVERY = 2048
# Larger batches (prefill chunks) always run every thread: one fewer measured 1.8x slower
# there on 2 cores, and one look costs seconds of a long prompt's first token.
MAX_CHOSEN_ROWS = 512


class ThreadGovernor:
    """Per batch size (query rows, in powers of two, up to MAX_CHOSEN_ROWS), runs every
    thread or one fewer, whichever measured more rows per second (services/common/goodput.py).
    A batch's period runs from the previous result to its own, so it holds the wait for the
    batch: where spinning threads keep the scheduler, the frontend or another process off
    the cores, the batches come slower, and one thread fewer measures faster. A new size
    starts on the count the busiest size chose, so that verify steps run like the plain
    steps around them while the speculation gate compares the two. Call ``before`` and
    ``after`` around each forward batch."""

    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None],
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.max_threads = self.threads = max_threads
        self.set_threads, self.clock = set_threads, clock
        self.choice = GoodputChoice(
            EXPLORE_CALLS, FEWER_MARGIN, EXPLORE_EVERY, MAX_EXPLORE_EVERY, follow=True, clock=clock
        )
        self.enabled = max_threads > 1
        self._rows = 0
        self._done_at: float | None = None

    def before(self, rows: int) -> None:
        """A batch of ``rows`` query rows is next: sets the thread count it runs with."""
        if self._done_at is not None and self.clock() - self._done_at > IDLE_S:
            self.choice.idle()
        self._rows = rows
        if rows <= 0:  # no forward (KV copies, grammar requests only): nothing to choose
            return
        every = rows > MAX_CHOSEN_ROWS or self.choice.first(rows)
        want = self.max_threads if every else self.max_threads - 1
        if want != self.threads:
            self.set_threads(want)
            self.threads = want

    def after(self) -> None:
        """The batch ``before`` announced has its result."""
        way = self.threads == self.max_threads if self._rows > 0 else None
        self.choice.observe(way, self._rows, self._rows)
        self._done_at = self.clock()
