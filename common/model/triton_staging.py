"""Triton gather and scatter of a room's rows (issue 17): one launch each, byte-exact.

Both take the row views of ``staging_copy.rows_view`` (integers, [rows, row_elems], contiguous)
and an int64 row index: staging row j is buffer row ``index[j]``. Program (j, b) copies elements
``[b * block, + block)`` of row j (block: ``BLOCK``, or the row rounded up to a power of 2). A row length that is a multiple of 16 elements lets Triton
specialise the kernel and issue 16-byte loads and stores. Compared against the torch reference
on random page tables in ``tests/gpu/test_triton_staging.py``; tuned on the GPU (BLOCK, warps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements per program at most: 8 KiB of int64 (shorter rows: the row, rounded up to a power of 2)


@triton.jit
def _gather_kernel(buffer, staging, index, row_elems, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < row_elems
    row = tl.load(index + j)
    x = tl.load(buffer + row * row_elems + cols, mask=mask)
    tl.store(staging + j * row_elems + cols, x, mask=mask)


@triton.jit
def _scatter_kernel(staging, buffer, index, row_elems, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < row_elems
    row = tl.load(index + j)
    x = tl.load(staging + j * row_elems + cols, mask=mask)
    tl.store(buffer + row * row_elems + cols, x, mask=mask)


def _launch(kernel, src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor, row_elems: int) -> None:
    block = min(BLOCK, triton.next_power_of_2(row_elems))
    kernel[(index.numel(), triton.cdiv(row_elems, block))](src, dst, index, row_elems, BLOCK=block)


def _check(buffer_rows: torch.Tensor, staging_rows: torch.Tensor, index: torch.Tensor) -> None:
    if buffer_rows.dtype != staging_rows.dtype or buffer_rows.shape[1] != staging_rows.shape[1]:
        raise ValueError(f"row views differ: buffer {buffer_rows.dtype} {tuple(buffer_rows.shape)}, "
                         f"staging {staging_rows.dtype} {tuple(staging_rows.shape)}")
    if index.dtype != torch.int64 or index.numel() != staging_rows.shape[0]:
        raise ValueError(f"index must be int64 with one entry per staging row ({staging_rows.shape[0]}), "
                         f"got {index.dtype} [{index.numel()}]")


def gather_rows(buffer_rows: torch.Tensor, staging_rows: torch.Tensor, index: torch.Tensor) -> None:
    """staging_rows[j] = buffer_rows[index[j]]; buffer_rows, staging_rows: [*, row_elems]."""
    _check(buffer_rows, staging_rows, index)
    if index.numel():
        _launch(_gather_kernel, buffer_rows, staging_rows, index, buffer_rows.shape[1])


def scatter_rows(staging_rows: torch.Tensor, buffer_rows: torch.Tensor, index: torch.Tensor) -> None:
    """buffer_rows[index[j]] = staging_rows[j]; the rows ``index`` names must be distinct."""
    _check(buffer_rows, staging_rows, index)
    if index.numel():
        _launch(_scatter_kernel, staging_rows, buffer_rows, index, buffer_rows.shape[1])
