"""What a daemon settles from its config before anything starts, each refusal one line.

``settle(config)`` returns the config the daemon runs with:

- ``--model`` / ``--draft-model``: a folder must hold ``config.json`` (a mistyped path or a hub name
  is refused, never created); a ``FILE.gguf`` is converted once into ``~/.cache/kvferry/gguf``
  (``common/models/gguf.py``) and the folder served; ``--served-model-name`` defaults to the GGUF's
  stem (a folder's name otherwise, ``DaemonCore``).
- ``--tp-size`` is checked against the model, naming the sizes that fit.
- ``--max-total-tokens 0`` (auto) becomes a count: ``--kv-mem-fraction`` of the memory free now
  (on CUDA: 0.4 of the device's free memory less the weights, so that a prefill and a decode
  starting together on one GPU both fit; on CPU: 0.1 of ``MemAvailable``, at most
  ``CPU_KV_BYTES_CAP``, since the host is shared with everything else), divided by the KV bytes of
  one token of the target and the draft, and at most ``AUTO_TOKENS_CAP`` tokens (the fixed default
  this replaced: the fraction lowers it where memory is short, never raises it past that).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from kvferry.common.daemon.config import CommonConfig
from kvferry.common.errors import ConfigError, ModelLoadError
from kvferry.common.models.config import ModelConfig

logger = logging.getLogger(__name__)

CUDA_KV_FRACTION = 0.4
CPU_KV_FRACTION = 0.1
CPU_KV_BYTES_CAP = 512 << 20
AUTO_TOKENS_CAP = 65536
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


def checkpoint_folder(value: str, flag: str, dtype: str) -> Path:
    """The folder ``value`` names (a GGUF converted first); ConfigError naming ``flag`` otherwise."""
    from kvferry.common.models.gguf import cached_folder, is_gguf

    path = Path(value).expanduser()
    if is_gguf(path):
        if not path.is_file():
            raise ConfigError(f"{flag} {value}: no such .gguf file")
        try:
            return cached_folder(path, dtype)
        except ModelLoadError as exc:
            raise ConfigError(f"{flag} {value}: {exc}") from exc
    if not path.exists():
        is_hub_name = value.count("/") == 1 and not path.is_absolute()
        hub = " (hub names do not load: download the folder first)" if is_hub_name else ""
        raise ConfigError(f"{flag} {value}: no such folder or .gguf file{hub}")
    if not (path / "config.json").is_file():
        inner = next((f"; pass {value.rstrip('/')}/{d}" for d in ("target", "draft")
                      if (path / d / "config.json").is_file()), "")
        raise ConfigError(f"{flag} {value}: not a checkpoint folder (no config.json); it needs config.json, "
                          f"model.safetensors (or an index of shards) and tokenizer.json{inner}")
    if not any((path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        raise ConfigError(f"{flag} {value}: no model.safetensors nor model.safetensors.index.json (only safetensors "
                          "weights load; .bin and .pt do not)")
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(f"{flag} {value}: no tokenizer.json (only fast tokenizers load: AutoTokenizer."
                          "from_pretrained(DIR).save_pretrained(DIR) writes one)")
    return path


def read_config(folder: Path, flag: str) -> ModelConfig:
    try:
        return ModelConfig.from_dir(folder)
    except ModelLoadError as exc:
        raise ConfigError(f"{flag}: {exc}") from exc


def kv_bytes_per_token(configs: list[ModelConfig], tp_size: int, dtype: str) -> int:
    """KV bytes one token costs on rank 0: the target's KV heads of that rank, the draft's whole; an
    MLA model (DeepSeek) one latent row per layer, whole on every rank (``common/cache/mla_cache.py``);
    ``dtype`` is the pool's (``CommonConfig.kv_torch_dtype_name``)."""
    total = 0
    for i, c in enumerate(configs):
        if c.deepseek is not None:
            total += c.num_hidden_layers * c.deepseek.latent_width * DTYPE_BYTES[dtype]
            continue
        heads = max(1, c.num_key_value_heads // tp_size) if i == 0 else c.num_key_value_heads
        total += c.num_hidden_layers * 2 * heads * c.head_dim * DTYPE_BYTES[dtype]
    return total


def _weights_bytes(folder: Path, dtype: str, tp_size: int, checkpoint_dtype: str) -> int:
    on_disk = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return on_disk * DTYPE_BYTES[dtype] // DTYPE_BYTES.get(checkpoint_dtype, 4) // tp_size


def free_kv_bytes(config: CommonConfig, target: Path, checkpoint_dtype: str) -> int:
    """The bytes the KV pools may take: the fraction of free memory of config's device."""
    fraction = config.kv_mem_fraction
    if config.device == "cpu":
        fraction = CPU_KV_FRACTION if fraction < 0 else fraction
        return min(int(fraction * _mem_available()), CPU_KV_BYTES_CAP)
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(config.device))
    weights = _weights_bytes(target, config.torch_dtype_name, config.tp_size, checkpoint_dtype)
    return int((CUDA_KV_FRACTION if fraction < 0 else fraction) * max(0, free - weights))


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30  # no /proc: assume a small machine


def auto_tokens(config: CommonConfig, target: Path, configs: list[ModelConfig]) -> int:
    per_token = kv_bytes_per_token(configs, config.tp_size, config.kv_torch_dtype_name)
    budget = free_kv_bytes(config, target, configs[0].torch_dtype)
    tokens = min(budget // per_token, AUTO_TOKENS_CAP) // config.page_size * config.page_size
    if tokens < config.page_size:
        raise ConfigError(f"--max-total-tokens auto: {budget} bytes free for KV hold no page of {config.page_size} "
                          f"tokens at {per_token} bytes per token; pass --max-total-tokens N")
    logger.info("max_total_tokens auto: %d tokens (%d bytes per token of kv_dtype=%s, %.2f GiB of KV per model)",
                tokens, per_token, config.kv_torch_dtype_name, tokens * per_token / (1 << 30))
    return tokens


def settle(config: CommonConfig) -> CommonConfig:
    """``config`` with the model folders resolved, the TP size checked and the pool size counted."""
    from kvferry.common.models.gguf import is_gguf
    from kvferry.common.layers.tp_layers import TpShard

    dtype = config.torch_dtype_name
    target = checkpoint_folder(config.model, "--model", dtype)
    changes: dict = {"model": str(target)}
    if config.served_model_name is None and is_gguf(config.model):
        changes["served_model_name"] = Path(config.model).stem
    configs = [read_config(target, "--model")]
    if config.draft_model:
        draft = checkpoint_folder(config.draft_model, "--draft-model", dtype)
        changes["draft_model"] = str(draft)
        configs.append(read_config(draft, "--draft-model"))
    TpShard.of(configs[0], config.tp_size, 0)  # TpConfigError (a ConfigError) names the valid sizes
    if config.max_total_tokens == 0:
        changes["max_total_tokens"] = auto_tokens(config, target, configs)
    return dataclasses.replace(config, **changes)


def apply_kernel_options(config: CommonConfig) -> None:
    """Process-wide kernel settings from ``config``: ``--disable-pdl`` turns programmatic dependent
    launch off for this process's kernels and, through the environment, for its TP ranks'."""
    if config.disable_pdl:
        from kvferry.common.kernels import pdl

        os.environ["KVFERRY_PDL"] = "0"
        pdl.set_enabled(False)
