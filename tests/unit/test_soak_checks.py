"""The chaos soak's judgements (bench/soak.py): answers checked token for token, resource
drift per process lifetime, and the verdict that fails a run on any lost or wrong answer."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from radixserve.v1 import generation_pb2 as pb

_PATH = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
_spec = importlib.util.spec_from_file_location("soak", _PATH)
assert _spec is not None and _spec.loader is not None
soak = importlib.util.module_from_spec(_spec)
sys.modules["soak"] = soak  # dataclasses look their module up by name
_spec.loader.exec_module(soak)


def _ref(tokens: tuple[int, ...]) -> soak.Reference:
    return soak.Reference(pb.GenerateRequest(text="a b"), tokens)


def test_answers_are_checked_token_for_token() -> None:
    tally = soak.Tally()
    tally.answered(_ref((1, 2, 3)), [1, 2, 3])
    tally.answered(_ref((1, 2, 3)), [1, 2])  # cut short: wrong too
    tally.answered(_ref((1, 2, 3)), [1, 9, 3])
    tally.answered(None, [7])  # a random request: not checked
    assert tally.references == {"exact": 1, "wrong": 2}
    assert [w["first_difference"] for w in tally.wrong] == [None, 1]
    assert tally.outcomes["OK"] == 4


def test_an_error_without_a_clear_status_is_counted() -> None:
    tally = soak.Tally()
    tally.error("UNAVAILABLE", "worker gone", reference=True)
    tally.error("INTERNAL", "boom", reference=False)
    tally.error("UNAVAILABLE", "", reference=False)
    assert tally.references == {"UNAVAILABLE": 1}
    assert tally.unclear == {"INTERNAL": 1, "UNAVAILABLE": 1}


def _life(rss: list[int], fds: list[int], started: float = 0.0) -> soak.Lifetime:
    life = soak.Lifetime("worker", started)
    life.samples = [(5.0 * i, r, f) for i, (r, f) in enumerate(zip(rss, fds, strict=True))]
    return life


def test_drift_compares_the_last_minute_with_the_first_after_warmup() -> None:
    n = 60  # 5 minutes of samples every 5 s
    rss = [100] * 10 + [200] * 12 + [200] * (n - 34) + [210] * 12  # warm-up, base, tail
    d = soak.drift(_life(rss, [40] * n), load_start=0.0, warmup=50.0, window=60.0)
    assert d is not None
    assert d["rss_drift_pct"] == pytest.approx(5.0)
    assert d["fd_drift_pct"] == 0.0
    # Too short a life for two disjoint windows after its warm-up: no figure.
    assert soak.drift(_life([1] * 20, [1] * 20), 0.0, 50.0, 60.0) is None


def _report(**over: object) -> dict:
    rep = {
        "references": {"count": 4, "unstable_before_faults": [], "exact": 10},
        "missing": 0,
        "unclear_errors": {},
        "pool_at_end": {"ok": True},
        "processes_dead_at_end": [],
        "recoveries": [{"service": "worker", "first_token_s": 20.0}],
        "resources": [{"rss_drift_pct": 1.0, "fd_drift_pct": 0.0}],
    }
    rep.update(over)
    return rep


def test_verdict_fails_on_anything_lost_or_wrong() -> None:
    assert soak.verdict(_report(), 5.0) == []
    wrong = {"count": 4, "unstable_before_faults": [], "exact": 9, "wrong": 1}
    assert soak.verdict(_report(references=wrong), 5.0)
    assert soak.verdict(_report(missing=1), 5.0)
    assert soak.verdict(_report(unclear_errors={"INTERNAL": 1}), 5.0)
    assert soak.verdict(_report(pool_at_end={"ok": False}), 5.0)
    assert soak.verdict(_report(recoveries=[{"first_token_s": None}]), 5.0)
    drifting = [{"rss_drift_pct": 7.5, "fd_drift_pct": 0.0}]
    assert soak.verdict(_report(resources=drifting), 5.0)
