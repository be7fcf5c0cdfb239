"""Flags both daemons share (common/daemon/config.py), read through each daemon's config class."""

from __future__ import annotations

import pytest

from kvferry.common.api.limits import DEFAULT_MAX_REQUEST_BYTES
from kvferry.common.daemon.flags import parse_config
from kvferry.common.errors import ConfigError
from kvferry.decode_worker.config import DecodeConfig
from kvferry.prefill_worker.config import PrefillConfig

CONFIGS = [PrefillConfig, DecodeConfig]


@pytest.mark.parametrize("cls", CONFIGS, ids=["prefill", "decode"])
def test_max_request_bytes_from_flag_env_and_default(cls):
    assert DEFAULT_MAX_REQUEST_BYTES == 32 * 2**20
    assert parse_config(cls, ["--model", "m"], env={}).max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    assert parse_config(cls, ["--model", "m", "--max-request-bytes", "4096"], env={}).max_request_bytes == 4096
    env = {"KVFERRY_MAX_REQUEST_BYTES": "8192"}
    assert parse_config(cls, ["--model", "m"], env=env).max_request_bytes == 8192
    assert parse_config(cls, ["--model", "m", "--max-request-bytes", "100"], env=env).max_request_bytes == 100


@pytest.mark.parametrize("cls", CONFIGS, ids=["prefill", "decode"])
@pytest.mark.parametrize("bad", ["0", "-1"])
def test_max_request_bytes_must_be_positive(cls, bad):
    with pytest.raises(ConfigError, match=f"--max-request-bytes must be positive, got {bad}"):
        parse_config(cls, ["--model", "m", "--max-request-bytes", bad], env={})
