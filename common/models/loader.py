"""Load a Hugging Face checkpoint folder (safetensors, single or sharded) into the class ``registry.py``
names for its architecture (``LlamaForCausalLM`` for the Llama family, ``Qwen3MoeForCausalLM``,
``DeepseekForCausalLM`` for DeepSeek-V2/V3). A tensor the model's ``hf_tensor_map`` does not name
may be a fused one it splits (``model.unfuse``). FP8 checkpoints (``quant_config.py``) keep their
float8_e4m3fn weights as they are, one byte each, beside fp32 scales; ``dtype`` is then that of
everything else (norms, embeddings, lm_head, activations)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvferry.common.errors import ModelLoadError
from kvferry.common.models.config import ModelConfig
from kvferry.common.models.registry import model_class
from kvferry.common.layers.tp_layers import ScaleSlot, TensorSlot, TpShard

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Tensors some checkpoints carry that the model recomputes, or that ``read_kv_scales`` reads.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "self_attn.k_scale", "self_attn.v_scale")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ModelLoadError(f"dtype is {name!r}; supported: {sorted(DTYPES)}")
    return DTYPES[name]


def load_model(
    model_dir: str | Path, *, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu",
    tp_size: int = 1, tp_rank: int = 0,
) -> nn.Module:
    """Read ``config.json`` and the safetensors of ``model_dir``; ``dtype`` None keeps the checkpoint's.
    With ``tp_size`` > 1 only rank ``tp_rank``'s part of each sharded tensor is kept (``common/layers/tp_layers.py``)."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    torch_dtype = parse_dtype(dtype if dtype is not None else config.torch_dtype)
    model = model_class(config)(config, torch_dtype, device, TpShard.of(config, tp_size, tp_rank))
    slots = model.hf_tensor_map()
    loaded: set[str] = set()
    ignored: list[str] = []
    for path, names in _shards(model_dir).items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            present = set(f.keys())
            for name in names if names is not None else sorted(present):
                if name not in present:
                    raise ModelLoadError(
                        f"{model_dir / INDEX_FILE}: maps tensor '{name}' to {path.name}, which lacks it"
                    )
                filled = _load_tensor(f, name, model, slots, path)
                if not filled:
                    ignored.append(name)
                loaded.update(filled)
    missing = sorted(set(slots) - loaded)
    if missing:
        where = model_dir / (INDEX_FILE if (model_dir / INDEX_FILE).is_file() else SINGLE_FILE)
        raise ModelLoadError(f"{where}: missing tensor '{missing[0]}' ({len(missing)} missing in all)")
    unexpected = [n for n in ignored if not n.endswith(_IGNORED_SUFFIXES) and n != "lm_head.weight"]
    if unexpected:
        logger.warning("model=%s ignored %d unknown tensors, first %s", model_dir, len(unexpected), unexpected[0])
    logger.info(
        "loaded model=%s arch=%s layers=%d dtype=%s weights=%s device=%s fingerprint=%s tp_rank=%d tp_size=%d",
        model_dir, config.architecture, config.num_hidden_layers, torch_dtype, _weights_label(config), device,
        config.fingerprint, tp_rank, tp_size,
    )
    return model


def _weights_label(config: ModelConfig) -> str:
    q = config.quantization
    return "plain" if q is None else f"fp8-{q.strategy.value} ({q.quant_method})"


def read_kv_scales(model_dir: str | Path, num_layers: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The FP8 KV scales of every layer, ``(k_scales, v_scales)``: the one-element tensors
    ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` of the checkpoint (as vLLM reads them: stored
    = x / scale), 1.0 for a layer without one. Raises ModelLoadError for a scale that is not one
    positive finite number."""
    model_dir = Path(model_dir)
    wanted = {f"model.layers.{i}.self_attn.{kind}_scale": (kind, i) for i in range(num_layers) for kind in "kv"}
    scales = {"k": [1.0] * num_layers, "v": [1.0] * num_layers}
    for path, names in _shards(model_dir).items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in set(names if names is not None else f.keys()) & wanted.keys():
                tensor = f.get_tensor(name)
                value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else float("nan")
                if not (math.isfinite(value) and value > 0):
                    raise ModelLoadError(f"{path}: '{name}' must be one positive finite number, got shape "
                                         f"{tuple(tensor.shape)} values {tensor.flatten()[:4].tolist()}")
                kind, layer = wanted[name]
                scales[kind][layer] = value
    return tuple(scales["k"]), tuple(scales["v"])


def _shards(model_dir: Path) -> dict[Path, list[str] | None]:
    """Safetensors file -> tensor names to read from it (None: all of them)."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index_path}: cannot read 'weight_map': {exc}") from exc
        shards: dict[Path, list[str]] = {}
        for name, file_name in weight_map.items():
            shards.setdefault(model_dir / file_name, []).append(name)
        for path in shards:
            if not path.is_file():
                raise ModelLoadError(f"{index_path}: names shard '{path.name}', which is not in {model_dir}")
        return shards
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise ModelLoadError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    return {single: None}


def _load_tensor(f, name: str, model, slots: dict[str, TensorSlot | ScaleSlot], path: Path) -> list[str]:
    """Copy checkpoint tensor ``name`` of the open file ``f`` where it lands; returns the names of
    ``slots`` it filled: itself, the parts ``model.unfuse`` splits it into, or none (unknown)."""
    if name in slots:
        _copy(f.get_tensor(name), slots[name], name, path)
        return [name]
    parts = model.unfuse(name, lambda: f.get_tensor(name))
    for part, tensor in parts.items():
        if part not in slots:
            raise ModelLoadError(f"{path}: tensor '{name}' holds '{part}', which config.json does not imply")
        _copy(tensor, slots[part], part, path)
    return list(parts)


def _copy(tensor: torch.Tensor, slot: TensorSlot | ScaleSlot, name: str, path: Path) -> None:
    problem = slot.problem(tensor)
    if problem is not None:
        raise ModelLoadError(f"{path}: tensor '{name}' {problem}")
    slot.fill(tensor)
