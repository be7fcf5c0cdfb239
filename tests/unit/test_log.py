"""common/daemon/log.py: uvicorn's "Invalid HTTP request received." (sglang-router's gRPC probe of each
worker's HTTP port) is dropped at info and kept, explained, at debug; other uvicorn lines pass."""

from __future__ import annotations

import logging

import pytest

from kvferry.common.daemon.log import NonHttpProbes, logging_config


def record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, None, None)


@pytest.fixture
def root_level():
    root = logging.getLogger()
    before = root.level
    yield root.setLevel
    root.setLevel(before)


def test_probe_line_is_dropped_at_info(root_level):
    root_level(logging.INFO)
    assert NonHttpProbes().filter(record("Invalid HTTP request received.")) is False
    assert NonHttpProbes().filter(record("Started server process [1]")) is True


def test_probe_line_is_explained_at_debug(root_level):
    root_level(logging.DEBUG)
    probe = record("Invalid HTTP request received.")
    assert NonHttpProbes().filter(probe) is True
    assert probe.levelname == "DEBUG" and "sglang-router probes it for gRPC" in probe.getMessage()


def test_the_filter_sits_on_uvicorns_error_logger():
    config = logging_config("info")
    assert config["loggers"]["uvicorn.error"]["filters"] == ["non_http_probes"]
    assert config["filters"]["non_http_probes"]["()"] is NonHttpProbes
