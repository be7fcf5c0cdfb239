"""FP8 variants of the generated checkpoints (``kvferry make-tiny-model --quantize``).

The decoder's linear weights (q/k/v/o, gate/up/down) are quantized from the preset's generated
weights; embeddings, norms and ``lm_head`` stay in the preset's dtype. Two formats, the two that
``quant_config.py`` loads:

- ``fp8-channel``: compressed-tensors "float-quantized", e4m3 ``weight`` with one fp32
  ``weight_scale`` per output row ([out, 1]), dynamic per-token activations, ``ignore: ["lm_head"]``
  (what llm-compressor's FP8_DYNAMIC writes);
- ``fp8-block``: ``quant_method: "fp8"`` with 128 x 128 blocks, e4m3 ``weight`` and fp32
  ``weight_scale_inv`` [ceil(out/128), ceil(in/128)] (what Qwen3-FP8 ships); dims that are not a
  multiple of 128 (the tiny preset's 64-row k/v) end in a ragged block, as real checkpoints allow.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvferry.common.layers.fp8 import quantize_blocks, quantize_rows
from kvferry.common.models.quant_config import BLOCK_SIZE

QUANTIZE_CHOICES = ("fp8-channel", "fp8-block")
_LINEARS = tuple(f"{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))

Spec = tuple[str, tuple[int, ...]]


def check_quantize(kind: str | None) -> None:
    if kind is not None and kind not in QUANTIZE_CHOICES:
        raise ValueError(f"--quantize is {kind!r}; choices: {', '.join(QUANTIZE_CHOICES)}")


def quantization_config(kind: str) -> dict:
    """config.json's ``quantization_config`` for ``kind``."""
    if kind == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK_SIZE, BLOCK_SIZE]}
    float8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None,
              "actorder": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**float8, "strategy": "channel", "dynamic": False, "observer": "minmax"},
            "input_activations": {**float8, "strategy": "token", "dynamic": True, "observer": None},
            "output_activations": None,
        }},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def _scale_name(kind: str, name: str) -> str:
    return name + ("_scale_inv" if kind == "fp8-block" else "_scale")


def _scale_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    out_features, in_features = shape
    if kind == "fp8-block":
        return (-(-out_features // BLOCK_SIZE), -(-in_features // BLOCK_SIZE))
    return (out_features, 1)


def quantized_specs(specs: list[Spec], kind: str) -> list[Spec]:
    """``specs`` with each decoder linear followed by its scale tensor."""
    out = []
    for name, shape in specs:
        out.append((name, shape))
        if name.endswith(_LINEARS):
            out.append((_scale_name(kind, name), _scale_shape(kind, shape)))
    return out


def element_bytes(name: str, dtype_bytes: int, kind: str | None) -> int:
    """Bytes per element of tensor ``name`` in a checkpoint of ``dtype_bytes`` elements, quantized
    as ``kind`` (None: not at all)."""
    if kind is None:
        return dtype_bytes
    if name.endswith(_LINEARS):
        return 1
    return 4 if name.endswith(("_scale", "_scale_inv")) else dtype_bytes


def quantize_stream(specs: list[Spec], tensors: Iterator[torch.Tensor], kind: str) -> Iterator[torch.Tensor]:
    """The tensors of ``quantized_specs(specs, kind)``, one at a time, from the unquantized stream."""
    for name, _ in specs:
        tensor = next(tensors)
        if not name.endswith(_LINEARS):
            yield tensor
            continue
        weight, scale = quantize_blocks(tensor, BLOCK_SIZE) if kind == "fp8-block" else quantize_rows(tensor)
        yield weight
        yield scale if kind == "fp8-block" else scale[:, None].contiguous()
