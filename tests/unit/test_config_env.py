"""RADIXSERVE_* environment values are held to the flags' own types, choices and bounds
(issue 41): argparse checks none of them on a default, so a bad value used to pass (a
choice, a bound) or stop the service with a traceback (a number). Now a flag and a variable
go through the same checks, and a bad one stops the service with status 2 and one line,
"radixserve <service>: <what>: <why>", naming the flag or the variable."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest

from services.cli.main import SERVICES, build_parser, main
from services.common.config import (
    ServeConfig,
    WorkerConfig,
    add_dataclass_args,
    from_args,
    resolve_choices,
)

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
        (
            "RADIXSERVE_DISABLE_CUDA_GRAPH",
            "maybe",
            "expected one of 1, true, yes, on, 0, false, no, off",
        ),
        ("RADIXSERVE_HICACHE_STORAGE_TTL", "-1", "must be >= 0"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch, var, value, says):
    with pytest.raises(ValueError) as e:
        _parse(monkeypatch, **{var: value})
    assert str(e.value) == f"{var}={value!r}: {says}"


def test_good_values_are_taken(monkeypatch):
    cfg = _parse(
        monkeypatch,
        RADIXSERVE_CPU_LINEAR="plain",
        RADIXSERVE_MAX_TOTAL_TOKENS="4096",
        RADIXSERVE_HICACHE_RATIO="1.5",
        RADIXSERVE_DISABLE_CUDA_GRAPH="Off",
        RADIXSERVE_HICACHE_STORAGE_TTL="0",
    )
    assert (cfg.cpu_linear, cfg.max_total_tokens, cfg.hicache_ratio) == ("plain", 4096, 1.5)
    assert cfg.disable_cuda_graph is False and cfg.hicache_storage_ttl == 0


# ---- every field with choices or bounds, in every service's config, flag and variable ----

COMMANDS = [*SERVICES.items(), ("serve", ServeConfig)]


def _bad_values(f: dataclasses.Field, tp: type) -> list[tuple[str, str, str]]:
    """(kind, bad value, what the variable's line says) for one field."""
    cases = []
    if f.metadata.get("choices") is not None:
        choices = ", ".join(map(str, resolve_choices(f.metadata["choices"])))
        cases.append(("choice", "bogus", f"must be one of {choices}"))
    ge, gt = f.metadata.get("ge"), f.metadata.get("gt")
    if ge is not None or gt is not None:
        bad, bound = (ge - 1, f">= {ge}") if ge is not None else (gt, f"> {gt}")
        finite = "a finite number " if tp is float else ""
        cases.append(("bound", str(tp(bad)), f"must be {finite}{bound}"))
        cases.append(("number", "lots", f"not a valid {tp.__name__}"))
    if (le := f.metadata.get("le")) is not None:
        finite = "a finite number " if tp is float else ""
        cases.append(("bound", str(tp(le + 1)), f"must be {finite}<= {le}"))
    return cases


CASES = [
    pytest.param(cmd, f.name, kind, value, says, id=f"{cmd}-{f.name}-{kind}-{value}")
    for cmd, cls in COMMANDS
    for f in dataclasses.fields(cls)
    for kind, value, says in _bad_values(f, type(getattr(cls(), f.name)))
]


def test_the_cases_cover_choices_and_bounds_of_every_service():
    kinds = {(c.values[0], c.values[2]) for c in CASES}
    for cmd, _ in COMMANDS:
        assert (cmd, "bound") in kinds and (cmd, "choice") in kinds


def _run(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(("cmd", "name", "kind", "value", "says"), CASES)
def test_a_bad_variable_stops_the_service_with_one_line(
    monkeypatch, capsys, cmd, name, kind, value, says
):
    var = "RADIXSERVE_" + name.upper()
    monkeypatch.setenv(var, value)
    err = _run(capsys, [cmd])
    assert err == f"radixserve {cmd}: {var}={value!r}: {says}\n"


@pytest.mark.parametrize(("cmd", "name", "kind", "value", "says"), CASES)
def test_a_bad_flag_is_refused_by_the_same_checks(capsys, cmd, name, kind, value, says):
    flag = "--" + name.replace("_", "-")
    err = _run(capsys, [cmd, f"{flag}={value}"])
    if kind == "bound":  # the config's own check: one line, as the variable's
        assert err == f"radixserve {cmd}: {flag} {says}, got {value}\n"
    else:  # argparse's: its usage, then the line
        assert err.splitlines()[-1].startswith(f"radixserve {cmd}: error: argument {flag}: ")


def test_a_variable_only_stops_the_services_that_read_it(monkeypatch, capsys):
    """A bad worker variable is the worker's (and serve's) fault, not the frontend's."""
    monkeypatch.setenv("RADIXSERVE_CPU_WAIT", "bogus")
    from_args(SERVICES["frontend"], build_parser().parse_args(["frontend"]))  # no error
    err = _run(capsys, ["worker"])
    assert err == "radixserve worker: RADIXSERVE_CPU_WAIT='bogus': must be one of " \
        "adaptive, spin, passive\n"  # fmt: skip


def test_radixserve_serve_refuses_a_bad_variable_before_starting_anything():
    env = {**os.environ, "RADIXSERVE_CPU_WAIT": "bogus"}
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "serve"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (
        "radixserve serve: RADIXSERVE_CPU_WAIT='bogus': must be one of adaptive, spin, passive\n"
    )


def test_the_dashboards_error_and_request_series_read_zero_on_a_fresh_frontend():
    """Issue 41: radixserve:frontend_errors_total existed only after the first error, so
    its Grafana panel (and any alert on it) read "no data" instead of 0."""
    from prometheus_client import generate_latest

    from services.frontend.metrics import FrontendMetrics

    text = generate_latest(FrontendMetrics("m").registry).decode()
    assert 'radixserve:frontend_errors_total{code="RESOURCE_EXHAUSTED",model_name="m"} 0.0' in text
    assert 'radixserve:frontend_requests_total{finish_reason="stop",model_name="m"} 0.0' in text
