"""The FP8 GEMM references (``common/layers/fp8.py``) on CPU: they quantize activations as the
checkpoints' dynamic schemes state (per token, or per token per 128 columns, ``amax / 448``) and
then equal a plain fp32 dequantize-then-matmul; ``attn.linear`` sends an ``Fp8Weight`` to them.

Rounding bound used throughout: e4m3 keeps 3 mantissa bits, so rounding a value v of the normal
range (|v| >= 2**-6) to nearest moves it by at most half a step, 2**-4 * |v| relative; below it
the step is the subnormal 2**-9, so at most 2**-10 absolute. For a quantity x quantized with scale
s (v = x / s): |dequant(x) - x| <= max(2**-4 * |x|, 2**-10 * s).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvferry.common.layers import fp8
from kvferry.common.layers.attn_backend import TorchBackend

torch.manual_seed(0)


def within_e4m3(deq: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> bool:
    bound = torch.maximum(2**-4 * x.abs(), 2**-10 * scale) * (1 + 1e-6)
    return bool(((deq - x).abs() <= bound).all())


def channel_weight(n: int, k: int) -> tuple[fp8.Fp8Weight, torch.Tensor]:
    source = torch.randn(n, k) / k**0.5
    q, scale = fp8.quantize_rows(source)
    w = fp8.Fp8Weight(n, k, None, torch.device("cpu"))
    w.weight.copy_(q)
    w.scale.copy_(scale)
    return w, source


def block_weight(n: int, k: int) -> tuple[fp8.Fp8Weight, torch.Tensor]:
    source = torch.randn(n, k) / k**0.5
    q, scale_inv = fp8.quantize_blocks(source)
    w = fp8.Fp8Weight(n, k, 128, torch.device("cpu"))
    w.weight.copy_(q)
    w.scale.copy_(scale_inv.repeat_interleave(128, dim=0)[:n])
    return w, source


@pytest.mark.parametrize("make", [channel_weight, block_weight])
def test_weights_stay_one_byte_and_dequantize_within_e4m3(make):
    w, source = make(200, 300)  # ragged last block along both dims
    assert w.weight.dtype == torch.float8_e4m3fn and w.weight.element_size() == 1
    assert w.scale.shape == ((200,) if w.block is None else (200, 3))
    assert within_e4m3(w.dequantize(), source, w.expanded_scale().expand(200, 300))


def test_per_token_quant_scales_each_row_by_its_amax():
    x = torch.randn(6, 96) * torch.logspace(-3, 3, 6)[:, None]
    xq, xs = fp8.per_token_quant(x)
    assert xs.shape == (6, 1)
    torch.testing.assert_close(xs[:, 0], x.abs().amax(dim=1) / 448.0, rtol=0, atol=0)
    assert torch.equal(xq.float().abs().amax(dim=1), torch.full((6,), 448.0))  # each row's amax maps to 448
    assert within_e4m3(xq.float() * xs, x, xs.expand_as(x))


def test_per_token_group_quant_scales_each_128_columns():
    x = torch.randn(3, 300)
    x[:, 128:256] *= 100.0  # a group 100x larger must not share a scale with its neighbours
    xq, xs = fp8.per_token_group_quant(x)
    assert xs.shape == (3, 3)
    for g, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 300))):
        torch.testing.assert_close(xs[:, g], x[:, cols].abs().amax(dim=1) / 448.0, rtol=0, atol=0)
        assert torch.equal(xq[:, cols].float().abs().amax(dim=1), torch.full((3,), 448.0))
    expanded = xs.repeat_interleave(128, dim=1)[:, :300]
    assert within_e4m3(xq.float() * expanded, x, expanded)


def test_zero_rows_quantize_to_zero():
    xq, xs = fp8.per_token_quant(torch.zeros(2, 16))
    assert torch.isfinite(xs).all() and not xq.float().any()


def test_channel_reference_is_dequantize_then_matmul():
    w, _ = channel_weight(48, 80)
    x, bias = torch.randn(5, 80), torch.randn(48)
    amax = x.abs().amax(dim=1, keepdim=True)
    x_deq = (x / (amax / 448.0)).to(torch.float8_e4m3fn).float() * (amax / 448.0)
    want = x_deq @ (w.weight.float() * w.scale[:, None]).t() + bias
    torch.testing.assert_close(fp8.reference_linear(x, w, bias), want, rtol=1e-5, atol=1e-5)


def test_block_reference_is_dequantize_then_matmul():
    w, _ = block_weight(72, 300)
    x = torch.randn(4, 300)
    x_deq = torch.empty_like(x)
    for start in range(0, 300, 128):  # per token per 128-column group
        part = x[:, start:start + 128]
        s = part.abs().amax(dim=1, keepdim=True) / 448.0
        x_deq[:, start:start + 128] = (part / s).to(torch.float8_e4m3fn).float() * s
    w_deq = torch.empty(72, 300)
    for r in range(72):  # per 128 x 128 block of the weight
        for g, start in enumerate(range(0, 300, 128)):
            w_deq[r, start:start + 128] = w.weight[r, start:start + 128].float() * w.scale[r, g]
    torch.testing.assert_close(fp8.reference_linear(x, w), x_deq @ w_deq.t(), rtol=1e-5, atol=1e-5)


def _backends():
    yield TorchBackend()
    if importlib.util.find_spec("triton") is not None:  # on CPU only as the interpreter tests build it
        from kvferry.common.layers.attn_backend import TritonBackend

        yield TritonBackend(torch.device("cpu"), 1)


@pytest.mark.parametrize("backend", list(_backends()), ids=lambda b: b.name)
@pytest.mark.parametrize("make", [channel_weight, block_weight])
def test_backend_linear_dispatches_on_the_weight(make, backend):
    w, _ = make(40, 136)
    x = torch.randn(2, 3, 136).to(torch.bfloat16)  # leading dims kept, x's dtype out
    got = backend.linear(x, w, None)
    assert got.shape == (2, 3, 40) and got.dtype == torch.bfloat16
    assert torch.equal(got, fp8.reference_linear(x, w))
    # and it is the FP8 product, close to (not equal to) the unquantized one
    plain = x.float() @ w.dequantize().t()
    assert not torch.equal(got.float(), plain.to(torch.bfloat16).float())
    torch.testing.assert_close(got.float(), plain, rtol=0.1, atol=0.1)


class _CudaRows:
    """What ``fp8.route`` reads of an activation on CUDA (no CUDA device needed)."""

    def __init__(self, rows: int, k: int, dtype=torch.bfloat16):
        self.shape, self.dtype, self.is_cuda = torch.Size((rows, k)), dtype, True

    def dim(self) -> int:
        return 2


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the routes past 16 rows ask triton_gemv")
def test_route_and_which_routes_take_a_fused_token_quant(monkeypatch):
    """The route table of the module docstring, and that exactly the W8A8 per-row routes (the
    GEMV's FP8 dot, _scaled_mm) take their input quantized by its producer; the switch turns it off."""
    channel, block = channel_weight(256, 512)[0], block_weight(256, 512)[0]
    routes = {rows: fp8.route(_CudaRows(rows, 512), channel, rows) for rows in (1, 16, 17, 64, 65, 4096)}
    assert routes == {1: "gemv", 16: "gemv", 17: "gemv_w8a8", 64: "gemv_w8a8", 65: "scaled_mm", 4096: "scaled_mm"}
    assert fp8.route(_CudaRows(65, 512, torch.float32), channel, 65) == "reference"  # _scaled_mm wants bf16
    assert fp8.route(_CudaRows(16, 512), block, 16) == "gemv"
    assert fp8.route(_CudaRows(65, 512), block, 65) == "block"
    assert fp8.route(torch.zeros(40, 512), channel, 40) == "reference"  # CPU
    takes = {rows: fp8.takes_token_quant(channel, _CudaRows(rows, 512)) for rows in (16, 17, 64, 65)}
    assert takes == {16: False, 17: True, 64: True, 65: True}
    assert not fp8.takes_token_quant(block, _CudaRows(65, 512))  # per-group scales: its own quant
    assert not fp8.takes_token_quant(torch.zeros(256, 512), _CudaRows(40, 512))  # a bf16 weight
    assert not fp8.takes_token_quant(None, _CudaRows(40, 512))
    assert not fp8.takes_token_quant(channel, torch.zeros(40, 512))  # CPU
    monkeypatch.setattr(fp8, "FUSE_TOKEN_QUANT", False)
    assert not fp8.takes_token_quant(channel, _CudaRows(40, 512))


@pytest.mark.parametrize("backend", list(_backends()), ids=lambda b: b.name)
def test_a_token_quantized_input_reaches_every_linear_as_its_rows_or_its_quant(backend):
    """``fp8.TokenQuantized`` (what a fused norm or silu hands a W8A8 linear) is taken by an FP8
    linear, by a plain one (its rows), and its rows are what the CPU reference quantizes."""
    w, _ = channel_weight(40, 136)
    x = torch.randn(20, 136).to(torch.bfloat16)
    q, s = fp8.per_token_quant(x)
    carried = fp8.TokenQuantized(x, q, s)
    assert carried.shape == x.shape
    assert torch.equal(backend.linear(carried, w, None), backend.linear(x, w, None))
    plain = torch.randn(24, 136).to(torch.bfloat16)
    assert torch.equal(backend.linear(carried if backend.name == "triton" else x, plain), x @ plain.t())
