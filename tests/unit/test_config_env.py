"""RADIXSERVE_* environment values are held to the flags' own types and choices (issue 41):
argparse checks neither on a default, so a bad value used to pass (a choice) or stop the
service with a traceback (a number). Now: one line naming the variable, exit status 2."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from services.common.config import WorkerConfig, add_dataclass_args, from_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse(monkeypatch, **env) -> WorkerConfig:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    parser = argparse.ArgumentParser(prog="radixserve-worker")
    add_dataclass_args(parser, WorkerConfig)
    return from_args(WorkerConfig, parser.parse_args([]))


@pytest.mark.parametrize(
    ("var", "value", "says"),
    [
        ("RADIXSERVE_CPU_LINEAR", "bogus", "must be one of auto, packed, hybrid, plain"),
        ("RADIXSERVE_CPU_WAIT", "sometimes", "must be one of adaptive, spin, passive"),
        ("RADIXSERVE_MAX_TOTAL_TOKENS", "lots", "not a valid int"),
        ("RADIXSERVE_HICACHE_RATIO", "1,5", "not a valid float"),
        ("RADIXSERVE_DISABLE_CUDA_GRAPH", "maybe", "expected one of 1, true, yes, on, 0"),
    ],
)
def test_a_bad_value_stops_with_one_line_naming_the_variable(monkeypatch, capsys, var, value, says):
    with pytest.raises(SystemExit) as e:
        _parse(monkeypatch, **{var: value})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{var}={value!r}: {says}" in err and "Traceback" not in err


def test_good_values_are_taken(monkeypatch):
    cfg = _parse(
        monkeypatch,
        RADIXSERVE_CPU_LINEAR="plain",
        RADIXSERVE_MAX_TOTAL_TOKENS="4096",
        RADIXSERVE_HICACHE_RATIO="1.5",
        RADIXSERVE_DISABLE_CUDA_GRAPH="Off",
    )
    assert (cfg.cpu_linear, cfg.max_total_tokens, cfg.hicache_ratio) == ("plain", 4096, 1.5)
    assert cfg.disable_cuda_graph is False


def test_radixserve_serve_refuses_a_bad_variable_before_starting_anything():
    env = {**os.environ, "RADIXSERVE_CPU_WAIT": "bogus"}
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "serve", "--help"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "RADIXSERVE_CPU_WAIT='bogus'" in proc.stderr and "Traceback" not in proc.stderr


def test_the_dashboards_error_and_request_series_read_zero_on_a_fresh_frontend():
    """Issue 41: radixserve:frontend_errors_total existed only after the first error, so
    its Grafana panel (and any alert on it) read "no data" instead of 0."""
    from prometheus_client import generate_latest

    from services.frontend.metrics import FrontendMetrics

    text = generate_latest(FrontendMetrics("m").registry).decode()
    assert 'radixserve:frontend_errors_total{code="RESOURCE_EXHAUSTED",model_name="m"} 0.0' in text
    assert 'radixserve:frontend_requests_total{finish_reason="stop",model_name="m"} 0.0' in text
