"""`--kv-trace FILE`: the scheduler records KV snapshots to a file, for the dashboard's replay and
scripts/kv_replay.py.

The file is JSON lines: a header (`common/kv_view.py`: format, pool, block size, policy), then one snapshot
per line, at most one every `interval_s` while steps run and one when the engine goes idle. Its size is
bounded: once the next line would take it past `max_bytes`, a last line `{"truncated": true}` is written and
recording stops (the start of a run is kept, not its end, so a trace always shows the same workload's
beginning; start a new file for a later window). Lines are buffered and flushed at most once a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

import structlog

from pagedserve.common.kv_view import snapshot_json, trace_header
from pagedserve.common.messages import KVSnapshot

log = structlog.get_logger(process="scheduler")

TRUNCATED_LINE = b'{"truncated":true}\n'


class KVTrace:
    """Appends snapshots to a trace file until it reaches its size bound."""

    def __init__(self, path: str | Path, max_bytes: int, interval_s: float) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.interval_s = interval_s
        self._file: IO[bytes] | None = None
        self._written = 0
        self._last = float("-inf")
        self._last_flush = 0.0
        self.stopped = False
        self.num_snapshots = 0

    def due(self, now: float) -> bool:
        """Whether a snapshot should be recorded now."""
        return not self.stopped and now - self._last >= self.interval_s

    def record(self, snapshot: KVSnapshot, now: float, **about: object) -> None:
        """Writes `snapshot` (the header first, with `about`, on the first call)."""
        self._last = now
        if self._file is None:
            self._file = self.path.open("wb")
            header = trace_header(num_blocks=snapshot.num_blocks, block_size=snapshot.block_size, **about)
            self._write(header + b"\n")
        line = snapshot_json(snapshot) + b"\n"
        if self._written + len(line) + len(TRUNCATED_LINE) > self.max_bytes:
            self._write(TRUNCATED_LINE)
            log.warning("kv_trace_full", path=str(self.path), max_bytes=self.max_bytes)
            self.close()
            self.stopped = True
            return
        self._write(line)
        self.num_snapshots += 1
        if now - self._last_flush >= 1.0:
            self._file.flush()
            self._last_flush = now

    def _write(self, data: bytes) -> None:
        assert self._file is not None
        self._file.write(data)
        self._written += len(data)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def open_trace(path: str, max_mb: float, interval_s: float) -> KVTrace | None:
    """The trace the config asks for, or None when `path` is empty."""
    if not path:
        return None
    return KVTrace(path, int(max_mb * 1024 * 1024), interval_s)
