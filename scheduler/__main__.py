"""`python -m scheduler`: the scheduler process (CPU only; never imports torch)."""

from __future__ import annotations

import asyncio
import signal

import uvloop

from common.config import SchedulerConfig, parse_config
from common.log import configure_logging
from scheduler.server import SchedulerServer


async def _main(config: SchedulerConfig) -> None:
    server_task = asyncio.create_task(SchedulerServer(config).run())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server_task.cancel)
    try:
        await server_task
    except asyncio.CancelledError:
        pass


def main(argv: list[str] | None = None) -> None:
    config = parse_config(SchedulerConfig, argv, description="pagedserve scheduler")
    log = configure_logging("scheduler", config.log_level)
    log.info("scheduler_starting", **{k: getattr(config, k) for k in config.__dataclass_fields__})
    uvloop.run(_main(config))
    log.info("scheduler_stopped")


if __name__ == "__main__":
    main()
