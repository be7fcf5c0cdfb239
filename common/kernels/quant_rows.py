"""Activation rows in a form that only their one consumer's kernel takes.

``TokenQuantized``: rows that come quantized per token, for the W8A8 linear that reads them.

``triton_fused.add_rms_norm`` and ``silu_mul`` with ``quant`` make their output rows and, in the
same launch, their per-token e4m3 quantization (``amax / 448`` a row, bit for bit as
``triton_fp8_gemm.per_token_quant``); ``common/layers/fp8.fp8_linear`` then runs no quant kernel
of its own.

``SplitParts``: a split-K GEMV's output not yet added up (``triton_gemv.fp8_gemv`` with
``defer_sum``), or a MoE block's weighted slot rows (``triton_moe.fused_moe`` with ``defer_sum``),
for the residual add that reads it: ``triton_fused.add_rms_norm`` adds the parts in its own launch,
so the second launch (``split_sum.sum_parts`` / ``slot_sum``) goes away.

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
    """A linear's output [M, N]: the sum of the fp32 split-K ``parts`` [S, M, N] in part order,
    rounded to ``dtype`` (as ``split_sum.sum_parts`` adds them; a MoE block's k slots of each token
    as ``slot_sum`` adds them, a [k, T, N] view of its [T * k, N] rows). Any strides but a unit one
    along N. ``triton_fused.add_rms_norm`` takes it as its ``delta``; ``total()`` is the same sum by
    torch ops, for any other consumer."""

    parts: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    @classmethod
    def of_slots(cls, rows: torch.Tensor, slots: int, dtype: torch.dtype) -> "SplitParts":
        """A MoE block's output from its weighted fp32 slot rows [T * slots, N] (a token's slots one
        after another): part j is every token's slot j."""
        return cls(rows.view(-1, slots, rows.shape[-1]).transpose(0, 1), dtype)

    def total(self) -> torch.Tensor:
        acc = self.parts[0].clone()
        for part in self.parts[1:]:
            acc += part
        return acc.to(self.dtype)

    def index_select(self, dim: int, index: torch.Tensor) -> "SplitParts":
        """The rows ``index`` (``dim`` 0 only), still as parts."""
        if dim != 0:
            raise ValueError(f"SplitParts.index_select: rows (dim 0) only, got dim {dim}")
        return SplitParts(self.parts.index_select(1, index), self.dtype)
