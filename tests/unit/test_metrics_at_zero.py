"""Every metric the chart queries exists at 0 in a fresh process's registry (issue 41): a
labelled series made only on first use reads "no data" in its panel until then. The e2e
sibling (tests/e2e/test_dashboard_metrics.py) scrapes a fresh server; this is its fast half."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from services.frontend.metrics import FrontendMetrics
from services.scheduler.metrics import SchedulerMetrics
from services.worker.metrics import WorkerMetrics
from tests.e2e.test_dashboard_metrics import queried_names


def _names(registry: CollectorRegistry | Collector) -> dict[str, float]:
    return {s.name: s.value for fam in registry.collect() for s in fam.samples}


def test_every_chart_metric_reads_zero_before_any_request():
    served: dict[str, float] = {}
    for registry in (
        FrontendMetrics("m").registry,
        SchedulerMetrics("m", "engine-0").registry,
        WorkerMetrics("m").registry,
    ):
        served |= _names(registry)
    wanted = queried_names()
    assert sorted(wanted - set(served)) == []
    # Gauges the scheduler sets from its pool (max_total_num_tokens) are 0 until then too.
    assert {served[n] for n in wanted} == {0.0}


def test_the_workers_forward_series_exist_for_both_modes():
    text = {
        (s.name, s.labels.get("mode"))
        for fam in WorkerMetrics("m").registry.collect()
        for s in fam.samples
    }
    for mode in ("prefill", "decode"):
        assert ("radixserve:forward_tokens_total", mode) in text
        assert ("radixserve:forward_time_seconds_bucket", mode) in text
