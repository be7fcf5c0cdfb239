"""Rotary position embedding, computed the way transformers computes it (fp32 angles, then cast).

Scalings: linear, llama3 (Llama 3.1) and yarn (DeepSeek: ``yarn_inv_frequencies``, with the cos/sin
factor ``attention_factor`` and the softmax-scale factor ``yarn_softmax_scale``)."""

from __future__ import annotations

import math

import torch

from kvferry.common.models.config import ModelConfig


def inv_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies, [head_dim / 2] fp32 on CPU, with linear or llama3 scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return yarn_inv_frequencies(config)
    # Llama 3.1: keep high frequencies, divide low ones by factor, blend the band between.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's Eq. 21, ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_frequencies(config: ModelConfig) -> torch.Tensor:
    """YaRN: extrapolated (original) frequencies on the fast dims, interpolated (/ factor) on the
    slow ones, a linear ramp between the correction dims of ``beta_fast``/``beta_slow`` rotations."""
    s, dim, base = config.rope_scaling, config.head_dim, config.rope_theta

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: 1 except under yarn (its ``attention_factor``, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim), else mscale(factor))."""
    s = config.rope_scaling
    if s is None or s.rope_type != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    return _yarn_mscale(s.factor)


def yarn_softmax_scale(config: ModelConfig, scale: float) -> float:
    """DeepSeek's softmax scale: ``scale * mscale(factor, mscale_all_dim) ** 2`` under a scaled rope
    with ``mscale_all_dim``, else ``scale`` (transformers' ``yarn_apply_mscale``)."""
    s = config.rope_scaling
    if s is None or not s.mscale_all_dim:
        return scale
    return scale * _yarn_mscale(s.factor, s.mscale_all_dim) ** 2


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, factor: float = 1.0,
            dup: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int64 -> cos, sin: [T, 1, head_dim] in ``dtype`` (broadcast over heads): each
    row's head_dim / 2 frequencies twice (``dup``; False: once, [T, 1, head_dim / 2], as MLA's rope
    part takes them), times ``factor`` (yarn's attention factor) in fp32 before the rounding. The
    torch backend's ``cos_sin`` and the reference of ``triton_fused.cos_sin``."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1) if dup else freqs
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; rotates pairs (i, i + D/2), as transformers' rotate_half does."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
