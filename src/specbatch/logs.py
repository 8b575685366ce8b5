"""structlog set-up: key-value events, console or JSON, filtered by level.

A host application that configured structlog itself keeps its configuration; otherwise
the level comes from ``SPECBATCH_LOG_LEVEL`` (default: warning) until ``configure``.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(fmt: str = "console", level: str | None = None, stream=None) -> None:
    level = (level or os.environ.get("SPECBATCH_LOG_LEVEL", "warning")).lower()
    if fmt not in ("console", "json"):
        raise ValueError(f"log format must be 'console' or 'json', got {fmt!r}")
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


def configure_default() -> None:
    if not structlog.is_configured():
        configure()
