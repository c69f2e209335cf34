"""Renders and lints helm/radixserve with Helm's own Go library (the helm-python-sdk package).

Shared by tests/test_helm_chart.py and tests/test_container_entrypoints.py: the manifests the
tests read are exactly what `helm install` would send to a cluster.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "radixserve"
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"

try:
    from helm_python import HelmError, HelmValuesError
    from helm_python import chart as helm_chart
except ImportError as exc:  # fail loudly: a missing tool must not look like a passing chart
    raise ImportError(
        "the Helm chart tests need Helm's library: "
        ".venv/bin/pip install 'helm-python-sdk>=0.2.2,<0.3'"
    ) from exc

__all__ = ["HelmError", "HelmValuesError", "render", "manifests", "lint", "validate_values"]


def render(
    values: dict[str, Any] | None = None,
    release: str = "rs",
    namespace: str = "ns",
    chart_dir: Path = CHART_DIR,
) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included), as `helm template` would print."""
    chart = helm_chart.Chart.load(chart_dir)
    return chart.render(values or {}, name=release, namespace=namespace, is_install=True)


def manifests(
    values: dict[str, Any] | None = None, release: str = "rs", namespace: str = "ns"
) -> list[dict]:
    """Every Kubernetes object of the rendered chart (NOTES.txt left out)."""
    docs: list[dict] = []
    for path, text in sorted(render(values, release, namespace).items()):
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def lint(values: dict[str, Any] | None = None) -> list[dict]:
    """Strict `helm lint` findings of warning severity or worse: [{severity, path, error}]."""
    report = helm_chart.lint(CHART_DIR, values, strict=True, namespace="ns")
    return [m for m in report["messages"] if m["severity"] >= 2] + [
        {"severity": 3, "path": "", "error": e} for e in report.get("errors", []) if e
    ]


def validate_values(values: dict[str, Any] | None) -> None:
    """Raises if `values` (merged over values.yaml) break values.schema.json."""
    helm_chart.Chart.load(CHART_DIR).validate_schema(values)


def find(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    """The one object of ``kind`` whose name ends with ``name_suffix``."""
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(hits) == 1, (
        f"expected one {kind} *{name_suffix}, got {[d['metadata']['name'] for d in hits]}"
    )
    return hits[0]


def container(docs: list[dict], workload_kind: str, name: str) -> dict:
    """A container of the release's Deployment or StatefulSet, by container name."""
    for d in docs:
        if d["kind"] == workload_kind:
            for c in d["spec"]["template"]["spec"]["containers"]:
                if c["name"] == name:
                    return c
    raise AssertionError(f"no container {name!r} in a {workload_kind}")


def dockerfile_targets() -> dict[str, dict[str, Any]]:
    """Per build stage of docker/Dockerfile: its ENTRYPOINT (list), USER and EXPOSEd ports."""
    stages: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] = {}
    for line in DOCKERFILE.read_text().splitlines():
        if m := re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.I):
            base = stages.get(m.group(1), {})
            current = {"entrypoint": base.get("entrypoint"), "user": base.get("user"), "expose": []}
            stages[m.group(2)] = current
        elif m := re.match(r"ENTRYPOINT\s+(\[.*\])", line):
            current["entrypoint"] = yaml.safe_load(m.group(1))
        elif m := re.match(r"USER\s+(\S+)", line):
            current["user"] = m.group(1)
        elif m := re.match(r"EXPOSE\s+(.*)", line):
            current["expose"] = [int(p) for p in m.group(1).split()]
    return stages
