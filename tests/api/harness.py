"""Runs a fake scheduler (and, for api tests, the HTTP app) on an event loop in a background thread."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from pagedserve.common.config import ApiConfig
from tests.api.fake_scheduler import FakeScheduler

T = TypeVar("T")


class BackgroundLoop:
    """An asyncio loop in a daemon thread; `run` executes a coroutine there and waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class ApiServer:
    """A FakeScheduler and the api app in front of it, on 127.0.0.1 with free ports."""

    def __init__(
        self, model_dir: str, config: ApiConfig | None = None, send_buffer: int = 0, **fake_options: Any
    ) -> None:
        """`send_buffer` > 0 sets the accepted sockets' SO_SNDBUF (they inherit the listener's), so that
        a client that reads nothing stalls the server's writes after a few KB, not a few MB."""
        self.background = BackgroundLoop()
        self.fake: FakeScheduler = self.background.run(self._start_fake(model_dir, fake_options))
        sock = socket.socket()
        if send_buffer:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = config or ApiConfig()
        self.config = ApiConfig(**{**config.__dict__, "scheduler_address": self.fake.address})
        self._runner: web.AppRunner = self.background.run(self._start_app(sock))

    @staticmethod
    async def _start_fake(model_dir: str, options: dict[str, Any]) -> FakeScheduler:
        return await FakeScheduler(model_root=model_dir, **options).start()

    async def _start_app(self, sock: socket.socket) -> web.AppRunner:
        from pagedserve.api.limits import start_server  # imported here so client tests need no api
        from pagedserve.api.server import create_app

        return await start_server(create_app(self.config), self.config, sock)

    def close(self) -> None:
        self.background.run(self._runner.cleanup())
        self.background.run(self.fake.stop())
        self.background.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> HttpReply:
        """One HTTP request; `raw` sends bytes as they are (malformed JSON, say)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            headers = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            return HttpReply(
                response.status,
                response.getheader("Content-Type") or "",
                response.read().decode(),
                response.headers,
            )
        finally:
            conn.close()

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> HttpReply:
        return self.request("POST", path, body, headers=headers)

    def get(self, path: str, headers: dict[str, str] | None = None) -> HttpReply:
        return self.request("GET", path, headers=headers)

    def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The JSON events of a streamed response, after checking the SSE framing byte for byte."""
        reply = self.post(path, {**body, "stream": True})
        assert reply.status == 200, reply.text
        assert reply.content_type.startswith("text/event-stream")
        return parse_sse(reply.text)


@dataclass
class HttpReply:
    status: int
    content_type: str
    text: str
    headers: http.client.HTTPMessage | None = None  # case-insensitive .get(name)

    def json(self) -> Any:
        return json.loads(self.text)


def parse_sse(text: str) -> list[dict[str, Any]]:
    """Events of `data: <json>\\n\\n` ending with `data: [DONE]\\n\\n`, and nothing else."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    parsed = []
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event, event
        parsed.append(json.loads(event[len("data: ") :]))
    return parsed


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Polls `predicate` until it holds or `timeout` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()
