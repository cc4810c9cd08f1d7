"""What the api's handlers share: its config, the scheduler client, the served model and request counters."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client.core import CounterMetricFamily

from pagedserve.api.generation import Generation
from pagedserve.api.model import ModelState
from pagedserve.client import AsyncEngineClient
from pagedserve.common.config import ApiConfig
from pagedserve.common.exposition import render


@dataclass
class ApiState:
    config: ApiConfig
    client: AsyncEngineClient  # one client, so one scheduler connection, for every HTTP request
    models: ModelState
    started: int = field(default_factory=lambda: int(time.time()))
    requests_total: Counter[tuple[str, int]] = field(default_factory=Counter)  # (route, status) -> count
    # Parsing, tokenizing and chat templates of big bodies, off the event loop (ApiConfig.tokenizer_threads).
    # More than one thread, so that one huge body does not queue every other large request behind it; a fast
    # tokenizer releases the GIL while it encodes, and the loop itself already shares it with these threads.
    tokenizer_pool: ThreadPoolExecutor = field(init=False)
    # /health has seen the scheduler's connection up: while it is down from then on, /health answers 503 at
    # once (before, a round trip waits for the first connection)
    scheduler_reached: bool = False
    draining: bool = False  # SIGTERM came: generation requests get 503, /health says "shutting down"
    in_flight: set[Generation] = field(default_factory=set)  # submitted and not yet answered in full

    def __post_init__(self) -> None:
        self.tokenizer_pool = ThreadPoolExecutor(
            self.config.tokenizer_threads, thread_name_prefix="api-tokenizer"
        )

    def metrics_text(self) -> str:
        """The api's own counters in Prometheus text format."""
        family = CounterMetricFamily(
            "pagedserve_api_requests_total",
            "HTTP requests answered by the api, by route and status.",
            labels=["route", "status"],
        )
        for (route, status), count in sorted(self.requests_total.items()):
            family.add_metric([route, str(status)], count)
        return render([family])


STATE = web.AppKey("state", ApiState)
RECORD: web.RequestKey[dict[str, object]] = web.RequestKey("record", dict)  # fields of the request's log line
