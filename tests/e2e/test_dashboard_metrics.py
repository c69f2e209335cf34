"""Every metric the chart queries (its Grafana dashboard, its KEDA trigger; it ships no
alert rules) is served by a running radixserve, from the start.

A renamed metric would leave a panel silently empty, and a labelled series made only on first
use (frontend_errors_total before the first error) reads "no data" instead of 0; this reads
the chart's PromQL, takes every radixserve: name in it, and looks for it among the samples
that the frontend, the scheduler and the worker expose before any request and after some
traffic.
"""

from __future__ import annotations

import json
import re
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.helm_render import CHART_DIR
from tests.server_util import Server, greedy

pytestmark = pytest.mark.slow

DASHBOARD = CHART_DIR / "files" / "grafana-dashboard.json"
KEDA = CHART_DIR / "templates" / "keda-scaledobject.yaml"
METRIC = r"radixserve:[A-Za-z0-9_:]+"


def queried_names() -> set[str]:
    """Every radixserve: metric the chart's dashboard and its KEDA trigger query."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    names = {n for e in exprs for n in re.findall(METRIC, e)}
    return names | set(re.findall(METRIC, KEDA.read_text()))


def _sample_names(port: int) -> set[str]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name for fam in text_string_to_metric_families(body) for s in fam.samples}


def _served(server: Server) -> set[str]:
    names: set[str] = set()
    for port in (server.metrics_port, server.sched_metrics, server.metrics_port + 2):
        names |= _sample_names(port)
    return names


def test_every_chart_metric_exists_on_a_fresh_server_and_after_traffic() -> None:
    names = queried_names()
    assert len(names) >= 12  # the dashboard is not empty
    with Server("--max-total-tokens", "4096", metrics=True) as server:
        missing = sorted(names - _served(server))  # before any request
        assert missing == [], f"no series on a fresh server (a panel reads no data): {missing}"
        for i in range(2):  # the second one hits the cache
            server.generate(text="Beautiful is better than ugly.", sampling=greedy(4 + i))
        with pytest.raises(grpc.RpcError):  # an error, so the error counter has a sample
            server.generate(text="", sampling=greedy(4))
        served = _served(server)
    missing = sorted(names - served)
    assert missing == [], f"the dashboard queries metrics no process serves: {missing}"


def test_the_dashboard_json_is_what_the_chart_ships() -> None:
    from tests.deploy import helm_render as hr

    cm = hr.find(
        hr.manifests({"grafana": {"dashboard": {"enabled": True}}}), "ConfigMap", "-dashboard"
    )
    assert json.loads(cm["data"]["radixserve.json"]) == json.loads(DASHBOARD.read_text())
