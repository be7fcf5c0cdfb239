"""Logging set-up: one line per event on stderr (journald adds the timestamp under systemd).

Only ``__main__`` modules call ``configure``; every other module does
``logger = logging.getLogger(__name__)`` and logs with lazy ``%s`` arguments.
"""

from __future__ import annotations

import logging.config

LEVELS = ("debug", "info", "warning", "error")


class NonHttpProbes(logging.Filter):
    """uvicorn's "Invalid HTTP request received." is what sglang-router's gRPC probe of each worker's
    HTTP port looks like (docs/routers.md): harmless and answered 400. Kept, explained, only at
    --log-level debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Invalid HTTP request received"):
            return True
        if not logging.getLogger().isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.msg = "non-HTTP bytes on the HTTP port (sglang-router probes it for gRPC), answered 400"
        return True


def logging_config(level: str = "info") -> dict:
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "line": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
        },
        "filters": {"non_http_probes": {"()": NonHttpProbes}},
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "line", "stream": "ext://sys.stderr"},
        },
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": {
            "uvicorn.access": {"level": "WARNING"},
            "uvicorn.error": {"level": "INFO", "filters": ["non_http_probes"]},
        },
    }


def configure(level: str = "info") -> None:
    logging.config.dictConfig(logging_config(level))
