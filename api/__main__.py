"""`python -m pagedserve.api`: the HTTP front end, on uvloop, in front of the scheduler named by ApiConfig.

SIGTERM (or SIGINT) drains: new generation requests get 503 and /health says "shutting down", requests in
flight have shutdown_timeout_s to finish, the rest end with an error event and [DONE] (streams) or a 503;
then the process exits with status 0. A second SIGINT (Ctrl-C) during the drain exits at once. A setting
that cannot work (a port in use, a malformed address) ends it with one line and exit status 2, which its
supervisor does not restart.
"""

from __future__ import annotations

import asyncio
import errno
import signal

import structlog
import uvloop

from pagedserve.api.auth import KeyFileError
from pagedserve.api.limits import start_server
from pagedserve.api.server import create_app, drain
from pagedserve.api.state import STATE
from pagedserve.common.config import ApiConfig, parse_config
from pagedserve.common.interrupts import Interrupts, ignore_further_stops
from pagedserve.common.log import configure_logging
from pagedserve.common.preflight import CONFIG_ERROR, ConfigError, check_connect_address, exit_config_error
from pagedserve.common.security import ClusterKeyError


async def serve(config: ApiConfig) -> None:
    log = configure_logging("api", config.log_level)
    # Module loggers are made before logging is configured; this puts the process on their lines too.
    structlog.contextvars.bind_contextvars(process="api")
    app = create_app(config)
    try:  # with the connection deadlines and cap (api/limits.py)
        runner = await start_server(app, config)
    except OSError as e:  # taken by another server, or not an address of this host: a configuration error
        flag = "--port" if e.errno == errno.EADDRINUSE else "--host"
        raise ConfigError(flag, f"cannot listen on {config.host}:{config.port}: {e.strerror or e}") from None
    log.info("api_listening", host=config.host, port=config.port, scheduler=config.scheduler_address)
    stop = asyncio.Event()
    interrupts = Interrupts("api")
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        interrupts.note(signum)  # a second Ctrl-C exits at once, mid-drain
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    await stop.wait()
    loop.remove_signal_handler(signal.SIGTERM)
    ignore_further_stops()
    log.info("api_draining", in_flight=len(app[STATE].in_flight), timeout_s=config.shutdown_timeout_s)
    ended = await drain(app, config.shutdown_timeout_s)
    log.info("api_stopping", ended_in_flight=ended)
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    config = parse_config(ApiConfig, argv, description="pagedserve's OpenAI-compatible HTTP server")
    try:
        check_connect_address(config.scheduler_address, "--scheduler-address")
        uvloop.run(serve(config))
    except ConfigError as e:  # exit code 2, which the supervisor does not retry
        exit_config_error("api", e)
    except ClusterKeyError as e:  # a configuration error too
        configure_logging("api", config.log_level).error("cluster_key_unusable", error=str(e))
        raise SystemExit(CONFIG_ERROR) from None
    except KeyFileError as e:
        configure_logging("api", config.log_level).error("api_key_file_unusable", error=str(e))
        raise SystemExit(CONFIG_ERROR) from None


if __name__ == "__main__":
    main()
