"""Gather a room's runs into a staging slot and scatter them back out (issue 17): the torch
reference, and the entry points that pick the Triton kernels (``triton_staging.py``) on CUDA.

The geometry is a ``kvferry.common.plan.staging.CopyPlan``: the buffer holding the runs (a KV pool's
``buffer``, any dtype, contiguous) is seen as rows of ``row_nbytes`` bytes of ``elem_nbytes``-wide
integers, and run i is ``rows_per_run`` consecutive rows from row ``plan.rows[i]``::

    buffer rows  [num_rows, row_elems]        staging rows [num_runs * rows_per_run, row_elems]
    gather:  staging_rows[j] = buffer_rows[index[j]]      (index = plan.row_index())
    scatter: buffer_rows[index[j]] = staging_rows[j]

Rows never overlap (the runs of one room are distinct pages), so the scatter has no write conflicts
and touches nothing outside the runs. Integer rows copy bytes exactly whatever the pool's dtype.

``gather_convert`` gathers a room whose decode holds another KV dtype (``common/plan/convert.py``):
the runs are gathered as they are into a temporary, then each member region's items are quantised
with that region's scale (``to_e4m3``: ``kv_quant.quantize``'s rounding, every FP8 K/V store's)
into the slot.
"""

from __future__ import annotations

import functools
import logging

import torch

from kvferry.common.kernels.kv_quant import FP8_E4M3_MAX
from kvferry.common.plan.staging import CopyPlan

logger = logging.getLogger(__name__)

_INT_OF_NBYTES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def pool_holding(pools, addrs, nbytes: int) -> torch.Tensor | None:
    """The tensor of ``pools`` whose bytes hold every run of ``nbytes`` at ``addrs``, or None."""
    lo, hi = int(addrs.min()), int(addrs.max()) + nbytes
    for pool in pools:
        start = pool.data_ptr()
        if start <= lo and hi <= start + pool.numel() * pool.element_size():
            return pool
    return None


