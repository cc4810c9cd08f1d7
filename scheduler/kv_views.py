"""The scheduler process's KV views: snapshots for clients that ask (the api's /dashboard) and the
`--kv-trace` recording, sharing one rate-limited snapshot (scheduler/snapshot.py).

How the scheduler knows someone watches: it is asked. The api sends a `KVSnapshotRequest` only while a
browser holds its event stream open (a few per second), and the scheduler builds a snapshot only for such a
request or for a trace that is due, at most one every `kv_snapshot_interval_s` whoever asks. Nobody
watching and no trace: no snapshot work at all, nothing to expire.
"""

from __future__ import annotations

import time

import msgspec
import structlog

from pagedserve.common.config import SchedulerConfig
from pagedserve.common.messages import KVSnapshot, KVSnapshotRequest
from pagedserve.scheduler.kv_trace import KVTrace, open_trace
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.snapshot import SnapshotCache

log = structlog.get_logger(process="scheduler")

TRACE_CELLS = 4096  # the trace's map size: the api's default, so that both share the cached snapshot


def empty_snapshot(query_id: int) -> KVSnapshot:
    """What a client is answered while no worker (so no pool) is there."""
    return KVSnapshot(query_id, time.time(), 0, 0, 1, [], [], *([0] * 16))


class KVViews:
    """Answers snapshot requests and records the trace, building at most one snapshot per interval."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self._cache = SnapshotCache(config.kv_snapshot_interval_s)
        self._trace: KVTrace | None = open_trace(
            config.kv_trace, config.kv_trace_max_mb, config.kv_snapshot_interval_s
        )

    def reply(self, core: Scheduler | None, msg: KVSnapshotRequest) -> KVSnapshot:
        if core is None:
            return empty_snapshot(msg.query_id)
        snapshot = self._cache.get(core.kv_snapshot, msg.max_cells)
        return msgspec.structs.replace(snapshot, query_id=msg.query_id)

    def after_step(self, core: Scheduler) -> None:
        """Records a snapshot in the trace when one is due. A trace that cannot be written stops; the
        engine goes on."""
        trace = self._trace
        now = time.monotonic()
        if trace is None or not trace.due(now):
            return
        try:
            snapshot = self._cache.get(core.kv_snapshot, TRACE_CELLS)
            trace.record(snapshot, now, kv_policy=core.settings.kv_policy)
        except OSError as e:
            log.error("kv_trace_failed", path=str(trace.path), error=str(e))
            trace.close()
            self._trace = None

    def forget(self) -> None:
        """The core went with its worker: its last snapshot must not be served."""
        self._cache.clear()

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
