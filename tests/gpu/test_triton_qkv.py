"""The W8A8 q/k/v projection with its rotary embedding and K/V store in one launch
(``triton_qkv.qkv_rope_store``) against the GEMV, then ``rope_store`` (bit for bit: the same dots in
the same K steps, the same roundings, the same rotation), over both pool layouts and an FP8 pool.

On CPU they run under Triton's interpreter (float8 loads are exact there)."""

from __future__ import annotations

import os

import pytest
import torch

from kvferry.common.layers import fp8, rope

pytestmark = pytest.mark.gpu
triton_qkv = pytest.importorskip("kvferry.common.kernels.triton_qkv")
triton_gemv = pytest.importorskip("kvferry.common.kernels.triton_gemv")
triton_fused = pytest.importorskip("kvferry.common.kernels.triton_fused")

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
HALF = torch.float16 if DEVICE == "cpu" else torch.bfloat16


def _pools(layout: str, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """K and V pools [20 pages, page_size 4, Hkv, D] as KvCache views them, zeroed."""
    shape = (20, 3, 2) if layout == "page-major" else (3, 2, 20)
    buffer = torch.zeros(shape + (num_kv_heads, 4, head_dim), dtype=dtype, device=DEVICE)
    views = buffer.permute(1, 2, 0, 4, 3, 5) if layout == "page-major" else buffer.permute(0, 1, 2, 4, 3, 5)
    return views[1, 0], views[1, 1]


def _differ(got: torch.Tensor, want: torch.Tensor) -> str:
    """Where two tensors differ: how many elements, the first index, the largest difference."""
    diff = (got.float() - want.float()).abs()
    where = (got != want).nonzero()
    return f"{len(where)} of {got.numel()} differ, first at {where[0].tolist()}, largest {float(diff.max()):.3g}"


@pytest.mark.parametrize("rows, num_heads, num_kv_heads, head_dim, k", [(17, 4, 2, 64, 256), (40, 2, 1, 128, 384),
                                                                        (64, 3, 1, 32, 128)])
@pytest.mark.parametrize("layout", ["page-major", "layer-major"])
@pytest.mark.parametrize("pool", ["model", "fp8"])
def test_qkv_rope_store_equals_the_gemv_then_rope_store(monkeypatch, rows, num_heads, num_kv_heads, head_dim, k,
                                                        layout, pool):
    """Both sides on tiles of 128 columns a K step, K whole (so 1-3 steps here)."""
    tiles = triton_gemv.GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=2, split_k=1)
    for module in (triton_gemv, triton_qkv):
        monkeypatch.setattr(module, "fp8_config", lambda *a, **kw: tiles)
    n = (num_heads + 2 * num_kv_heads) * head_dim
    assert triton_qkv.takes(rows, n, k, head_dim)
    g = torch.Generator().manual_seed(rows + head_dim)
    w = fp8.Fp8Weight(n, k, None, torch.device(DEVICE))
    q8, scale = fp8.quantize_rows(torch.randn(n, k, generator=g) * 0.05)
    w.weight.copy_(q8)
    w.scale.copy_(scale)
    xq, xs = fp8.per_token_quant((torch.randn(rows, k, generator=g) * 2).to(DEVICE, HALF))
    positions = torch.randint(0, 4096, (rows,), generator=g).to(DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rope.cos_sin(positions, inv_freq.to(DEVICE), HALF)
    slots = torch.randperm(20 * 4, generator=g)[:rows]  # a slot a token: no two writes race for one
    pages, page_rows = (slots // 4).to(DEVICE), (slots % 4).to(DEVICE)
    pages[::5] = -1  # not stored
    pool_dtype = HALF if pool == "model" else torch.float8_e4m3fn
    k_scale, v_scale = (1.0, 1.0) if pool == "model" else (0.5, 0.25)

    qkv = triton_gemv.fp8_gemv(xq, w.weight, w.scale, None, x_scale=xs, out_dtype=HALF)
    q, k_rows, v_rows = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k_rows, v_rows = (t.view(rows, -1, head_dim) for t in (q, k_rows, v_rows))
    want_pools = _pools(layout, num_kv_heads, head_dim, pool_dtype)
    want_q = triton_fused.rope_store(q, k_rows, v_rows, cos, sin, *want_pools, pages, page_rows, k_scale, v_scale)

    got_pools = _pools(layout, num_kv_heads, head_dim, pool_dtype)
    got_q, got_k, got_v = triton_qkv.qkv_rope_store(xq, xs, w.weight, w.scale, HALF, num_heads, num_kv_heads, cos,
                                                    sin, *got_pools, pages, page_rows, k_scale, v_scale)
    assert torch.equal(got_q, want_q), _differ(got_q, want_q)
    assert torch.equal(got_k, k_rows), _differ(got_k, k_rows)  # k rotated, as rope_store leaves it
    assert torch.equal(got_v, v_rows), _differ(got_v, v_rows)
    for got, want in zip(got_pools, want_pools):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), _differ(got.float(), want.float())
    assert bool((want_pools[0].view(torch.uint8) != 0).any())  # something was stored
    # and against the torch composition: the rotation of the GEMV's rows, whose two products torch rounds to the
    # model dtype before their sum (an error of a rounding of the largest product, not of the result)
    torch.testing.assert_close(got_q.float(), rope.apply_rotary(q, cos, sin).float(), rtol=2**-7,
                               atol=float(q.abs().max()) * 2**-7)


def test_takes_and_refuses():
    assert not triton_qkv.takes(1, 6144, 4096, 128)  # one row: the one-row GEMV
    assert not triton_qkv.takes(65, 6144, 4096, 128)
    assert not triton_qkv.takes(64, 6144, 4096, 40)  # a half-head no program's columns divide
    assert not triton_qkv.takes(64, 4096, 4096, 128)  # a narrow weight: the GEMV splits K (2 parts)
    assert triton_qkv.takes(64, 6144, 4096, 128) and triton_qkv.takes(17, 6144, 4096, 128)
    w = fp8.Fp8Weight(4096, 4096, None, torch.device(DEVICE))
    xq = torch.zeros(64, 4096, device=DEVICE).to(torch.float8_e4m3fn)
    xs = torch.ones(64, 1, device=DEVICE)
    cos = torch.zeros(64, 1, 128, dtype=HALF, device=DEVICE)
    pools = _pools("page-major", 8, 128, HALF)
    with pytest.raises(ValueError, match="qkv_rope_store.*not a shape it takes"):
        triton_qkv.qkv_rope_store(xq, xs, w.weight, w.scale, HALF, 16, 8, cos, cos, *pools,
                                  torch.zeros(64, dtype=torch.int64, device=DEVICE),
                                  torch.zeros(64, dtype=torch.int64, device=DEVICE))
