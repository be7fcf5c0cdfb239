"""Activation rows that come quantized per token, for the W8A8 linear that reads them.

``triton_fused.add_rms_norm`` and ``silu_mul`` with ``quant`` make their output rows and, in the
same launch, their per-token e4m3 quantization (``amax / 448`` a row, bit for bit as
``triton_fp8_gemm.per_token_quant``); ``common/layers/fp8.fp8_linear`` then runs no quant kernel
of its own. Plain torch: importable without Triton.
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
