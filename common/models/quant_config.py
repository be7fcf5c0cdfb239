"""FP8 checkpoint formats, read from ``config.json``'s ``quantization_config`` (``config.py`` calls
``parse_quantization``). Exactly two formats load; anything else is refused by name:

- compressed-tensors "float-quantized" (llm-compressor's FP8_DYNAMIC; also written as
  "naive-quantized"): one config group targeting ``Linear`` with 8-bit float weights, one
  ``weight_scale`` per tensor (shape [] or [1]) or per output channel ([out, 1]), input
  activations quantized dynamically per token, and an ``ignore`` list of modules left in bf16
  (``lm_head`` must be one of them). Dequantized: ``w = weight * weight_scale``.
- ``quant_method: "fp8"`` with ``weight_block_size: [128, 128]`` (Qwen3-FP8, DeepSeek-V3):
  ``weight_scale_inv`` of shape [ceil(out/128), ceil(in/128)], ``w = weight * scale_inv`` per
  128 x 128 block (the last block of a dim may be ragged), activations quantized dynamically
  per token per 128-column group; ``modules_to_not_convert`` / ``ignored_layers`` name modules
  left in bf16.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from kvferry.common.errors import ModelLoadError

BLOCK_SIZE = 128  # the only weight_block_size served: the kernels' K group and the scales' block
CT_FORMATS = ("float-quantized", "naive-quantized")


class WeightStrategy(enum.Enum):
    """How one checkpoint tensor's FP8 weight is scaled."""

    TENSOR = "tensor"    # one scale for the whole tensor
    CHANNEL = "channel"  # one scale per output row
    BLOCK = "block"      # one scale per 128 x 128 block


@dataclass(frozen=True)
class Fp8Scheme:
    """An FP8 checkpoint's weight scheme. Activations are always dynamic: per token (tensor,
    channel) or per token per 128-column group (block)."""

    quant_method: str  # "compressed-tensors" or "fp8"
    strategy: WeightStrategy
    ignore: tuple[str, ...] = ()  # module names (or "re:PATTERN") left unquantized

    @property
    def is_block(self) -> bool:
        return self.strategy is WeightStrategy.BLOCK

    @property
    def scale_suffix(self) -> str:
        """The checkpoint name of a weight's scale, after the module name."""
        return "weight_scale_inv" if self.quant_method == "fp8" else "weight_scale"

    def quantizes(self, module: str) -> bool:
        """Whether the linear ``module`` (a Hugging Face name such as ``model.layers.0.mlp.down_proj``)
        holds FP8 weights."""
        for entry in self.ignore:
            if entry.startswith("re:") and re.fullmatch(entry[3:], module):
                return False
            if entry == module:
                return False
        return True

    def fingerprint_key(self) -> dict:
        return {"quant_method": self.quant_method, "strategy": self.strategy.value, "ignore": sorted(self.ignore)}


def parse_quantization(raw: Any, source: str) -> Fp8Scheme | None:
    """``quantization_config`` (None: an unquantized checkpoint) -> its scheme; raises ModelLoadError
    naming the field and value of any format not served."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _error(source, "", f"is a {type(raw).__name__}, expected a table")
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        scheme = _compressed_tensors(raw, source)
    elif method == "fp8":
        scheme = _block_fp8(raw, source)
    else:
        raise _error(source, ".quant_method", f"is {method!r}; supported: 'compressed-tensors' (float-quantized "
                     "FP8) and 'fp8' (weight_block_size [128, 128])")
    if scheme.quantizes("lm_head"):
        raise _error(source, ".ignore", f"is {list(scheme.ignore)}: a quantized lm_head is not supported; "
                     "FP8 checkpoints served here keep lm_head in bf16 (list it in ignore)")
    return scheme


def _error(source: str, field: str, problem: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: field 'quantization_config{field}' {problem}")


def _compressed_tensors(raw: dict, source: str) -> Fp8Scheme:
    fmt = raw.get("format")
    if fmt not in CT_FORMATS:
        raise _error(source, ".format", f"is {fmt!r} (quant_method 'compressed-tensors'); supported: "
                     f"{list(CT_FORMATS)} with float8 weights")
    if raw.get("kv_cache_scheme") is not None:
        raise _error(source, ".kv_cache_scheme", "is set; an FP8 KV cache is not supported")
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _error(source, ".config_groups", f"is {groups!r}; exactly one group is supported")
    name, group = next(iter(groups.items()))
    where = f".config_groups.{name}"
    tables = ("weights", "input_activations")
    if not isinstance(group, dict) or not all(isinstance(group.get(k) or {}, dict) for k in tables):
        raise _error(source, where, f"is {group!r}, expected a table with 'weights' and 'input_activations' tables")
    if group.get("targets") != ["Linear"]:
        raise _error(source, f"{where}.targets", f"is {group.get('targets')!r}; supported: ['Linear']")
    weights = group.get("weights") or {}
    _expect(weights, source, f"{where}.weights", num_bits=8, type="float", symmetric=True, dynamic=False)
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel"):
        raise _error(source, f"{where}.weights.strategy", f"is {strategy!r}; supported: 'tensor', 'channel'")
    acts = group.get("input_activations")
    if acts is None:
        raise _error(source, f"{where}.input_activations", "is missing: weight-only FP8 is not supported")
    if acts.get("dynamic") is not True:
        raise _error(source, f"{where}.input_activations.dynamic", f"is {acts.get('dynamic')!r}: static activation "
                     "scales are not supported; quantize with dynamic per-token activations (FP8_DYNAMIC)")
    _expect(acts, source, f"{where}.input_activations", num_bits=8, type="float", strategy="token")
    if group.get("output_activations") is not None:
        raise _error(source, f"{where}.output_activations", "is set; output activation quantization is not supported")
    return Fp8Scheme("compressed-tensors", WeightStrategy(strategy), _names(raw, "ignore", source))


def _block_fp8(raw: dict, source: str) -> Fp8Scheme:
    if raw.get("activation_scheme") != "dynamic":
        raise _error(source, ".activation_scheme", f"is {raw.get('activation_scheme')!r} (quant_method 'fp8'); "
                     "supported: 'dynamic' (static activation scales are not)")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise _error(source, ".fmt", f"is {raw.get('fmt')!r}; supported: 'e4m3'")
    block = raw.get("weight_block_size")
    if block != [BLOCK_SIZE, BLOCK_SIZE]:
        raise _error(source, ".weight_block_size", f"is {block!r} (quant_method 'fp8'); supported: "
                     f"[{BLOCK_SIZE}, {BLOCK_SIZE}] (per-tensor 'fp8' checkpoints are not)")
    ignore = _names(raw, "modules_to_not_convert", source) + _names(raw, "ignored_layers", source)
    return Fp8Scheme("fp8", WeightStrategy.BLOCK, ignore + ("lm_head",))


def _expect(table: dict, source: str, where: str, **wanted: Any) -> None:
    for key, value in wanted.items():
        if table.get(key) != value:
            raise _error(source, f"{where}.{key}", f"is {table.get(key)!r}; supported: {value!r}")


def _names(raw: dict, key: str, source: str) -> tuple[str, ...]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _error(source, f".{key}", f"is {value!r}, expected a list of module names")
    return tuple(value)
