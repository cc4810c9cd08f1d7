"""Prometheus text for /metrics, written by prometheus_client (exposition format 0.0.4), for every process
that exports metrics: they build metric families, this renders them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def render(families: Iterable[Metric]) -> str:
    """The Prometheus text of `families`, in their order."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families)))
    return generate_latest(registry).decode()
