"""structlog configuration: a human console renderer by default, JSON lines with ``--log-json``."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_configured = False


def configure(*, json: bool = False, level: int = logging.INFO) -> None:
    """Send logs to stderr, as JSON lines when ``json`` is true."""
    global _configured
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(**context: Any) -> Any:
    """A structlog logger bound to ``context`` (model, backend, session …)."""
    if not _configured:
        configure()
    return structlog.get_logger("ds4").bind(**context)
