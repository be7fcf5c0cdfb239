"""The fused elementwise kernels (``triton_fused.py``) against the torch compositions they replace.

Tolerances: fp32 1e-5 relative; bf16 one rounding of the dtype (2**-7 relative, and 1e-2 absolute
for values near 0), since the kernels round once where torch rounds after each op.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvferry.common.layers import rope
from kvferry.common.layers.norm import rms_norm

pytestmark = pytest.mark.gpu
triton_fused = pytest.importorskip("kvferry.common.kernels.triton_fused")

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
DTYPES = [torch.float32, torch.float16 if DEVICE == "cpu" else torch.bfloat16]


def _close(got, want):
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rms_norm(dtype, hidden):
    x, delta = (torch.randn(7, hidden).to(dtype).to(DEVICE) for _ in range(2))
    weight = torch.rand(hidden).to(dtype).to(DEVICE) + 0.5
    out_x, out_h = triton_fused.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(out_x, x + delta)
    _close(out_h, rms_norm(x + delta, weight, 1e-5))
    same_x, h = triton_fused.add_rms_norm(x, None, weight, 1e-5)
    assert same_x is x
    _close(h, rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_parts, quant", [(2, False), (3, True), (4, True)])
def test_add_rms_norm_adds_split_k_parts_as_the_sum_launch(dtype, num_parts, quant):
    """A ``SplitParts`` delta (a split-K GEMV's fp32 parts, unsummed) is added in part order and rounded
    in the norm's launch: bit for bit ``sum_parts``, then the norm (x + delta, h, and its quantization)."""
    from kvferry.common.kernels.quant_rows import SplitParts
    from kvferry.common.kernels.split_sum import sum_parts

    rows, hidden = 6, 96
    g = torch.Generator().manual_seed(num_parts)
    parts = (torch.randn(num_parts, rows, hidden, generator=g) * 3).to(DEVICE)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(DEVICE)
    delta = sum_parts(parts, num_parts, hidden, rows * hidden, torch.empty(rows, hidden, dtype=dtype, device=DEVICE))
    want_x, want_h = triton_fused.add_rms_norm(x, delta, weight, 1e-5, quant=quant and dtype != torch.float32)
    got_x, got_h = triton_fused.add_rms_norm(x, SplitParts(parts, dtype), weight, 1e-5,
                                             quant=quant and dtype != torch.float32)
    assert torch.equal(got_x, want_x) and torch.equal(SplitParts(parts, dtype).total(), delta)
    if isinstance(want_h, torch.Tensor):
        assert torch.equal(got_h, want_h)
    else:
        assert torch.equal(got_h.rows, want_h.rows) and torch.equal(got_h.scale, want_h.scale)
        assert torch.equal(got_h.q.view(torch.uint8), want_h.q.view(torch.uint8))
    with pytest.raises(ValueError, match="split-K parts"):
        triton_fused.add_rms_norm(x[:5], SplitParts(parts, dtype), weight, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["page-major", "layer-major"])
@pytest.mark.parametrize("q_heads", [0, 4])
def test_rope_store(dtype, layout, q_heads):
    """``q_heads`` 4: the 6 q heads over two programs (4, then 2) beside the k/v program; 0: one a token."""
    num_tokens, num_heads, num_kv_heads, head_dim, page_size = 5, 6, 2, 40, 4
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype).to(DEVICE)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.tensor([0, 3, 17, 100, 4095], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rope.cos_sin(positions, inv_freq.to(DEVICE), dtype)
    shape = (9, 3, 2) if layout == "page-major" else (3, 2, 9)
    buffer = torch.zeros(shape + (num_kv_heads, page_size, head_dim), dtype=dtype, device=DEVICE)  # as KvCache
    views = buffer.permute(1, 2, 0, 4, 3, 5) if layout == "page-major" else buffer.permute(0, 1, 2, 4, 3, 5)
    k_cache, v_cache = views[1, 0], views[1, 1]
    pages = torch.tensor([2, 2, 8, -1, 0], device=DEVICE)
    rows = torch.tensor([0, 3, 1, 2, 3], device=DEVICE)
    want_k = rope.apply_rotary(k, cos, sin)
    got_q = triton_fused.rope_store(q, k, v, cos, sin, k_cache, v_cache, pages, rows, q_heads=q_heads)
    _close(got_q, rope.apply_rotary(q, cos, sin))
    _close(k, want_k)  # rotated in place
    for t in range(num_tokens):
        if pages[t] >= 0:
            _close(k_cache[pages[t], rows[t]], want_k[t])
            assert torch.equal(v_cache[pages[t], rows[t]], v[t])
    assert int((buffer != 0).any(dim=-1).any(dim=-2).sum()) == 2 * 4  # 4 tokens stored, k and v, nothing else


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads", [0, 2])
def test_rope_store_normalises_q_and_k_first(dtype, q_heads):
    """Qwen3's per-head q/k RMSNorm fused before the rotation: as norm.rms_norm, then rope (the 4 q
    heads in one program, or two programs of 2)."""
    num_tokens, num_heads, num_kv_heads, head_dim, page_size = 3, 4, 2, 32, 4
    g = torch.Generator().manual_seed(3)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 3).to(dtype).to(DEVICE)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in
               qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
    q_w = (1 + torch.randn(head_dim, generator=g) * 0.2).to(dtype).to(DEVICE)
    k_w = (1 + torch.randn(head_dim, generator=g) * 0.2).to(dtype).to(DEVICE)
    positions = torch.tensor([0, 9, 200], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rope.cos_sin(positions, inv_freq.to(DEVICE), dtype)
    k_cache = torch.zeros(2, page_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    pages, rows = torch.tensor([1, 0, 1], device=DEVICE), torch.tensor([0, 2, 3], device=DEVICE)
    want_q = rope.apply_rotary(rms_norm(q, q_w, 1e-6), cos, sin)
    want_k = rope.apply_rotary(rms_norm(k, k_w, 1e-6), cos, sin)
    got_q = triton_fused.rope_store(q, k, v, cos, sin, k_cache, v_cache, pages, rows, qk_norm=(q_w, k_w, 1e-6),
                                    q_heads=q_heads)
    _close(got_q, want_q)
    _close(k, want_k)  # normalised and rotated in place
    for t in range(num_tokens):
        _close(k_cache[pages[t], rows[t]], want_k[t])
        assert torch.equal(v_cache[pages[t], rows[t]], v[t])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gate_up = torch.randn(3, 2 * 1500).to(dtype).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(triton_fused.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


# -- per-token quantization fused into the producer of a W8A8 linear's input ------------------------------------
def _same_as_separate_quant(got, rows):
    """``got`` (a TokenQuantized) holds ``rows`` and exactly what the separate kernel makes of them
    (``triton_fp8_gemm.per_token_quant``), whose scales are the CPU reference's bit for bit."""
    from kvferry.common.kernels import triton_fp8_gemm
    from kvferry.common.layers import fp8

    assert isinstance(got, fp8.TokenQuantized)
    assert torch.equal(got.rows, rows)
    want_q, want_s = triton_fp8_gemm.per_token_quant(rows)
    assert got.q.dtype == fp8.FP8_DTYPE and got.q.shape == rows.shape and got.scale.shape == (rows.shape[0], 1)
    assert torch.equal(got.scale, want_s)
    assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got.scale.cpu(), fp8.per_token_quant(rows.cpu())[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rms_norm_quantizes_its_rows(dtype, hidden):
    x, delta = (torch.randn(5, hidden).to(dtype).to(DEVICE) * 4 for _ in range(2))
    x[1] = -delta[1]  # an all-zero row: the scale clamps to MIN_AMAX / 448, every value quantizes to 0
    weight = torch.rand(hidden).to(dtype).to(DEVICE) + 0.5
    want_x, want_h = triton_fused.add_rms_norm(x, delta, weight, 1e-5)
    got_x, got = triton_fused.add_rms_norm(x, delta, weight, 1e-5, quant=True)
    assert torch.equal(got_x, want_x)
    _same_as_separate_quant(got, want_h)
    _, got = triton_fused.add_rms_norm(x, None, weight, 1e-5, quant=True)
    _same_as_separate_quant(got, triton_fused.add_rms_norm(x, None, weight, 1e-5)[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1500] + ([] if DEVICE == "cpu" else [14336]))
def test_silu_mul_quantizes_its_rows(dtype, inter):
    gate_up = (torch.randn(3, 2 * inter) * 3).to(dtype).to(DEVICE)
    for block in (None, 512):  # the whole row in registers, and two passes of 512 columns
        _same_as_separate_quant(triton_fused.silu_mul(gate_up, quant=True, block=block), triton_fused.silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dup, factor", [(True, 1.0), (False, 0.7071)])
def test_cos_sin_in_one_launch_equals_torch(dtype, dup, factor):
    """The step's rope rows (dense: each frequency twice, no factor; MLA's rope part: once, times
    yarn's factor) against ``rope.cos_sin``, at positions to 163,840 (DeepSeek's longest), over 37
    tokens (three 16-token programs, the last one partial)."""
    positions = torch.tensor([0, 1, 2, 17, 4095, 4096, 65535, 163839] + list(range(100, 3000, 100)), device=DEVICE)
    assert positions.numel() == 37
    inv_freq = (1.0 / (10000 ** (torch.arange(0, 40, 2).float() / 40))).to(DEVICE)  # 20 frequencies: a padded block
    got = triton_fused.cos_sin(positions, inv_freq, dtype, factor, dup)
    want = rope.cos_sin(positions, inv_freq, dtype, factor, dup)
    for g, w in zip(got, want):
        assert g.shape == w.shape == (37, 1, 40 if dup else 20) and g.dtype == dtype
        if dtype == torch.float32:  # another cos/sin implementation: a few ulps of values at most 1
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
        else:  # at most one rounding step of the dtype apart
            torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=2**-10 if dtype == torch.float16 else 2**-7)
    if dup:
        assert torch.equal(got[0][..., :20], got[0][..., 20:])


def test_cos_sin_refuses_a_half_precision_inv_freq():
    with pytest.raises(ValueError, match=r"an fp32 inv_freq \[D/2\], got \(4,\) torch.float16"):
        triton_fused.cos_sin(torch.arange(3, device=DEVICE), torch.ones(4, dtype=torch.float16, device=DEVICE),
                             torch.float32)
