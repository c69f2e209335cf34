"""How a CPU worker's OpenMP threads wait, and how many run.

Spinning at libgomp's barriers beats sleeping while cores are free, but holds cores other
processes want. The default, ``adaptive``, spins and watches the threads' run delay
(schedstat): under sustained contention it drops a thread, later probing one more.
``spin`` and ``passive`` fix the count; explicit ``OMP_WAIT_POLICY``/``GOMP_SPINCOUNT`` win.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("radixserve.worker")

WAIT_MODES = ("adaptive", "spin", "passive")
# Longer than the gaps between a decode step's parallel regions, short enough to leave
# the cores to the frontend and scheduler between steps.
SPIN_COUNT = 30_000


def default_threads(requested: int, tp_size: int = 1) -> int:
    """--cpu-threads, or the usable cores split evenly between the tensor-parallel ranks."""
    return requested or max(1, len(os.sched_getaffinity(0)) // tp_size)


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


def read_run_delay_ns(task_dir: Path = Path("/proc/self/task")) -> int | None:
    """Summed ns this process's threads waited runnable for a CPU; None if unknown."""
    total = 0
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:
            continue
        if len(fields) < 2 or not fields[1].isdigit():
            return None
        total += int(fields[1])
    return total if tasks else None


@dataclass
class GovernorConfig:
    period_s: float = 0.5
    # Run-delay share per thread counted as contention: above what the worker's own frontend
    # and scheduler cause, below what one busy process beside it does.
    high: float = 0.3
    sustain: int = 3  # windows in a row above `high` before a thread goes
    probe_s: float = 30.0  # at fewer threads, try one more after this long


def decide(threads: int, max_threads: int, hot_windows: int, since_change_s: float,
           cfg: GovernorConfig) -> int:  # fmt: skip
    """The thread count for the next window."""
    if hot_windows >= cfg.sustain and threads > 1:
        return threads - 1
    if hot_windows == 0 and threads < max_threads and since_change_s >= cfg.probe_s:
        return threads + 1
    return threads


class ThreadGovernor:
    """Call ``after_step()`` after each forward batch; it changes the torch thread count."""

    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None],
        read_delay: Callable[[], int | None] = read_run_delay_ns,
        clock: Callable[[], float] = time.monotonic,
        cfg: GovernorConfig | None = None,
    ):
        self.max_threads, self.threads = max_threads, max_threads
        self.set_threads, self.read_delay, self.clock = set_threads, read_delay, clock
        self.cfg = cfg or GovernorConfig()
        self.window_start = self.changed_at = clock()
        start = read_delay()
        self.enabled = max_threads > 1 and start is not None
        self.delay_start = start or 0
        self.warned = False
        self.hot_windows = 0  # windows in a row above cfg.high

    def after_step(self) -> None:
        if not self.enabled:
            return
        now = self.clock()
        elapsed = now - self.window_start
        if elapsed < self.cfg.period_s:
            return
        delay = self.read_delay()
        if delay is None:
            self.enabled = False
            return
        share = (delay - self.delay_start) / 1e9 / elapsed / self.threads
        self.window_start, self.delay_start = now, delay
        log.debug(
            "worker: %d CPU threads waited %.1f%% of %.2f s", self.threads, 100 * share, elapsed
        )
        self.hot_windows = self.hot_windows + 1 if share > self.cfg.high else 0
        new = decide(
            self.threads, self.max_threads, self.hot_windows, now - self.changed_at, self.cfg
        )
        if new != self.threads:
            level = logging.WARNING if new < self.threads and not self.warned else logging.INFO
            self.warned |= level == logging.WARNING
            log.log(
                level,
                "worker: %d -> %d CPU threads (its threads waited %.0f%% of the last %.1f s for "
                "a core: other processes want them; --cpu-wait passive or spin fixes the count)",
                self.threads, new, 100 * share, elapsed,
            )  # fmt: skip
            self.set_threads(new)
            self.threads, self.changed_at, self.hot_windows = new, now, 0
