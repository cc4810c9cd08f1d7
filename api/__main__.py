"""`python -m api`: the HTTP front end, on uvloop, in front of the scheduler named by ApiConfig."""

from __future__ import annotations

import asyncio
import signal

import structlog
import uvloop
from aiohttp import web

from api.server import create_app
from common.config import ApiConfig, parse_config
from common.log import configure_logging


async def serve(config: ApiConfig) -> None:
    log = configure_logging("api", config.log_level)
    # Module loggers are made before logging is configured; this puts the process on their lines too.
    structlog.contextvars.bind_contextvars(process="api")
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its requests.
    runner = web.AppRunner(create_app(config), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    log.info("api_listening", host=config.host, port=config.port, scheduler=config.scheduler_address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("api_stopping")
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    config = parse_config(ApiConfig, argv, description="pagedserve's OpenAI-compatible HTTP server")
    uvloop.run(serve(config))


if __name__ == "__main__":
    main()
