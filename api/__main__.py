"""`python -m pagedserve.api`: the HTTP front end, on uvloop, in front of the scheduler named by ApiConfig.

SIGTERM (or SIGINT) drains: new generation requests get 503 and /health says "shutting down", requests in
flight have shutdown_timeout_s to finish, the rest end with an error event and [DONE] (streams) or a 503;
then the process exits with status 0.
"""

from __future__ import annotations

import asyncio
import signal

import structlog
import uvloop

from pagedserve.api.auth import KeyFileError
from pagedserve.api.limits import start_server
from pagedserve.api.server import create_app, drain
from pagedserve.api.state import STATE
from pagedserve.common.config import ApiConfig, parse_config
from pagedserve.common.log import configure_logging
from pagedserve.common.security import ClusterKeyError


async def serve(config: ApiConfig) -> None:
    log = configure_logging("api", config.log_level)
    # Module loggers are made before logging is configured; this puts the process on their lines too.
    structlog.contextvars.bind_contextvars(process="api")
    app = create_app(config)
    runner = await start_server(app, config)  # with the connection deadlines and cap (api/limits.py)
    log.info("api_listening", host=config.host, port=config.port, scheduler=config.scheduler_address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("api_draining", in_flight=len(app[STATE].in_flight), timeout_s=config.shutdown_timeout_s)
    ended = await drain(app, config.shutdown_timeout_s)
    log.info("api_stopping", ended_in_flight=ended)
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    config = parse_config(ApiConfig, argv, description="pagedserve's OpenAI-compatible HTTP server")
    try:
        uvloop.run(serve(config))
    except ClusterKeyError as e:  # a configuration error: exit code 2, which the supervisor does not retry
        configure_logging("api", config.log_level).error("cluster_key_unusable", error=str(e))
        raise SystemExit(2) from None
    except KeyFileError as e:
        configure_logging("api", config.log_level).error("api_key_file_unusable", error=str(e))
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
