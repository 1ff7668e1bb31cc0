"""Prometheus metrics on a per-app registry."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["Metrics"]

STATES = ("queued", "running", "succeeded", "failed", "cancelled")


class _JobCollector(Collector):
    def __init__(self, app_state: Any) -> None:
        self.state = app_state

    def collect(self) -> Iterator[Any]:
        counts = self.state.store.counts()
        g = GaugeMetricFamily("reshard_jobs", "Jobs by state", labels=["state"])
        for s in STATES:
            g.add_metric([s], counts.get(s, 0))
        yield g
        c = CounterMetricFamily(
            "reshard_converted_bytes", "Bytes of checkpoints converted by succeeded jobs"
        )
        c.add_metric([], self.state.manager.bytes_converted)
        yield c


class Metrics:
    def __init__(self, app_state: Any) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "reshard_http_requests", "HTTP requests", ["method", "status"], registry=self.registry
        )
        self.registry.register(_JobCollector(app_state))