def rows_view(t: torch.Tensor, plan: CopyPlan) -> torch.Tensor:
    """A contiguous tensor's bytes as [whole rows, row_nbytes / elem_nbytes] integers (a view)."""
    if not t.is_contiguous():
        raise ValueError(f"staging copies need a contiguous tensor, got strides {t.stride()}")
    flat = t.reshape(-1).view(torch.uint8)
    num_rows = flat.numel() // plan.row_nbytes
    return flat[: num_rows * plan.row_nbytes].view(_INT_OF_NBYTES[plan.elem_nbytes]).view(
        num_rows, plan.row_nbytes // plan.elem_nbytes)


def row_index(plan: CopyPlan, device: torch.device | str) -> torch.Tensor:
    """int64 [num_runs * rows_per_run] on ``device``: build it once per room, before the copy."""
    return torch.from_numpy(plan.row_index()).to(device)


def _staging_rows(staging: torch.Tensor, plan: CopyPlan) -> torch.Tensor:
    nbytes = plan.num_runs * plan.run_nbytes
    flat = staging.reshape(-1).view(torch.uint8)
    if flat.numel() < nbytes:
        raise ValueError(f"a staging slot of {flat.numel()} bytes cannot hold {plan.num_runs} runs of {plan.run_nbytes}")
    return rows_view(flat[:nbytes], plan)


def _buffer_rows(buffer: torch.Tensor, plan: CopyPlan) -> torch.Tensor:
    if buffer.data_ptr() != plan.base_addr:
        raise ValueError(f"the copy plan is for a buffer at {plan.base_addr:#x}, this one starts at {buffer.data_ptr():#x}")
    return rows_view(buffer, plan)


def gather_reference(buffer: torch.Tensor, staging: torch.Tensor, plan: CopyPlan, index: torch.Tensor) -> None:
    """staging[i * run_nbytes: (i + 1) * run_nbytes] = run i of ``buffer`` (torch ``index_select``)."""
    torch.index_select(_buffer_rows(buffer, plan), 0, index, out=_staging_rows(staging, plan))


def scatter_reference(staging: torch.Tensor, buffer: torch.Tensor, plan: CopyPlan, index: torch.Tensor) -> None:
    """Run i of ``buffer`` = staging[i * run_nbytes: (i + 1) * run_nbytes] (torch ``index_copy_``)."""
    _buffer_rows(buffer, plan).index_copy_(0, index, _staging_rows(staging, plan))


def inverse_scales(scales, device) -> torch.Tensor:
    """fp32 ``1 / scale`` of each scale, the reciprocal taken in float64 as ``kv_quant.quantize``
    takes it (a Python float), so that a converted room rounds exactly as the decode's own store."""
    return (1.0 / torch.tensor(scales, dtype=torch.float64)).to(device=device, dtype=torch.float32)


def to_e4m3(x: torch.Tensor, inv_scale: torch.Tensor | float) -> torch.Tensor:
    """float8_e4m3fn of ``x * inv_scale`` in fp32, saturated to ±448 (e4m3 has no infinity: a cast
    of a larger value would give NaN): ``kv_quant.quantize``, every FP8 K/V store's rounding, with
    the reciprocal of the scale given (one per member region, broadcast)."""
    return (x.float() * inv_scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def gather_convert(buffer: torch.Tensor, staging: torch.Tensor, plan: CopyPlan, index: torch.Tensor, *,
                   src_dtype: torch.dtype, inv_scales: torch.Tensor) -> None:
    """Gather ``plan``'s runs of ``buffer`` (elements of ``src_dtype``) and write them into
    ``staging`` as e4m3, run after run: run i of ``plan.run_nbytes`` source bytes becomes
    ``plan.run_nbytes / elem`` bytes. A run holds ``len(inv_scales)`` equal member items in turn,
    member j quantised with ``inv_scales[j]`` (``inverse_scales``, on the buffer's device)."""
    elem = torch.empty(0, dtype=src_dtype).element_size()
    gathered = torch.empty(plan.num_runs * plan.run_nbytes, dtype=torch.uint8, device=buffer.device)
    gather(buffer, gathered, plan, index)
    values = gathered.view(src_dtype).view(plan.num_runs, len(inv_scales), -1)
    out_nbytes = plan.num_runs * plan.run_nbytes // elem
    flat = staging.reshape(-1).view(torch.uint8)
    if flat.numel() < out_nbytes:
        raise ValueError(f"a staging slot of {flat.numel()} bytes cannot hold {plan.num_runs} converted runs "
                         f"of {plan.run_nbytes // elem} bytes")
    flat[:out_nbytes].view(torch.float8_e4m3fn).view_as(values).copy_(to_e4m3(values, inv_scales.view(1, -1, 1)))


@functools.cache
def _kernels():
    """``triton_staging`` on CUDA when Triton imports; None otherwise (the torch reference runs)."""
    try:
        from kvferry.common.kernels import triton_staging  # import triton only on this path
    except ImportError as exc:
        logger.warning("Triton is not importable (%s): staging copies use torch index ops", exc)
        return None
    return triton_staging


def gather(buffer: torch.Tensor, staging: torch.Tensor, plan: CopyPlan, index: torch.Tensor) -> None:
    """Gather on the buffer's device: the Triton kernel on CUDA, the torch reference elsewhere."""
    kernels = _kernels() if buffer.is_cuda else None
    if kernels is None:
        gather_reference(buffer, staging, plan, index)
    else:
        kernels.gather_rows(_buffer_rows(buffer, plan), _staging_rows(staging, plan), index)


def scatter(staging: torch.Tensor, buffer: torch.Tensor, plan: CopyPlan, index: torch.Tensor) -> None:
    """Scatter on the buffer's device: the Triton kernel on CUDA, the torch reference elsewhere. (The
    issue measured ``index_copy_`` at 2.8x the gather; on the H200 run of aa4f24f, 2 MiB rows, kernel and
    ``index_copy_`` are within 10 % of each other and of a memcpy: bench/RESULTS.md.)"""
    kernels = _kernels() if buffer.is_cuda else None
    if kernels is None:
        scatter_reference(staging, buffer, plan, index)
    else:
        kernels.scatter_rows(_staging_rows(staging, plan), _buffer_rows(buffer, plan), index)
