"""`python -m pagedserve.scheduler`: the scheduler process (CPU only; never imports torch).

SIGTERM or SIGINT drains it (no new requests; those in flight finish for `--shutdown-timeout-s`, then end
with an error; the worker is told to stop) and it exits with 0. Further signals change nothing (under a
supervisor and honcho the same stop can arrive twice: the supervisor forwards it, honcho signals the
group), but a second SIGINT, a second Ctrl-C, which exits at once (common/interrupts.py).
"""

from __future__ import annotations

import asyncio
import signal

import uvloop

from pagedserve.common.config import SchedulerConfig, parse_config
from pagedserve.common.interrupts import Interrupts, ignore_further_stops
from pagedserve.common.log import configure_logging
from pagedserve.common.preflight import CONFIG_ERROR, ConfigError, check_bind_address, exit_config_error
from pagedserve.common.security import ClusterKeyError
from pagedserve.scheduler.server import SchedulerServer


async def _main(config: SchedulerConfig) -> None:
    server = SchedulerServer(config)
    server_task = asyncio.create_task(server.run())
    stopping: list[asyncio.Task[None]] = []

    async def drain_then_stop() -> None:
        await server.drain(config.shutdown_timeout_s)
        server_task.cancel()

    interrupts = Interrupts("scheduler")

    def on_signal(signum: int) -> None:
        interrupts.note(signum)  # a second Ctrl-C exits at once, mid-drain
        if not stopping:
            stopping.append(asyncio.create_task(drain_then_stop()))
            loop.remove_signal_handler(signal.SIGTERM)
            ignore_further_stops()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await server_task
    except asyncio.CancelledError:
        pass


def main(argv: list[str] | None = None) -> None:
    config = parse_config(SchedulerConfig, argv, description="pagedserve scheduler")
    try:  # an address taken by another server: one line and status 2, not a restart loop
        check_bind_address(config.scheduler_address, "--scheduler-address")
        check_bind_address(config.worker_address, "--worker-address")
    except ConfigError as e:
        exit_config_error("scheduler", e)
    log = configure_logging("scheduler", config.log_level)
    log.info("scheduler_starting", **{k: getattr(config, k) for k in config.__dataclass_fields__})
    try:
        uvloop.run(_main(config))
    except ClusterKeyError as e:
        log.error("cluster_key_unusable", error=str(e))
        raise SystemExit(CONFIG_ERROR) from None
    log.info("scheduler_stopped")


if __name__ == "__main__":
    main()
