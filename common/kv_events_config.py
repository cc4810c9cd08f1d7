"""`--kv-events-config`: vLLM's JSON shape for KV-cache events, parsed and checked once.

    --kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557",
                         "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kv-events"}'

The keys and their meanings are vLLM's (`vllm/config/kv_events.py`); what differs is the endpoint's default,
which binds the loopback interface only (vLLM's binds every interface): the events carry prompt token ids.
Unknown keys are refused rather than ignored, as for --speculative-config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pagedserve.common.flags import json_object_of

KVEventsPublisher = Literal["null", "zmq"]
DEFAULT_KV_EVENTS_ENDPOINT = "tcp://127.0.0.1:5557"


@dataclass(frozen=True)
class KVEventsConfig:
    """Where and how the scheduler publishes its KV-cache events (docs/kv_events.md)."""

    enable_kv_cache_events: bool = False  # off: no events, whatever the rest says
    # "zmq": a PUB socket (and a ROUTER for replay); "null": recorded and dropped. Unset: zmq when enabled
    publisher: KVEventsPublisher | None = None
    endpoint: str = DEFAULT_KV_EVENTS_ENDPOINT  # the PUB socket (bound or connected: scheduler/kv_events)
    replay_endpoint: str | None = None  # a ROUTER socket (always bound) that resends buffered batches
    buffer_steps: int = 10_000  # batches (one per step that changed the cache) kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark: beyond it, a slow subscriber loses batches
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; beyond it, new ones are dropped
    topic: str = ""  # the first frame of every message; subscribers filter on it

    def __post_init__(self) -> None:
        if self.publisher is not None and self.publisher not in get_args(KVEventsPublisher):
            raise ValueError(f"kv events publisher must be one of {get_args(KVEventsPublisher)}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not 1 <= getattr(self, name) <= 10_000_000:
                raise ValueError(f"kv events config {name} must be in [1, 10000000]")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv events config {name} must be a tcp://, ipc:// or inproc:// address")

    @property
    def resolved_publisher(self) -> KVEventsPublisher:
        """The publisher that runs: "null" while events are off, and vLLM's default when unset."""
        if not self.enable_kv_cache_events:
            return "null"
        return self.publisher or "zmq"


_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str, type(None)),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
}


def parse_kv_events_config(text: str) -> KVEventsConfig | None:
    """The config that `text` (the flag's JSON object) states; None for an empty string. ValueError names what
    is wrong."""
    raw = json_object_of(text, KVEventsConfig, "kv events config")
    if raw is None:
        return None
    for key, value in raw.items():
        want = _TYPES[key]
        if not isinstance(value, want) or (isinstance(value, bool) and bool not in want):
            raise ValueError(f"kv events config {key} must be {' or '.join(t.__name__ for t in want)}")
    return KVEventsConfig(**raw)


def kv_events_enabled(text: str) -> bool:
    """Whether the flag's JSON turns events on."""
    config = parse_kv_events_config(text)
    return config is not None and config.enable_kv_cache_events


def endpoint_for_rank(endpoint: str, data_parallel_rank: int) -> str:
    """The endpoint of replica `data_parallel_rank`, as vLLM offsets it: a tcp port plus the rank, an
    ipc/inproc name with `_dp<rank>` appended; rank 0 keeps the endpoint as given."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"
