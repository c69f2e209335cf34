"""The CPU worker's OpenMP wait setting and its thread governor (issue 18)."""

from __future__ import annotations

import os

import pytest

from services.common.goodput import MIN_STEPS, Goodput, explore_interval
from services.worker.cpu_threads import (
    BIND_ENV,
    EXPLORE_CALLS,
    EXPLORE_EVERY,
    FEWER_MARGIN,
    IDLE_S,
    MAX_CHOSEN_ROWS,
    MAX_EXPLORE_EVERY,
    PROCESS_CORES_ENV,
    SPIN_COUNT,
    ThreadGovernor,
    bind_cores,
    default_threads,
    parse_cores,
    set_openmp_bind,
    set_openmp_wait,
)


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    return monkeypatch


@pytest.mark.parametrize("mode", ["adaptive", "spin"])
def test_spinning_modes_set_a_bounded_spin(clean_env, mode):
    set_openmp_wait(mode)
    assert os.environ["GOMP_SPINCOUNT"] == str(SPIN_COUNT)
    assert "OMP_WAIT_POLICY" not in os.environ


def test_passive_sleeps_at_once(clean_env):
    set_openmp_wait("passive")
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "GOMP_SPINCOUNT" not in os.environ


@pytest.mark.parametrize("name,value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "7")])
@pytest.mark.parametrize("mode", ["adaptive", "passive"])
def test_an_explicit_setting_wins(clean_env, name, value, mode):
    clean_env.setenv(name, value)
    set_openmp_wait(mode)
    assert os.environ[name] == value
    other = "GOMP_SPINCOUNT" if name == "OMP_WAIT_POLICY" else "OMP_WAIT_POLICY"
    assert other not in os.environ


@pytest.fixture
def eight_cores(monkeypatch):
    for name in (*BIND_ENV, PROCESS_CORES_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr("services.worker.cpu_threads._gpu_present", lambda: False)
    return monkeypatch


def test_auto_binding_gives_each_rank_its_own_run_of_cores(eight_cores):
    assert bind_cores("auto", 8) == list(range(8))
    assert [bind_cores("auto", 4, 2, r) for r in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert bind_cores("auto", 16) == []  # more threads than cores: the kernel places them
    assert bind_cores("auto", 4, 4, 3) == []  # 4 ranks x 4 threads do not fit 8 cores
    assert bind_cores("auto", 2) == []  # 2 of 8 cores: a neighbour may pin the same two
    assert bind_cores("none", 2) == []
    assert bind_cores("0-2,6", 4) == [0, 1, 2, 6] == parse_cores("0-2, 6")


@pytest.mark.parametrize("bad", ["9", "0-9", "x", "1-", "-2", ""])
def test_a_bad_core_list_is_refused_by_name(eight_cores, bad):
    with pytest.raises(ValueError, match="cpu_bind"):
        bind_cores(bad, 2)


def test_binding_goes_into_the_environment_on_the_cpu_only(eight_cores):
    set_openmp_bind("auto", 0, "cpu", 1, 0)  # 0: a thread per core
    assert os.environ["GOMP_CPU_AFFINITY"] == "0 1 2 3 4 5 6 7"
    eight_cores.delenv("GOMP_CPU_AFFINITY")
    set_openmp_bind("1,3", 2, "cpu", 1, 0)
    assert os.environ["GOMP_CPU_AFFINITY"] == "1 3"
    eight_cores.delenv("GOMP_CPU_AFFINITY")
    set_openmp_bind("auto", 4, "auto", 2, 1)
    assert os.environ["GOMP_CPU_AFFINITY"] == "4 5 6 7"
    eight_cores.delenv("GOMP_CPU_AFFINITY")
    set_openmp_bind("auto", 8, "cuda", 1, 0)
    eight_cores.setattr("services.worker.cpu_threads._gpu_present", lambda: True)
    set_openmp_bind("auto", 8, "auto", 1, 0)
    set_openmp_bind("none", 8, "cpu", 1, 0)
    assert "GOMP_CPU_AFFINITY" not in os.environ
    eight_cores.setenv("OMP_PROC_BIND", "false")  # set by hand: it wins
    set_openmp_bind("auto", 8, "cpu", 1, 0)
    assert "GOMP_CPU_AFFINITY" not in os.environ


def test_a_core_list_given_by_hand_is_honoured_beside_a_gpu(eight_cores):
    eight_cores.setattr("services.worker.cpu_threads._gpu_present", lambda: True)
    set_openmp_bind("1,3", 2, "cuda", 1, 0)
    assert os.environ["GOMP_CPU_AFFINITY"] == "1 3"


def test_a_rank_started_by_a_pinned_rank_takes_its_own_cores(eight_cores):
    """Rank 0's libgomp pinned its main thread to one core, and the ranks it starts inherit
    that core and its GOMP_CPU_AFFINITY: each rank restores the process's cores first."""
    set_openmp_bind("auto", 0, "cpu", 2, 0)
    assert os.environ["GOMP_CPU_AFFINITY"] == "0 1 2 3"
    mask, restored = {0}, []  # the one core the child inherits

    def set_mask(pid: int, cores: list[int]) -> None:
        restored.append(cores)
        mask.clear()
        mask.update(cores)

    eight_cores.setattr(os, "sched_getaffinity", lambda pid: set(mask))
    eight_cores.setattr(os, "sched_setaffinity", set_mask)
    assert default_threads(0, 2) == 4  # the process's cores, not the pinned thread's
    set_openmp_bind("auto", 0, "cpu", 2, 1)
    assert restored == [list(range(8))]
    assert os.environ["GOMP_CPU_AFFINITY"] == "4 5 6 7"


def test_the_worker_refuses_a_bad_core_list_before_loading_torch(clean_env, eight_cores):
    from services.cli.main import _service_main
    from services.common.config import WorkerConfig

    with pytest.raises(SystemExit, match="worker: cpu_bind: cores 0-99"):
        _service_main("worker", WorkerConfig(cpu_bind="0-99", device="cpu"))


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2,
    reason="this process may use one core only: one thread per core cannot be told from none",
)
def test_libgomp_pins_a_fresh_process_threads_one_per_core():
    """What the worker gets: with the setting made before torch loads, its OpenMP threads
    (the main thread is thread 0) each run on one core of their own."""
    import ast
    import subprocess
    import sys

    code = (
        "import os, glob\n"
        "from services.worker.cpu_threads import set_openmp_bind\n"
        "set_openmp_bind('auto', 0, 'cpu', 1, 0)\n"
        "import torch\n"
        "from services.worker.cpu_threads import default_threads\n"
        "torch.set_num_threads(default_threads(0))\n"
        "torch.nn.functional.silu(torch.ones(1 << 22))\n"
        "cores = set()\n"
        "for t in glob.glob('/proc/self/task/*/status'):\n"
        "    line = [x for x in open(t) if x.startswith('Cpus_allowed_list')][0]\n"
        "    cores.add(line.split()[1])\n"
        "print(sorted(cores))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (*BIND_ENV, PROCESS_CORES_ENV)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    first, second = sorted(os.sched_getaffinity(0))[:2]
    assert {str(first), str(second)} <= set(ast.literal_eval(out.stdout))


def test_an_unknown_mode_is_refused_by_name(clean_env):
    with pytest.raises(ValueError, match="cpu_wait must be one of adaptive, spin, passive"):
        set_openmp_wait("busy")


def test_the_cli_refuses_an_unknown_mode():
    from services.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--cpu-wait", "busy"])


class FakeWorker:
    """A clock that a batch moves by the period its thread count gives it, per rows."""

    def __init__(self, periods: dict[int, float], threads: int = 2):
        self.now, self.set, self.periods = 0.0, [], periods
        self.g = ThreadGovernor(threads, self.set.append, lambda: self.now)

    def batches(self, n: int, rows: int = 16) -> list[int]:
        """Runs n batches of ``rows`` back to back; returns each one's thread count."""
        used = []
        for _ in range(n):
            self.g.before(rows)
            self.now += self.periods[self.g.threads]
            self.g.after()
            used.append(self.g.threads)
        return used


def test_measures_every_thread_then_one_fewer_then_keeps_the_faster():
    w = FakeWorker({2: 0.010, 1: 0.006})  # spinning threads hold cores others need
    used = w.batches(40)
    assert used[: MIN_STEPS + 1] == [2] * (MIN_STEPS + 1)  # MIN_STEPS periods need one more
    assert used[MIN_STEPS + 1 : 2 * (MIN_STEPS + 1)] == [1] * (MIN_STEPS + 1)
    assert set(used[2 * (MIN_STEPS + 1) :]) == {1} and w.g.threads == 1


def test_all_threads_kept_where_they_are_faster_and_the_other_is_looked_at_rarely():
    w = FakeWorker({2: 0.005, 1: 0.009})
    n = 3000
    used = w.batches(2 * (MIN_STEPS + 1) + n)[2 * (MIN_STEPS + 1) :]
    # 1.8x apart: one look (EXPLORE_CALLS batches) every explore_interval batches.
    every = explore_interval(0.005, 0.009, EXPLORE_EVERY, MAX_EXPLORE_EVERY)
    assert EXPLORE_EVERY * 3 < every < MAX_EXPLORE_EVERY
    looks = used.count(1)
    assert looks == EXPLORE_CALLS * (n // (every + EXPLORE_CALLS - 1))
    assert used[-1] == 2 and w.set.count(1) == 1 + looks // EXPLORE_CALLS


def test_large_batches_always_run_every_thread():
    w = FakeWorker({2: 0.050, 1: 0.010})  # even where one fewer would measure faster
    assert set(w.batches(20, rows=MAX_CHOSEN_ROWS + 1)) == {2}
    assert w.batches(20, rows=MAX_CHOSEN_ROWS)[-1] == 1


def test_one_thread_fewer_must_be_clearly_faster():
    w = FakeWorker({2: 0.010, 1: 0.010 / (FEWER_MARGIN - 0.05)})
    used = w.batches(40)
    assert set(used[2 * (MIN_STEPS + 1) :]) == {2}  # a little faster: not worth a switch


def test_a_new_batch_size_measures_the_count_chosen_elsewhere_first():
    """So that a verify step's batch size runs like the plain steps around it while its
    other count is measured (the speculation gate compares the two kinds of step)."""
    w = FakeWorker({2: 0.010, 1: 0.006})
    w.batches(12, rows=16)
    # The chain of one-thread periods goes on from the 16-row batches.
    want = [1] * MIN_STEPS + [2] * (MIN_STEPS + 1) + [1] * 3
    assert w.batches(len(want), rows=80) == want
    w.periods = {2: 0.005, 1: 0.010}  # where each size decides for itself
    w.g.choice.firsts[9] = goodput(256 / 0.005)  # (256 rows measured on all threads only)
    assert w.batches(MIN_STEPS + 3, rows=256) == [1] * MIN_STEPS + [2] * 3


def goodput(rate: float) -> Goodput:
    g = Goodput()
    for _ in range(MIN_STEPS):
        g.add(1.0, rate)
    return g


def test_a_wait_for_work_starts_a_new_chain():
    w = FakeWorker({2: 0.010, 1: 0.006})
    w.batches(2)
    w.now += IDLE_S * 2  # idle: this gap is no batch's period
    w.batches(1)
    assert list(w.g.choice.firsts[5].rates) == [pytest.approx(1600.0)]


def test_a_batch_without_rows_chooses_nothing_and_breaks_the_chain():
    w = FakeWorker({2: 0.010, 1: 0.006})
    w.batches(2)
    w.batches(1, rows=0)  # KV copies or grammar requests only: no forward
    w.batches(1)
    assert len(w.g.choice.firsts[5].rates) == 1 and 1 not in w.g.choice.firsts
    w.g.choice.seconds[5] = Goodput()
    for _ in range(16):  # ways that delivered nothing
        w.g.choice.firsts[5].add(1.0, 0.0)
        w.g.choice.seconds[5].add(1.0, 0.0)
    assert w.g.choice.ratio(5) == 0.0 and w.batches(1) == [2]


def test_off_with_one_thread():
    assert not ThreadGovernor(1, print).enabled
