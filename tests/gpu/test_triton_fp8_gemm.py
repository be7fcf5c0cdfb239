"""The block-FP8 kernels (``triton_fp8_gemm.py``) against their torch references (``common/layers/fp8.py``).

Under ``TRITON_INTERPRET=1`` float8 loads and fp8 ``tl.dot`` run exactly, but the interpreter's
fp32 -> e4m3 cast does not round to nearest even: it rounds ties away from zero, truncates
subnormals and drops the carry when rounding crosses a power of two (127.1 becomes 64, not 128).
There the quant test checks the scales exactly and each value to be one of the two e4m3
neighbours of the exact scaled input (or that dropped carry), and the composed linear is
checked against the reference GEMM over the kernel's own quantized activations. On CUDA both
are checked against the torch path exactly.

Tolerance of the GEMM: both sides multiply the same e4m3 values and the same fp32 scales; they
differ in summation order (and the final cast), so 1e-4 (fp32 out) or one rounding of bf16/fp16.
On CUDA the fp8 tensor-core MMA accumulates each 128-wide group with fewer than fp32's mantissa
bits (about 14 on Hopper, the reason the kernel promotes to fp32 once per group), so fp32 outputs
get 2**-10 there.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvferry.common.layers import fp8

pytestmark = pytest.mark.gpu
triton_fp8_gemm = pytest.importorskip("kvferry.common.kernels.triton_fp8_gemm")

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
INTERPRETED = DEVICE == "cpu"
# (M tokens, N out rows, K in columns): one token, ragged M/N/K tails, several K groups
SHAPES = [(1, 64, 128), (5, 80, 200), (17, 130, 384)]


def _block_weight(n: int, k: int) -> fp8.Fp8Weight:
    q, scale_inv = fp8.quantize_blocks(torch.randn(n, k) * 0.05)
    w = fp8.Fp8Weight(n, k, 128, torch.device(DEVICE))
    w.weight.copy_(q)
    w.scale.copy_(scale_inv.repeat_interleave(128, dim=0)[:n])
    return w


def _interpreter_cast_ok(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Elements the interpreter's cast may give: an e4m3 neighbour of ``exact`` (within one e4m3
    step: 3 mantissa bits, subnormal step 2**-9), or half of a power-of-two ``want`` (dropped carry)."""
    mantissa, exponent = torch.frexp(exact.abs())
    step = torch.exp2((exponent - 4).clamp(min=-9).float())
    neighbour = (got - exact).abs() < step
    carry_mantissa, _ = torch.frexp(want.abs())
    return neighbour | ((carry_mantissa == 0.5) & (got * 2 == want))


@pytest.mark.parametrize("shape", SHAPES)
def test_per_token_group_quant(shape):
    m, _, k = shape
    x = (torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]).to(DEVICE)
    x[0, :3] = 0.0
    q, s = triton_fp8_gemm.per_token_group_quant(x)
    want_q, want_s = fp8.per_token_group_quant(x.cpu())
    torch.testing.assert_close(s.cpu(), want_s, rtol=0, atol=0)
    got, want = q.cpu().float(), want_q.float()
    if INTERPRETED:
        exact = x.cpu() / want_s.repeat_interleave(128, dim=1)[:, :k]
        assert ((got == want) | _interpreter_cast_ok(got, want, exact)).all()
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("shape", [(1, 64), (3, 1000), (5, 4096), (2, 14336)])
def test_per_token_quant(shape):
    torch.manual_seed(1)
    x = (torch.randn(shape, device=DEVICE) * 3).to(torch.float32 if INTERPRETED else torch.bfloat16)
    x[0, 0] = 0.0
    got, got_scale = triton_fp8_gemm.per_token_quant(x)
    # the reference on CPU: torch on CUDA divides by a scalar as a multiplication by its reciprocal
    # (one ulp off the IEEE quotient the kernel and the CPU compute)
    want, want_scale = fp8.per_token_quant(x.cpu())
    assert torch.equal(got_scale.cpu(), want_scale)
    got, want = got.cpu().float(), want.cpu().float()
    if INTERPRETED:
        exact = (x.float().cpu() / want_scale).clamp(-448, 448)
        assert ((got == want) | _interpreter_cast_ok(got, want, exact)).all()
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16 if INTERPRETED else torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_block_gemm_equals_reference(shape, dtype):
    m, n, k = shape
    w = _block_weight(n, k)
    xq, xs = fp8.per_token_group_quant(torch.randn(m, k).to(dtype))
    bias = torch.randn(n).to(dtype)
    got = triton_fp8_gemm.w8a8_block_gemm(xq.to(DEVICE), xs.to(DEVICE), w.weight, w.scale, dtype, bias.to(DEVICE))
    x_deq = xq.float() * xs.repeat_interleave(128, dim=1)[:, :k]
    want = (x_deq @ w.dequantize().cpu().t() + bias.float()).to(dtype)
    tol = (1e-4 if INTERPRETED else 2**-10) if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", SHAPES)
def test_block_linear_equals_reference(shape):
    m, n, k = shape
    w = _block_weight(n, k)
    x = torch.randn(m, k).to(DEVICE)
    got = triton_fp8_gemm.w8a8_block_linear(x, w.weight, w.scale, 128)
    if INTERPRETED:  # the reference GEMM over the kernel's own quantized activations (module docstring)
        xq, xs = triton_fp8_gemm.per_token_group_quant(x)
        want = (xq.float() * xs.repeat_interleave(128, dim=1)[:, :k]) @ w.dequantize().t()
    else:
        want = fp8.reference_linear(x, w)
    tol = 1e-4 if INTERPRETED else 2**-10
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=tol, atol=tol)


@pytest.mark.skipif(INTERPRETED, reason="torch._scaled_mm needs a CUDA device (sm89+); the interpreter has none")
@pytest.mark.parametrize("m", [17, 33, 65])
def test_scaled_mm_path_equals_reference(m):
    """Per-channel weights on CUDA above the weight-only GEMV's 16 rows go W8A8: the per-token quant,
    then the GEMV's FP8 dot up to 64 rows (``test_triton_gemv.py``), torch._scaled_mm with row-wise
    scales past; either multiplies the same e4m3 values and scales as the reference, so they differ
    by one bf16 rounding."""
    q, scale = fp8.quantize_rows(torch.randn(256, 512) * 0.05)
    w = fp8.Fp8Weight(256, 512, None, torch.device(DEVICE))
    w.weight.copy_(q)
    w.scale.copy_(scale)
    x, bias = torch.randn(m, 512, device=DEVICE).bfloat16(), torch.randn(256, device=DEVICE).bfloat16()
    got = fp8.fp8_linear(x, w, bias)
    w_cpu = fp8.Fp8Weight(256, 512, None, torch.device("cpu"))
    w_cpu.weight.copy_(q)
    w_cpu.scale.copy_(scale)
    want = fp8.reference_linear(x.cpu(), w_cpu, bias.cpu())  # on CPU: see test_per_token_quant
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), want.float(), rtol=2**-7, atol=2**-7)
