"""A `KVSnapshot` as JSON for browsers and trace files: one object per snapshot, field names as in
common/messages.py, cells as [state, owner, length] runs. The api's /dashboard streams these, `--kv-trace`
writes them one per line, and the dashboard page and scripts/kv_replay.py read them back."""

from __future__ import annotations

from typing import Any

import msgspec

from pagedserve.common.messages import KVSnapshot

TRACE_FORMAT = "pagedserve-kv-trace/1"  # the first line of a trace file: {"format": TRACE_FORMAT, ...}
CELL_STATES = ("free", "cached", "used", "shared")  # a cell's state value indexes this


def snapshot_to_dict(snapshot: KVSnapshot) -> dict[str, Any]:
    """The snapshot as plain JSON-ready values (the query id, a wire detail, left out)."""
    d = msgspec.structs.asdict(snapshot)
    del d["query_id"]
    d["requests"] = [msgspec.structs.asdict(row) for row in snapshot.requests]
    return d


def snapshot_json(snapshot: KVSnapshot) -> bytes:
    return msgspec.json.encode(snapshot_to_dict(snapshot))


def trace_header(**about: Any) -> bytes:
    """The first line of a trace: its format and what recorded it (pool size, policy)."""
    return msgspec.json.encode({"format": TRACE_FORMAT, **about})
