"""Sums of fp32 partial results that several programs of a GEMV wrote: split-K parts, or a MoE
token's k slots. Two ways, the same arithmetic bit for bit:

- ``sum_parts`` (and ``slot_sum``): a launch of its own, after the kernel that wrote the parts;
- in that kernel, by the last of a group's programs to finish (``last_of``: an atomic count,
  acquire-release at GPU scope, that the last program sets back to 0), which then adds the
  group's parts in part order (``sum_in_order``) where the launch would have. One launch fewer;
  the counts live in ``counters(device)``, zero between launches.

The parts are added in part order whichever program finishes last, so the result does not depend
on the schedule. The reference is the same sum as a sequence of torch ops
(``tests/gpu/test_triton_gemv.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvferry.common.kernels.pdl import enter as pdl_enter, kw as pdl_kw
from kvferry.common.kernels.quant_rows import SplitParts


@triton.jit
def last_of(counters, group, count):
    """Whether this program is the last of the ``count`` programs of ``group`` to get here: an atomic
    count (acquire-release, GPU scope) after a barrier, so that every thread's stores of the program
    come before it and the last program's loads after it. The last sets the count back to 0 for the
    next launch (``counters`` starts it at 0)."""
    tl.debug_barrier()
    done = tl.atomic_add(counters + group, 1, sem="acq_rel", scope="gpu")
    is_last = done == count - 1
    if is_last:
        tl.store(counters + group, 0)
    return is_last


@triton.jit
def sum_in_order(parts, offs, stride_part, NUM_PARTS: tl.constexpr, mask):
    """fp32 ``parts[offs] + parts[stride_part + offs] + ...`` over NUM_PARTS parts, added in part
    order; loaded from L2 (other programs stored them), unrolled so that the loads go out together."""
    acc = tl.load(parts + offs, mask=mask, other=0.0, cache_modifier=".cg")
    for p in tl.static_range(1, NUM_PARTS):
        acc += tl.load(parts + p * stride_part + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown counts: a captured graph may still hold their address


def counters(device: torch.device, groups: int) -> torch.Tensor:
    """The device's int32 counts for ``last_of``, at least ``groups`` of them, all 0 between launches
    (each launch's last programs set theirs back). Kernels of one stream run one after another, so
    they share them. Allocated once per device (4,096: more than a decode step's GEMVs use); a bigger
    launch gets a bigger buffer, and the old one is kept for graphs captured with it."""
    device = torch.device(device)
    held = _COUNTERS.get(device)
    if held is None or held.numel() < groups:
        if held is not None:
            _RETIRED.append(held)
        held = _COUNTERS[device] = torch.zeros(max(groups, 4096), dtype=torch.int32, device=device)
    return held


@triton.jit
def _sum_parts_kernel(parts, bias, extra, out, TOTAL, N, stride_row, stride_part, SPLIT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_EXTRA: tl.constexpr, PACKED: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = 0):
    """out.flat[i] (row r = i // N, column c = i % N) = round(sum_p parts[r * stride_row + p * stride_part + c]
    (+ bias[c])), fp32 parts added in part order; HAS_EXTRA: then + extra.flat[i], rounded again (as
    torch adds two tensors of out's dtype). Split-K parts [SPLIT, M, N]: stride_row N, stride_part
    M * N; a MoE token's k slots [T, k, N]: stride_row k * N, stride_part N. PACKED: stride_row is N
    (no division by N)."""
    pdl_enter(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < TOTAL
    if PACKED:
        base = parts + i
    else:
        base = parts + (i // N) * stride_row + i % N
    acc = tl.load(base, mask=ok, other=0.0)
    for p in tl.static_range(1, SPLIT):
        acc += tl.load(base + p * stride_part, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + i % N, mask=ok, other=0.0).to(tl.float32)
    r = acc.to(out.dtype.element_ty)
    if HAS_EXTRA:
        r = (r.to(tl.float32) + tl.load(extra + i, mask=ok, other=0.0).to(tl.float32)).to(out.dtype.element_ty)
    tl.store(out + i, r, mask=ok)


def sum_parts(parts: torch.Tensor, num_parts: int, stride_row: int, stride_part: int, out: torch.Tensor,
              bias: torch.Tensor | None = None, extra: torch.Tensor | None = None) -> torch.Tensor:
    """``_sum_parts_kernel`` into ``out`` [M, N] (contiguous) from fp32 ``parts``."""
    total, n = out.numel(), out.shape[-1]
    if total:
        _sum_parts_kernel[(triton.cdiv(total, 1024),)](
            parts, bias if bias is not None else out, extra if extra is not None else out, out, total, n, stride_row,
            stride_part, SPLIT=num_parts, HAS_BIAS=bias is not None, HAS_EXTRA=extra is not None,
            PACKED=stride_row == n, BLOCK=1024, num_warps=4, **pdl_kw())
    return out


def slot_sum(down: torch.Tensor, top_k: int, dtype: torch.dtype, extra: torch.Tensor | None = None,
             defer: bool = False) -> torch.Tensor | SplitParts:
    """A MoE block's weighted slots [T * k, H] fp32 -> [T, H] in ``dtype``: each token's k slots
    summed in slot order, rounded (+ ``extra`` [T, H], e.g. the shared experts', rounded again), one
    launch where torch's sum and cast were two. ``defer`` (no extra): no launch; the slots as they
    are (``SplitParts.of_slots``), for the next norm's launch to add (``triton_fused.add_rms_norm``)."""
    if defer and extra is None:
        return SplitParts.of_slots(down, top_k, dtype)
    num_tokens = down.shape[0] // top_k
    out = torch.empty(num_tokens, down.shape[1], dtype=dtype, device=down.device)
    if extra is not None and not extra.is_contiguous():
        extra = extra.contiguous()
    return sum_parts(down, top_k, top_k * down.shape[1], down.shape[1], out, extra=extra)
