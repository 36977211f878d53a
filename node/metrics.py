"""Prometheus text for /metrics, rendered from the node's live counters at scrape time."""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

Sample = tuple[str, str, str, dict[str, str], float]
"""(name, kind "counter" | "gauge", help, labels, value)."""


class _Collector:
    def __init__(self, samples: Callable[[], Iterable[Sample]]):
        self._samples = samples

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for name, kind, help_text, labels, value in self._samples():
            family = families.get(name)
            if family is None:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                family = families[name] = cls(name, help_text, labels=sorted(labels))
            family.add_metric([labels[k] for k in sorted(labels)], value)
        return families.values()


def render(samples: Callable[[], Iterable[Sample]]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(samples))
    return generate_latest(registry)
