"""The worker's OpenMP threads sleep at barriers unless the user chose otherwise (issue 18)."""

from __future__ import annotations

import pytest

from services.cli.main import _passive_openmp


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    return monkeypatch


def test_passive_by_default(clean_env):
    _passive_openmp()
    import os

    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.mark.parametrize(
    "name,value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000")]
)
def test_an_explicit_setting_wins(clean_env, name, value):
    import os

    clean_env.setenv(name, value)
    _passive_openmp()
    assert os.environ[name] == value
    assert name == "OMP_WAIT_POLICY" or "OMP_WAIT_POLICY" not in os.environ
