"""The CPU worker's OpenMP wait setting and its thread governor (issue 18)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.worker.cpu_threads import (
    SPIN_COUNT,
    GovernorConfig,
    ThreadGovernor,
    decide,
    read_run_delay_ns,
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


def test_an_unknown_mode_is_refused_by_name(clean_env):
    with pytest.raises(ValueError, match="cpu_wait must be one of adaptive, spin, passive"):
        set_openmp_wait("busy")


def test_the_cli_refuses_an_unknown_mode():
    from services.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--cpu-wait", "busy"])


CFG = GovernorConfig(period_s=0.5, high=0.25, sustain=3, probe_s=30.0)


def test_decide_drops_a_thread_only_after_sustained_contention():
    assert decide(2, 2, 2, 100.0, CFG) == 2  # a burst (the frontend tokenizing): stays
    assert decide(2, 2, 3, 100.0, CFG) == 1
    assert decide(1, 2, 9, 100.0, CFG) == 1  # never below one
    assert decide(2, 2, 0, 100.0, CFG) == 2  # quiet at the maximum: stays


def test_decide_probes_one_more_thread_only_after_probe_s():
    assert decide(1, 2, 0, 29.0, CFG) == 1
    assert decide(1, 2, 0, 30.0, CFG) == 2
    assert decide(3, 4, 1, 60.0, CFG) == 3  # the last window contended: no probe


class FakeProc:
    """A clock and a run-delay counter the test moves by hand."""

    def __init__(self):
        self.now, self.delay_ns, self.set = 0.0, 0, []

    def advance(self, seconds: float, delay_share_per_thread: float, threads: int) -> None:
        self.now += seconds
        self.delay_ns += int(seconds * delay_share_per_thread * threads * 1e9)


def governor(proc: FakeProc, threads: int = 2) -> ThreadGovernor:
    return ThreadGovernor(threads, proc.set.append, lambda: proc.delay_ns, lambda: proc.now, CFG)


def test_governor_drops_then_probes_back_after_contention_ends():
    proc = FakeProc()
    g = governor(proc)
    proc.advance(0.2, 0.6, 2)
    g.after_step()  # inside the first window: nothing measured yet
    assert proc.set == []
    for _ in range(2):
        proc.advance(0.6, 0.6, 2)
        g.after_step()
    assert proc.set == []  # two hot windows: not yet
    proc.advance(0.6, 0.6, 2)
    g.after_step()
    assert proc.set == [1] and g.threads == 1
    for _ in range(10):  # one thread beside the busy process: no delay, but no probe yet
        proc.advance(1.0, 0.0, 1)
        g.after_step()
    assert proc.set == [1]
    for _ in range(25):
        proc.advance(1.0, 0.0, 1)
        g.after_step()
    assert proc.set == [1, 2]  # probed back after probe_s
    proc.advance(0.6, 0.05, 2)  # the cores are free again: stays at two
    g.after_step()
    assert proc.set == [1, 2] and g.threads == 2


def hot(proc: FakeProc, g: ThreadGovernor, windows: int) -> None:
    for _ in range(windows):
        proc.advance(0.6, 0.5, g.threads)
        g.after_step()


def test_governor_goes_back_down_when_a_probe_finds_contention():
    proc = FakeProc()
    g = governor(proc)
    hot(proc, g, 3)
    proc.advance(31.0, 0.0, 1)
    g.after_step()
    hot(proc, g, 3)
    assert proc.set == [1, 2, 1]


def test_bursts_between_quiet_windows_never_drop_a_thread():
    proc = FakeProc()
    g = governor(proc)
    for _ in range(20):
        hot(proc, g, 2)
        proc.advance(0.6, 0.05, 2)
        g.after_step()
    assert proc.set == []


def test_governor_is_off_with_one_thread_or_no_schedstat():
    proc = FakeProc()
    assert not governor(proc, threads=1).enabled
    g = ThreadGovernor(2, proc.set.append, lambda: None, lambda: proc.now, CFG)
    assert not g.enabled
    g.after_step()
    assert proc.set == []


def test_read_run_delay_sums_this_process_threads():
    delay = read_run_delay_ns()
    if delay is None:
        pytest.skip("/proc/self/task/*/schedstat unreadable here (not Linux, or no schedstats)")
    assert delay >= 0


def test_read_run_delay_of_a_fake_task_dir(tmp_path: Path):
    for tid, line in (("1", "100 250 3\n"), ("2", "7 50 1\n")):
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "schedstat").write_text(line)
    assert read_run_delay_ns(tmp_path) == 300
    (tmp_path / "3").mkdir()  # a thread that ended meanwhile: skipped
    assert read_run_delay_ns(tmp_path) == 300
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / "schedstat").write_text("garbage\n")
    assert read_run_delay_ns(tmp_path) is None
    assert read_run_delay_ns(tmp_path / "missing") is None
