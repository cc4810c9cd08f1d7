"""The scheduler server's end of the KV events: the publisher its config asks for, fed once per step."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog
from prometheus_client.core import CounterMetricFamily

from pagedserve.common.config import SchedulerConfig
from pagedserve.common.exposition import render
from pagedserve.common.kv_events_config import parse_kv_events_config
from pagedserve.scheduler.kv_events.publisher import EventPublisher, NullEventPublisher, ZmqEventPublisher
from pagedserve.scheduler.kv_events.wire import AllBlocksCleared, EventBatch

if TYPE_CHECKING:
    from pagedserve.scheduler.scheduler import Scheduler

log = structlog.get_logger(process="scheduler")


class KVEventStream:
    """Takes the core's recorded events after every step and publishes them as one batch."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = parse_kv_events_config(config.kv_events_config)
        self._prefix_caching = config.enable_prefix_caching and config.kv_policy == "paged"
        self.data_parallel_rank = config.data_parallel_rank
        self.publisher: EventPublisher | None = None

    def start(self) -> None:
        """Opens the publisher's sockets (a taken port fails here, at start); nothing while events are off."""
        if self._config is None or not self._config.enable_kv_cache_events or self.publisher is not None:
            return
        if not self._prefix_caching:  # (as vLLM: the events describe the prefix cache)
            log.warning(
                "kv_events_without_prefix_caching", reason="no block is ever cached, so none announced"
            )
        if self._config.resolved_publisher == "zmq":
            self.publisher = ZmqEventPublisher(self._config, self.data_parallel_rank)
        else:
            self.publisher = NullEventPublisher()

    def after_step(self, core: Scheduler) -> None:
        """Publishes what the core's block manager recorded since the last call, if anything."""
        if self.publisher is None or core.kv_events is None:
            return
        events = core.kv_events.take()
        if events:
            self.publisher.publish(EventBatch(time.time(), events, self.data_parallel_rank))

    def cleared(self) -> None:
        """The worker and its KV pool are gone (it died or restarted): subscribers forget what they knew now,
        not at the next step."""
        if self.publisher is not None:
            self.publisher.publish(EventBatch(time.time(), [AllBlocksCleared()], self.data_parallel_rank))

    def metrics_text(self) -> str:
        """The publisher's counters in Prometheus text format ("" while events are off)."""
        if self.publisher is None:
            return ""
        published, dropped = self.publisher.published, self.publisher.dropped
        return render(
            [
                CounterMetricFamily(
                    "pagedserve_kv_events_batches_published_total", "KV event batches sent", published
                ),
                CounterMetricFamily(
                    "pagedserve_kv_events_batches_dropped_total", "KV event batches lost", dropped
                ),
            ]
        )

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
