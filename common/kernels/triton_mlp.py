"""An FP8 MLP's gate-up projection with its activation, for the W8A8 decode rows (17-64).

The unfused MLP of a W8A8 decode step runs the gate-up GEMV (``triton_gemv.fp8_gemv``, bf16
[T, 2I] out), then ``triton_fused.silu_mul`` with ``quant``: one program a row computes
silu(gate) * up and its per-token quant for the down projection. At 64 rows of Llama-3-8B that
program is 64 programs wide over 132 SMs and takes 6.6 µs a layer (bench/RESULTS.md).

``gate_up_silu_quant`` does the same work in two launches that spread over the GPU:
- ``_gate_up_silu_kernel``: each program takes BLOCK_N columns of the gate *and* the same
  columns of the up (weight rows c and I + c), so its epilogue has both halves: it rounds them to
  the model dtype as the GEMV's output is rounded, writes silu(gate) * up (rounded as ``silu_mul``
  rounds) and the largest |value| of each row over its columns (one fp32 a row and program);
- ``_quant_parts_kernel``: a program per (row, column block) takes the row's largest |value| over
  every program's part (max is exact, so it is the row's amax), then quantizes its block with the
  row's scale (``amax / 448``) as ``per_token_quant`` does.
The result is ``silu_mul(fp8_gemv(...), quant=True)`` bit for bit: the same dots over K in the
same BLOCK_K steps, the same roundings (``tests/gpu/test_triton_mlp.py``). So it ``takes`` only a
gate-up that the GEMV's tiles run with K whole (every gate-up wider than 4,096 rows): a split K
is summed in parts, in another order. The reference is that
composition, and ``fp8.reference_linear`` then ``F.silu`` beyond it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvferry.common.kernels.gemv_tiles import fitted_tiles, fp8_config
from kvferry.common.kernels.pdl import enter as pdl_enter, kw as pdl_kw
from kvferry.common.kernels.quant_rows import TokenQuantized
from kvferry.common.kernels.triton_fp8_gemm import e4m3_quantize, e4m3_scale
from kvferry.common.kernels.triton_fused import silu_mul_values

QUANT_BLOCK = 1024  # columns a program of the quant kernel takes


@triton.jit
def _gate_up_silu_kernel(x, x_scale, w, w_scale, h, parts, M, INTER, K, stride_xm, stride_wn, stride_hm, stride_pm,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = 0):
    """h[r, c] = silu(g) * u with g, u = (x[r] . w[c or I + c]) * w_scale * x_scale[r], each rounded
    to h's dtype; parts[r, program] = max over the program's columns of |h[r, c]|."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_ok = cols < INTER
    ks = tl.arange(0, BLOCK_K)
    x_rows = x + rows.to(tl.int64)[:, None] * stride_xm
    gate_rows = w + cols[:, None] * stride_wn
    up_rows = w + (cols + INTER)[:, None] * stride_wn  # int64: past 2**31 bytes too
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        xv = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = col_ok[:, None] & k_ok[None, :]
        wg = tl.load(gate_rows + k[None, :], mask=w_mask, other=0.0)
        wu = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)
        acc_g += tl.dot(xv, tl.trans(wg.to(xv.dtype)))
        acc_u += tl.dot(xv, tl.trans(wu.to(xv.dtype)))
    # _gemv_kernel's epilogue (per-row weight scales, then x's per-row scales), then its output's rounding
    xs = tl.load(x_scale + rows, mask=row_ok, other=0.0)[:, None]
    g = (acc_g * tl.load(w_scale + cols, mask=col_ok, other=0.0)[None, :] * xs).to(h.dtype.element_ty)
    u = (acc_u * tl.load(w_scale + INTER + cols, mask=col_ok, other=0.0)[None, :] * xs).to(h.dtype.element_ty)
    hv = silu_mul_values(g, u)
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(h + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :], hv, mask=mask)
    amax = tl.max(tl.where(mask, tl.abs(hv.to(tl.float32)), 0.0), 1)
    tl.store(parts + rows.to(tl.int64) * stride_pm + pid_n, amax, mask=row_ok)


@triton.jit
def _quant_parts_kernel(h, parts, q, s, INTER, NUM_PARTS, stride_hm, stride_pm, stride_qm, BLOCK: tl.constexpr,
                        BLOCK_P: tl.constexpr, PDL: tl.constexpr = 0):
    """Row r's BLOCK columns of h quantized with the scale of the row's amax, the max of its parts."""
    pdl_enter(PDL)
    row = tl.program_id(1).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    amax = tl.max(tl.load(parts + row * stride_pm + p, mask=p < NUM_PARTS, other=0.0), 0)
    scale = e4m3_scale(amax)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    v = tl.load(h + row * stride_hm + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(q + row * stride_qm + cols, e4m3_quantize(v, scale, q.dtype.element_ty), mask=mask)
    if tl.program_id(0) == 0:
        tl.store(s + row, scale)


def takes(num_rows: int, width: int, k: int) -> bool:
    """Whether ``gate_up_silu_quant`` takes ``num_rows`` rows of a gate-up weight [width, k]: 2 to 64
    rows, and the unfused GEMV's tiles for it do not split K (the result is then its bit for bit)."""
    return 2 <= num_rows <= 64 and not width % 2 and fp8_config(num_rows, width, k, None, fp8_x=True).split_k == 1


def gate_up_silu_quant(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       dtype: torch.dtype, config=None) -> TokenQuantized:
    """xq e4m3 [M, K] with per-row scales ``x_scale`` [M, 1] (2 <= M <= 64), an e4m3 gate-up weight
    [2I, K] with per-row scales [2I] -> silu(gate) * up [M, I] in ``dtype`` with its per-token quant,
    as ``fp8_gemv(..., x_scale=)`` then ``silu_mul(quant=True)``."""
    num_rows, k = xq.shape
    width = weight.shape[0]
    if weight.shape[1] != k or width % 2 or not 2 <= num_rows <= 64:
        raise ValueError(f"gate_up_silu_quant: x {tuple(xq.shape)} (2-64 rows) for a gate-up weight "
                         f"{tuple(weight.shape)} (an even number of rows)")  # a split K (not ``takes``) runs whole
    inter = width // 2
    cfg, block_m, block_k, _, _ = fitted_tiles(config or fp8_config(num_rows, width, k, None, fp8_x=True), num_rows,
                                               k, 1)
    block_n = cfg.block_n // 2  # of the gate and of the up: a program streams the GEMV's weight rows a program
    num_parts = triton.cdiv(inter, block_n)
    h = torch.empty(num_rows, inter, dtype=dtype, device=xq.device)
    parts = torch.empty(num_rows, num_parts, dtype=torch.float32, device=xq.device)
    q = torch.empty(num_rows, inter, dtype=torch.float8_e4m3fn, device=xq.device)
    s = torch.empty(num_rows, 1, dtype=torch.float32, device=xq.device)
    xq = xq if xq.stride(-1) == 1 else xq.contiguous()
    _gate_up_silu_kernel[(num_parts, triton.cdiv(num_rows, block_m))](
        xq, x_scale, weight, scale, h, parts, num_rows, inter, k, xq.stride(0), weight.stride(0), h.stride(0),
        parts.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_kw())
    _quant_parts_kernel[(triton.cdiv(inter, QUANT_BLOCK), num_rows)](
        h, parts, q, s, inter, num_parts, h.stride(0), parts.stride(0), q.stride(0), BLOCK=QUANT_BLOCK,
        BLOCK_P=triton.next_power_of_2(num_parts), num_warps=4, **pdl_kw())
    return TokenQuantized(h, q, s)
