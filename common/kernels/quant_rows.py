"""Activation rows handed from one kernel to the next in a form the next one finishes.

- ``TokenQuantized``: ``triton_fused.add_rms_norm`` and ``silu_mul`` with ``quant`` make their
  output rows and, in the same launch, their per-token e4m3 quantization (``amax / 448`` a row, bit
  for bit as ``triton_fp8_gemm.per_token_quant``); ``common/layers/fp8.fp8_linear`` then runs no
  quant kernel of its own.
- ``SplitParts``: a K-split GEMV's fp32 parts not yet summed (``triton_gemv.fp8_gemv`` with
  ``defer_sum``); the residual add and RMSNorm that reads the linear's output
  (``triton_fused.add_rms_norm``) sums them in its own launch, so the split-K sum needs none.
- ``GatedRows``: a fused gate-up's one row whose ``silu(gate) * up`` the one-row FP8 GEMV of the
  down projection makes as it reads it (``triton_gemv.fp8_gemv`` with ``fuse_silu``), so the silu
  kernel does not run.

Plain torch: importable without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenQuantized:
    """Rows [T, K] in the model dtype with their per-token quantization: e4m3 ``q`` [T, K] and fp32
    ``scale`` [T, 1]. ``fp8_linear`` takes either part; any other consumer takes ``rows``."""

    rows: torch.Tensor
    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.rows.shape


@dataclass(frozen=True)
class SplitParts:
    """A linear's output [M, N] as its K-split parts: fp32 ``parts`` [S, M, N], summed in part order,
    plus ``bias`` (or None), rounded to ``dtype``. ``triton_fused.add_rms_norm`` takes it as its
    delta; any other consumer calls ``total()`` (torch ops adding in ``triton_gemv.sum_parts``'s order:
    the same fp32 adds, so the same bits)."""

    parts: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    def total(self) -> torch.Tensor:
        acc = self.parts[0].clone()
        for part in self.parts[1:]:
            acc += part
        if self.bias is not None:
            acc += self.bias.float()
        return acc.to(self.dtype)


@dataclass(frozen=True)
class GatedRows:
    """``gate_up`` [1, 2I] (gate then up) standing for silu(gate) * up [1, I]: only
    ``fp8.fp8_linear`` takes it, and only where ``fp8.gated_rows`` made it (the one-row GEMV)."""

    gate_up: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.gate_up.shape[0], self.gate_up.shape[1] // 2))
