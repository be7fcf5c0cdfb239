"""Start-up refusals and derived settings (common/daemon/start.py): a mistyped --model, a folder that
is not a checkpoint and a --tp-size the model cannot be split over are each refused in one line
naming the value and what would fit; a GGUF --model is served from its converted folder under its
file's stem; --max-total-tokens 0 counts the pool from free memory within the CPU caps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvferry.common.daemon.flags import parse_config
from kvferry.common.daemon.start import AUTO_TOKENS_CAP, CPU_KV_BYTES_CAP, kv_bytes_per_token, settle
from kvferry.common.errors import ConfigError
from kvferry.common.models.config import ModelConfig
from kvferry.prefill_worker.config import PrefillConfig
from tests.cluster import REPO, tiny_model_dirs


def config(*args: str) -> PrefillConfig:
    return parse_config(PrefillConfig, list(args), env={})


def test_mistyped_model_path_is_refused_and_never_created(tmp_path):
    missing = tmp_path / "my-modle"
    with pytest.raises(ConfigError, match=f"--model {missing}: no such folder or .gguf file"):
        settle(config("--model", str(missing)))
    assert not missing.exists()
    with pytest.raises(ConfigError, match="hub names do not load"):
        settle(config("--model", "HuggingFaceTB/SmolLM2-135M-Instruct"))


def test_folder_without_config_json_weights_or_tokenizer_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"not a checkpoint folder \(no config.json\)"):
        settle(config("--model", str(tmp_path)))
    target = Path(tiny_model_dirs()[0])
    (tmp_path / "config.json").write_bytes((target / "config.json").read_bytes())
    with pytest.raises(ConfigError, match="no model.safetensors nor model.safetensors.index.json"):
        settle(config("--model", str(tmp_path)))
    (tmp_path / "model.safetensors").symlink_to(target / "model.safetensors")
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        settle(config("--model", str(tmp_path)))


def test_bad_tp_size_names_the_valid_sizes():
    target = tiny_model_dirs()[0]  # 4 attention heads, 2 KV heads, intermediate 256
    with pytest.raises(ConfigError, match="--tp-size 3: 4 attention heads do not divide by 3; valid sizes for "
                                          ".*: 1, 2, 4$"):
        settle(config("--model", target, "--tp-size", "3"))


def test_auto_pool_size_stays_within_the_cpu_caps():
    target, draft = tiny_model_dirs()
    settled = settle(config("--model", target, "--draft-model", draft))
    per_token = kv_bytes_per_token([ModelConfig.from_dir(target), ModelConfig.from_dir(draft)], 1, "float32")
    assert 16 <= settled.max_total_tokens <= AUTO_TOKENS_CAP and settled.max_total_tokens % 16 == 0
    assert settled.max_total_tokens * per_token <= CPU_KV_BYTES_CAP
    assert settle(config("--model", target, "--max-total-tokens", "1024")).max_total_tokens == 1024


def test_gguf_model_is_served_from_its_converted_folder_under_its_stem(tmp_path, monkeypatch):
    from tests.unit.test_gguf import write_gguf

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the conversion cache lives under ~/.cache/kvferry
    path = write_gguf(tmp_path / "Tiny-Chat.gguf", Path(tiny_model_dirs()[0]))
    settled = settle(config("--model", str(path)))
    assert Path(settled.model).is_relative_to(tmp_path / "home" / ".cache" / "kvferry" / "gguf")
    assert (Path(settled.model) / "config.json").is_file() and settled.served_model_name == "Tiny-Chat"
    assert settle(config("--model", str(path), "--served-model-name", "x")).served_model_name == "x"


def test_daemon_refusal_is_one_line_with_exit_code_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvferry.decode_worker", "--model", str(tmp_path / "nope")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"kvferry decode: --model {tmp_path / 'nope'}: no such folder or "
                                                ".gguf file"]
