"""FP8 (e4m3) KV quantization, the torch reference of what the store and attention kernels do.

A pool of ``torch.float8_e4m3fn`` holds each layer's K (and V) divided by a per-tensor scale ``s``
(``KvCache.k_scales[layer]``, ``v_scales[layer]``)::

    stored = saturate(x * (1 / s))     # fp32 product, clamped to +-448, rounded to e4m3 (nearest even)
    read   = (stored * s).to(dtype)    # fp32 product, then the model dtype

``x / s`` is computed as ``x * fp32(1 / s)`` everywhere (torch on CPU and CUDA, the Triton kernels
and its interpreter), so that every path rounds the same way.

Every path that attends (the torch gather, the Triton kernels, the dense prefill over the new K/V)
sees ``read``: prefill, chunked prefill, extend over cached pages and decode agree on the values.
A pool of the model dtype is stored and read as it is (the scales are 1.0 and never applied).
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn; torch's cast of a larger value is not saturating
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # --kv-cache-dtype; auto = the model dtype
_TORCH_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}


def pool_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a pool for ``--kv-cache-dtype`` (auto: the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _TORCH_DTYPES:
        raise ValueError(f"kv_cache_dtype is {kv_cache_dtype!r}, expected one of {KV_CACHE_DTYPES}")
    return _TORCH_DTYPES[kv_cache_dtype]


def is_quantized(cache_dtype: torch.dtype) -> bool:
    """True for a pool that stores scaled FP8 (quantize on store, dequantize on read)."""
    return cache_dtype == torch.float8_e4m3fn


def quantize(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x (any float dtype) -> what the pool stores: ``saturate(x / scale)`` in ``cache_dtype``."""
    if not is_quantized(cache_dtype):
        return x.to(cache_dtype)
    return (x.float() * (1.0 / scale)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_dtype)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What the pool holds -> the values attention sees, in ``dtype``."""
    if not is_quantized(stored.dtype):
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype)


def round_trip(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a read of the pool would give it back (x itself for an unquantized pool)."""
    if not is_quantized(cache_dtype):
        return x
    return dequantize(quantize(x, scale, cache_dtype), scale, x.dtype)
