"""structlog set-up shared by every process: one JSON object per line on stderr."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(process: str, level: str = "info") -> structlog.stdlib.BoundLogger:
    """Configures structlog for this process and returns a logger bound to `process`."""
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger(process=process)


def get_logger(**bound: object) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(**bound)
