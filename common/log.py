"""Logging set-up: one line per event on stderr (journald adds the timestamp under systemd).

Only ``__main__`` modules call ``configure``; every other module does
``logger = logging.getLogger(__name__)`` and logs with lazy ``%s`` arguments.
"""

from __future__ import annotations

import logging.config

LEVELS = ("debug", "info", "warning", "error")


def logging_config(level: str = "info") -> dict:
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "line": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
        },
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "line", "stream": "ext://sys.stderr"},
        },
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": {
            "uvicorn.access": {"level": "WARNING"},
            "uvicorn.error": {"level": "INFO"},
        },
    }


def configure(level: str = "info") -> None:
    logging.config.dictConfig(logging_config(level))
