"""Triton gather and scatter of a room's rows (issue 17): one launch each, byte-exact.

Both take the row views of ``staging_copy.rows_view`` (integers, [rows, row_elems], contiguous)
and an int64 row index: staging row j is buffer row ``index[j]``. The grid is flat: program p
copies span ``p % spans_per_row`` of staging row ``p // spans_per_row`` (so neighbouring programs
stream neighbouring bytes of one row, and no grid axis limits the number of rows); a span is
``TILES`` tiles of ``BLOCK`` elements, copied one after another. A 2 MiB row (262,144 int64) is then
a few programs of tens of KiB each, not 256 programs of 8 KiB. When the span divides the row the
copies go unmasked; a row length that is a multiple of 16 elements lets Triton specialise the kernel
and issue 16-byte loads and stores. ``KernelConfig`` (block, warps, tiles) is the tuning knob
(``bench/staging.py --triton-block`` sweeps it on the GPU). Compared against the torch reference on
random page tables in ``tests/gpu/test_triton_staging.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class KernelConfig:
    # the H200 sweep (bench/RESULTS.md, staging on one H200): for 2 MiB rows every configuration tried
    # came within 6 % of the best, which this one was at 1,024 pages (one 128 KiB tile of int64 a program)
    block: int = 16384  # elements per tile at most (a shorter row: the row, rounded up to a power of 2)
    warps: int = 16
    tiles: int = 1      # tiles per program: a span of block * tiles elements

    @classmethod
    def parse(cls, text: str) -> KernelConfig:
        """``"BLOCKxWARPS"`` or ``"BLOCKxWARPSxTILES"``, e.g. ``4096x8x4``."""
        parts = [int(p) for p in text.lower().split("x")]
        if not 2 <= len(parts) <= 3 or any(p <= 0 for p in parts) or parts[0] & (parts[0] - 1):
            raise ValueError(f"kernel config {text!r}: expected BLOCKxWARPS[xTILES], BLOCK a power of 2")
        return cls(*parts)

    def __str__(self) -> str:
        return f"{self.block}x{self.warps}x{self.tiles}"


CONFIG = KernelConfig()  # the default; bench/staging.py sets the one its sweep found best


@triton.jit
def _copy_kernel(src, dst, index, row_elems, spans_per_row, GATHER: tl.constexpr, BLOCK: tl.constexpr,
                 TILES: tl.constexpr, EVEN: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    j = pid // spans_per_row
    start = (pid % spans_per_row) * (BLOCK * TILES)
    row = tl.load(index + j)
    if GATHER:  # staging row j <- buffer row index[j]
        src_row = src + row * row_elems
        dst_row = dst + j * row_elems
    else:       # buffer row index[j] <- staging row j
        src_row = src + j * row_elems
        dst_row = dst + row * row_elems
    for t in tl.static_range(TILES):
        cols = start + t * BLOCK + tl.arange(0, BLOCK)
        if EVEN:
            tl.store(dst_row + cols, tl.load(src_row + cols))
        else:
            mask = cols < row_elems
            tl.store(dst_row + cols, tl.load(src_row + cols, mask=mask), mask=mask)


def _launch(src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor, row_elems: int, gather: bool,
            config: KernelConfig | None) -> None:
    config = config or CONFIG
    block = min(config.block, triton.next_power_of_2(row_elems))
    tiles = min(config.tiles, triton.cdiv(row_elems, block))
    spans = triton.cdiv(row_elems, block * tiles)
    _copy_kernel[(index.numel() * spans,)](src, dst, index, row_elems, spans, GATHER=gather, BLOCK=block,
                                           TILES=tiles, EVEN=row_elems % (block * tiles) == 0,
                                           num_warps=config.warps)


def _check(buffer_rows: torch.Tensor, staging_rows: torch.Tensor, index: torch.Tensor) -> None:
    if buffer_rows.dtype != staging_rows.dtype or buffer_rows.shape[1] != staging_rows.shape[1]:
        raise ValueError(f"row views differ: buffer {buffer_rows.dtype} {tuple(buffer_rows.shape)}, "
                         f"staging {staging_rows.dtype} {tuple(staging_rows.shape)}")
    if index.dtype != torch.int64 or index.numel() != staging_rows.shape[0]:
        raise ValueError(f"index must be int64 with one entry per staging row ({staging_rows.shape[0]}), "
                         f"got {index.dtype} [{index.numel()}]")


def gather_rows(buffer_rows: torch.Tensor, staging_rows: torch.Tensor, index: torch.Tensor,
                config: KernelConfig | None = None) -> None:
    """staging_rows[j] = buffer_rows[index[j]]; buffer_rows, staging_rows: [*, row_elems]."""
    _check(buffer_rows, staging_rows, index)
    if index.numel():
        _launch(buffer_rows, staging_rows, index, buffer_rows.shape[1], True, config)


def scatter_rows(staging_rows: torch.Tensor, buffer_rows: torch.Tensor, index: torch.Tensor,
                 config: KernelConfig | None = None) -> None:
    """buffer_rows[index[j]] = staging_rows[j]; the rows ``index`` names must be distinct."""
    _check(buffer_rows, staging_rows, index)
    if index.numel():
        _launch(staging_rows, buffer_rows, index, buffer_rows.shape[1], False, config)
