"""W8A8 block-FP8 GEMM for the CUDA path (DeepSeek-V3 / Qwen3-FP8 checkpoints).

- ``per_token_group_quant``: x [M, K] -> e4m3 [M, K] and fp32 scales [M, ceil(K/G)], one per token
  per G = 128 columns, ``amax / 448`` (clamped away from 0); ``per_token_quant``: one scale per
  token (the per-tensor and per-channel checkpoints' activations, before ``torch._scaled_mm``);
- ``w8a8_block_gemm``: out[m, n] = sum over K groups g of scale_a[m, g] * scale_b[n, g] *
  (a[m, g-cols] . b[n, g-cols]), the e4m3 products accumulated in fp32 on the tensor cores. The
  weight scales are row-expanded block scales [N, ceil(K/128)] (``common/layers/fp8.py`` says why),
  so BLOCK_K is the group size and each K step loads one scale per row of a and of b.

The torch references are ``fp8.per_token_group_quant`` and ``fp8.reference_linear`` in
``common/layers/fp8.py``; ``tests/gpu/test_triton_fp8_gemm.py`` compares them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvferry.common.kernels.pdl import enter as pdl_enter, kw as pdl_kw

FP8_MAX = 448.0
MIN_AMAX = 1e-12
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


# div_rn: IEEE-rounded division, as torch divides (Triton's "/" is approximate on CUDA), so scales
# and quantized values equal the reference's bit for bit. Every dynamic activation quant uses these
# two (this module's kernels and triton_fused's norm and silu with ``quant``).
@triton.jit
def e4m3_scale(amax):
    """The scale of values whose largest magnitude is ``amax`` (fp32): ``max(amax, MIN_AMAX) / 448``."""
    return tl.div_rn(tl.maximum(amax, _MIN_AMAX), _FP8_MAX)


@triton.jit
def e4m3_quantize(v, scale, dtype: tl.constexpr):
    """fp32 ``v`` divided by ``scale``, clamped to e4m3's range, cast to ``dtype`` (float8e4nv)."""
    return tl.clamp(tl.div_rn(v, scale), -_FP8_MAX, _FP8_MAX).to(dtype)


@triton.jit
def quantize_row(v, q_row, s, row, cols, mask):
    """Stores row ``row`` (``v``: its values in the model dtype, 0 where masked) as e4m3 at q_row and
    its scale at s[row], as ``per_token_quant`` quantizes it (``amax / 448``, IEEE division): the
    norm's, silu's and the decode attention's fused quant."""
    v32 = v.to(tl.float32)
    scale = e4m3_scale(tl.max(tl.abs(v32), 0))
    tl.store(q_row + cols, e4m3_quantize(v32, scale, q_row.dtype.element_ty), mask=mask)
    tl.store(s + row, scale)


@triton.jit
def _group_quant_kernel(x, q, s, K, stride_x, stride_q, stride_s, GROUP: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = cols < K
    v = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = e4m3_scale(tl.max(tl.abs(v), 0))
    tl.store(q + row * stride_q + cols, e4m3_quantize(v, scale, q.dtype.element_ty), mask=mask)
    tl.store(s + row * stride_s + g, scale)


def per_token_group_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (row stride free, unit column stride) -> (e4m3 [M, K], fp32 [M, ceil(K/group)])."""
    num_rows, k = x.shape
    num_groups = triton.cdiv(k, group)
    q = torch.empty((num_rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((num_rows, num_groups), dtype=torch.float32, device=x.device)
    if num_rows:
        _group_quant_kernel[(num_rows, num_groups)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0), GROUP=group,
                                                    **pdl_kw())
    return q, s


@triton.jit
def _token_quant_kernel(x, q, s, K, stride_x, stride_q, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """One row per program: its amax over K in BLOCK chunks, then the row quantized with it."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = e4m3_scale(tl.max(amax, 0))
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < K
        v = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q + row * stride_q + cols, e4m3_quantize(v, scale, q.dtype.element_ty), mask=mask)
    tl.store(s + row, scale)


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (e4m3 [M, K], fp32 [M, 1]): ``fp8.per_token_quant`` in one
    kernel (the torch composition is about nine launches per linear, most of an FP8 decode step's
    overhead at batch 1 on the H200: bench/RESULTS.md)."""
    num_rows, k = x.shape
    q = torch.empty((num_rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows:
        _token_quant_kernel[(num_rows,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK=1024, **pdl_kw())
    return q, s


@triton.jit
def _block_gemm_kernel(a, b, c, scale_a, scale_b, bias, M, N, K, stride_am, stride_bn, stride_cm, stride_sam,
                       stride_sbn, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        k = g * BLOCK_K + ks
        k_ok = k < K
        x = tl.load(a + rows[:, None] * stride_am + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(b + cols[:, None] * stride_bn + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        sa = tl.load(scale_a + rows * stride_sam + g, mask=row_ok, other=0.0)  # [BLOCK_M]
        sb = tl.load(scale_b + cols * stride_sbn + g, mask=col_ok, other=0.0)  # [BLOCK_N]
        acc += tl.dot(x, tl.trans(w)) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(c.dtype.element_ty)
    tl.store(c + rows[:, None] * stride_cm + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


def w8a8_block_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype, bias: torch.Tensor | None = None, block: int = 128) -> torch.Tensor:
    """xq [M, K] e4m3, x_scale [M, ceil(K/block)], weight [N, K] e4m3, w_scale [N, ceil(K/block)] (fp32,
    row-expanded) -> [M, N] in ``out_dtype``."""
    num_rows, k = xq.shape
    n = weight.shape[0]
    out = torch.empty((num_rows, n), dtype=out_dtype, device=xq.device)
    block_m = 16 if num_rows <= 16 else 64
    block_n = 64 if num_rows <= 16 else 128
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(n, block_n))
    _block_gemm_kernel[grid](xq, weight, out, x_scale, w_scale, bias if bias is not None else out, num_rows, n, k,
                             xq.stride(0), weight.stride(0), out.stride(0), x_scale.stride(0), w_scale.stride(0),
                             HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block,
                             num_warps=4, num_stages=3, **pdl_kw())
    return out


def w8a8_block_linear(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, block: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) -> x quantized per token per ``block`` columns, times the block-FP8
    weight, plus bias: [M, N] in x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    xq, x_scale = per_token_group_quant(x, block)
    return w8a8_block_gemm(xq, x_scale, weight, w_scale, x.dtype, bias, block)
