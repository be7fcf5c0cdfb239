"""The prefill's flags that depend on each other or on the device."""

from __future__ import annotations

import pytest

from kvferry.common.daemon.flags import parse_config
from kvferry.common.errors import ConfigError
from kvferry.prefill_worker.config import PrefillConfig


def config(*argv: str, env: dict | None = None) -> PrefillConfig:
    return parse_config(PrefillConfig, ["--model", "m", *argv], env=env or {})


def test_xfer_threads_default_follows_the_device():
    assert config().num_xfer_threads == 2  # on CPU the posting thread does the copy
    assert config("--device", "cuda:0").num_xfer_threads == 8  # on a GPU it mostly waits
    assert config("--device", "cuda:0", "--xfer-threads", "3").num_xfer_threads == 3
    assert config(env={"KVFERRY_XFER_THREADS": "5"}).num_xfer_threads == 5


@pytest.mark.parametrize("bad", ["0", "65"])
def test_xfer_threads_out_of_range_is_refused(bad):
    with pytest.raises(ConfigError, match=f"--xfer-threads must be in 1..64, got {bad}"):
        config("--xfer-threads", bad)
