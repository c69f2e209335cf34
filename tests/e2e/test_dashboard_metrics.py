"""Every metric the chart's Grafana dashboard queries is served by a running radixserve.

A renamed metric would leave a panel silently empty; this reads the dashboard's PromQL, takes
every radixserve: name in it, and looks for it among the samples that the frontend, the
scheduler and the worker expose after some traffic.
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


def _queried_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return {n for e in exprs for n in re.findall(r"radixserve:[A-Za-z0-9_:]+", e)}


def _sample_names(port: int) -> set[str]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name for fam in text_string_to_metric_families(body) for s in fam.samples}


def test_every_dashboard_metric_exists_on_a_running_server() -> None:
    names = _queried_names()
    assert len(names) >= 12  # the dashboard is not empty
    with Server("--max-total-tokens", "4096", metrics=True) as server:
        for i in range(2):  # the second one hits the cache
            server.generate(text="Beautiful is better than ugly.", sampling=greedy(4 + i))
        with pytest.raises(grpc.RpcError):  # an error, so the error counter has a sample
            server.generate(text="", sampling=greedy(4))
        served: set[str] = set()
        for port in (server.metrics_port, server.sched_metrics, server.metrics_port + 2):
            served |= _sample_names(port)
    missing = sorted(names - served)
    assert missing == [], f"the dashboard queries metrics no process serves: {missing}"


def test_the_dashboard_json_is_what_the_chart_ships() -> None:
    from tests.deploy import helm_render as hr

    cm = hr.find(
        hr.manifests({"grafana": {"dashboard": {"enabled": True}}}), "ConfigMap", "-dashboard"
    )
    assert json.loads(cm["data"]["radixserve.json"]) == json.loads(DASHBOARD.read_text())
