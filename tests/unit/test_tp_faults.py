"""The ranks go down together (services/worker/parallel/launch.py, group.py): a hung rank
fails the others' collective after the timeout, a dead follower ends rank 0 (RankWatch),
and followers die with rank 0 (PDEATHSIG, or ParentWatch where prctl is missing)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time

import pytest
import torch
from tp_util import run_ranks

from services.worker.parallel.group import TpGroup
from services.worker.parallel.launch import (
    RankWatch,
    describe_exit,
    start_followers,
    stop_followers,
)

TIMEOUT_S = 1.0
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def hang_or_reduce(tp: TpGroup) -> None:
    if not tp.is_first:
        time.sleep(2.5 * TIMEOUT_S)  # hung: never joins the all-reduce
        return
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        tp.all_reduce(torch.ones(4))
    waited = time.monotonic() - start
    assert TIMEOUT_S * 0.5 <= waited <= TIMEOUT_S + 2.5, waited


def test_a_hung_rank_fails_the_collective_after_the_timeout() -> None:
    run_ranks(hang_or_reduce, 2, timeout_s=TIMEOUT_S, settle=False)


def die_or_reduce(tp: TpGroup) -> None:
    if not tp.is_first:
        time.sleep(0.5)
        os._exit(0)  # gone mid-run (status 0: spawn only reports rank 0's verdict)
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        tp.all_reduce(torch.ones(4))
    assert time.monotonic() - start < 5.0  # the dead peer's socket closed: no timeout wait


def test_a_dead_rank_fails_the_collective_at_once() -> None:
    run_ranks(die_or_reduce, 2, timeout_s=60.0, settle=False)


def test_rank_watch_reports_a_follower_killed() -> None:
    procs = start_followers([SLEEPER, SLEEPER])
    lost: queue.Queue[tuple[int, int]] = queue.Queue()
    watch = RankWatch(procs, on_lost=lambda rank, code: lost.put((rank, code)), poll_s=0.05)
    watch.start()
    try:
        os.kill(procs[1].pid, signal.SIGKILL)
        assert lost.get(timeout=2.0) == (2, -signal.SIGKILL)
    finally:
        watch.stop()
        stop_followers(procs, grace_s=1.0)
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(70) == "exit status 70"


def gone(pid: int) -> bool:
    """Exited (a zombie that no init reaps counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.05)
    return False


MIDDLE = {
    "pdeathsig": (
        "import sys, time\n"
        "from services.worker.parallel.launch import start_followers\n"
        "p = start_followers([[sys.executable, '-c', 'import time; time.sleep(60)']])\n"
        "print(p[0].pid, flush=True)\n"
        "time.sleep(60)\n"
    ),
    "parent_watch": (
        "import subprocess, sys, time\n"
        "code = ('from services.worker.parallel.launch import ParentWatch\\n'\n"
        "        'import time\\nw = ParentWatch(0.05)\\nw.start()\\nw.join()')\n"
        "p = subprocess.Popen([sys.executable, '-c', code])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    ),
}


@pytest.mark.parametrize("how", sorted(MIDDLE))
def test_followers_die_with_rank_zero(how: str) -> None:
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE[how]], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        assert middle.stdout is not None
        follower = int(middle.stdout.readline())
        time.sleep(0.3)  # the watch thread is up
        middle.kill()
        middle.wait()
        assert wait_gone(follower, 3.0), f"follower {follower} outlived rank 0 ({how})"
    finally:
        middle.kill()
