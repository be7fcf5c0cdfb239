"""The W8A8 gate-up projection with silu and the per-token quant in its own two launches
(``triton_mlp.gate_up_silu_quant``) against the GEMV, then ``silu_mul`` with ``quant`` (bit for bit:
the same dots in the same K steps, the same roundings), and against the torch reference.

On CPU they run under Triton's interpreter (float8 loads are exact there)."""

from __future__ import annotations

import os

import pytest
import torch

from kvferry.common.layers import fp8

pytestmark = pytest.mark.gpu
triton_mlp = pytest.importorskip("kvferry.common.kernels.triton_mlp")
triton_gemv = pytest.importorskip("kvferry.common.kernels.triton_gemv")
triton_fused = pytest.importorskip("kvferry.common.kernels.triton_fused")

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
HALF = torch.float16 if DEVICE == "cpu" else torch.bfloat16


def _inputs(rows: int, inter: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = fp8.Fp8Weight(2 * inter, k, None, torch.device(DEVICE))
    q, scale = fp8.quantize_rows(torch.randn(2 * inter, k, generator=g) * 0.05)
    w.weight.copy_(q)
    w.scale.copy_(scale)
    x = (torch.randn(rows, k, generator=g) * 2).to(DEVICE, HALF)
    return x, w


@pytest.mark.parametrize("rows, inter, k", [(17, 200, 384), (40, 64, 256), (64, 136, 640)])
def test_gate_up_silu_quant_equals_the_gemv_then_silu_mul_quant(rows, inter, k):
    """Against the GEMV with K whole (as the rules run every gate-up the fused path takes: ``takes``)."""
    x, w = _inputs(rows, inter, k, seed=rows)
    xq, xs = fp8.per_token_quant(x)
    got = triton_mlp.gate_up_silu_quant(xq, xs, w.weight, w.scale, HALF)
    whole = triton_gemv.fp8_config(rows, 2 * inter, k, None, fp8_x=True)._replace(split_k=1)
    gate_up = triton_gemv.fp8_gemv(xq, w.weight, w.scale, None, config=whole, x_scale=xs, out_dtype=HALF)
    want = triton_fused.silu_mul(gate_up, quant=True)
    assert got.rows.shape == (rows, inter) and got.rows.dtype == HALF and got.q.dtype == torch.float8_e4m3fn
    assert torch.equal(got.rows, want.rows)
    assert torch.equal(got.scale, want.scale)
    assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8))
    # and against the reference: the W8A8 linear in torch, then silu(gate) * up
    ref_gate, ref_up = fp8.reference_linear(x, w).float().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(ref_gate) * ref_up
    torch.testing.assert_close(got.rows.float().cpu(), ref.cpu(), rtol=2**-6, atol=2**-6)


@pytest.mark.parametrize("rows, width, k, taken", [(64, 28672, 4096, True), (17, 28672, 4096, True),
                                                   (1, 28672, 4096, False), (16, 28672, 4096, True),
                                                   (65, 28672, 4096, False), (64, 4096, 4096, False),
                                                   (64, 28673, 4096, False)])
def test_the_fused_path_takes_unsplit_gate_ups_of_2_to_64_rows(rows, width, k, taken):
    """Llama-3-8B's gate-up [28672, 4096] runs K whole at 2-64 rows; a narrow one splits K, so the
    fused path would not equal the GEMV's parts summed in order: it is left to the unfused path."""
    assert triton_mlp.takes(rows, width, k) == taken


def test_gate_up_silu_quant_refuses_what_it_does_not_take():
    x, w = _inputs(17, 64, 256, seed=1)
    xq, xs = fp8.per_token_quant(x)
    with pytest.raises(ValueError, match="2-64 rows"):
        triton_mlp.gate_up_silu_quant(xq[:1], xs[:1], w.weight, w.scale, HALF)
    with pytest.raises(ValueError, match="an even number of rows"):
        triton_mlp.gate_up_silu_quant(xq, xs, w.weight[:127], w.scale[:127], HALF)
