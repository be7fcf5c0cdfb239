"""Activation rows that come in another form than one tensor, for the kernel that reads them.

- ``TokenQuantized``: ``triton_fused.add_rms_norm`` and ``silu_mul`` with ``quant`` make their
  output rows and, in the same launch, their per-token e4m3 quantization (``amax / 448`` a row, bit
  for bit as ``triton_fp8_gemm.per_token_quant``); ``common/layers/fp8.fp8_linear`` then runs no
  quant kernel of its own.
- ``SlotParts``: a MoE block's output before its slot sum (``triton_moe.fused_moe`` with
  ``defer``); the next residual add (``triton_fused.add_rms_norm``) sums the slots in its own
  launch, so the block runs no ``slot_sum`` launch.

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
class SlotParts:
    """A MoE block's output [T, H] as its weighted fp32 slots ``parts`` [T * top_k, H] (token t's
    slots at rows t * top_k ..., in slot order), not yet summed: the sum is ``total()``, each token's
    slots added in slot order in fp32, rounded to ``dtype`` (+ ``extra`` [T, H], e.g. the shared
    experts', rounded again), as ``triton_gemv.slot_sum``."""

    parts: torch.Tensor
    top_k: int
    dtype: torch.dtype
    extra: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.parts.shape[0] // self.top_k, self.parts.shape[1]))

    def index_select(self, dim: int, index: torch.Tensor) -> SlotParts:
        """The rows ``index`` of the sum (dim 0 only), still as slots."""
        if dim != 0:
            raise ValueError(f"SlotParts.index_select selects rows (dim 0), got dim {dim}")
        slots = self.parts.view(-1, self.top_k, self.parts.shape[1]).index_select(0, index)
        extra = None if self.extra is None else self.extra.index_select(0, index)
        return SlotParts(slots.reshape(-1, self.parts.shape[1]), self.top_k, self.dtype, extra)

    def total(self) -> torch.Tensor:
        """The sum [T, H] in ``dtype`` (torch ops, in the kernels' order: the same bits)."""
        slots = self.parts.view(-1, self.top_k, self.parts.shape[1])
        acc = slots[:, 0].clone()
        for s in range(1, self.top_k):
            acc += slots[:, s]
        out = acc.to(self.dtype)
        return out if self.extra is None else out + self.extra
