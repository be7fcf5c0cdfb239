"""The Triton kernels over an FP8 (e4m3) KV pool against the torch path (``common/kernels/kv_quant.py``,
``common/layers/attention.py``): the stores (``store_kv``, ``rope_store``) write the bytes torch's
quantization writes, decode and extend read FP8 pages as torch dequantizes them, and the dense
prefill (SDPA over the new K/V) sees the values a later read of its pages gives.

Triton 3.9's interpreter rounds fp32 -> fp8 wrongly where rounding carries into the exponent
(31.9 becomes 16, not 32; fp8 loads and fp8 -> fp32 are exact). Under TRITON_INTERPRET=1 the
stores are therefore checked on inputs that need no rounding: values on the e4m3 grid times a
power-of-two scale, rope at position 0 (cos 1, sin 0), plus saturating values; on CUDA with random
inputs. The reads are checked on random FP8 pages in both.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvferry.common.kernels.kv_quant import FP8_E4M3_MAX, dequantize, quantize
from kvferry.common.layers import attention, rope

pytestmark = pytest.mark.gpu
triton_attention = pytest.importorskip("kvferry.common.kernels.triton_attention")
triton_fused = pytest.importorskip("kvferry.common.kernels.triton_fused")
from kvferry.common.layers.attn_backend import TritonBackend, TritonPlan  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
FP8 = torch.float8_e4m3fn
# The interpreter's tl.dot misreads bf16 tiles (triton 3.9): there fp16 stands in for the 16-bit path.
DTYPES = [torch.float32, torch.float16 if INTERPRET else torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
K_SCALE, V_SCALE = (0.25, 2.0) if INTERPRET else (0.037, 1.9)
STORED_STD = 8.0  # of the random FP8 pages the reads are checked on; V reads are about 8 * V_SCALE
ATOL = {dtype: tol * STORED_STD * V_SCALE for dtype, tol in TOL.items()}  # TOL is for outputs of O(1)


def _pool(layout: str, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, fill: bool, seed=0):
    """One middle layer of a KvCache-shaped FP8 pool: (k_cache, v_cache, buffer); ``fill``: random
    stored values quantized by torch, N(0, STORED_STD) (normals and subnormals of e4m3)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages, 3, 2) if layout == "page-major" else (3, 2, num_pages)
    values = torch.randn(shape + (num_kv_heads, page_size, head_dim), generator=gen) * (STORED_STD if fill else 0)
    buffer = values.to(FP8).to(DEVICE)  # torch's cast of values within +-448
    views = buffer.permute(1, 2, 0, 4, 3, 5) if layout == "page-major" else buffer.permute(0, 1, 2, 4, 3, 5)
    return views[1, 0], views[1, 1], buffer


def _grid_values(num: int, scale: float, seed: int) -> torch.Tensor:
    """Values the pool stores without rounding: e4m3 numbers times ``scale`` (a power of two under
    the interpreter), one in eight past +-448 * scale (saturating); random values on CUDA."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num, generator=gen) * 100
    if INTERPRET:
        x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8).float()
    x[::8] = torch.where(x[::8] >= 0, 1000.0, -1000.0)
    return x * scale


@pytest.mark.parametrize("layout", ["page-major", "layer-major"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_quantizes_as_torch_and_skips_padding(layout, dtype):
    k_cache, v_cache, buffer = _pool(layout, 20, 16, 2, 64, fill=False)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    k = _grid_values(6 * 2 * 64, K_SCALE, 1).view(6, 2, 64).to(dtype).to(DEVICE)
    v = _grid_values(6 * 2 * 64, V_SCALE, 2).view(6, 2, 64).to(dtype).to(DEVICE)
    pages = torch.tensor([3, 3, 17, 0, -1, 9], device=DEVICE)
    rows = torch.tensor([0, 15, 7, 1, 4, 8], device=DEVICE)
    triton_attention.store_kv(k_cache, v_cache, k, v, pages, rows, K_SCALE, V_SCALE)
    keep = pages >= 0
    want_k.index_put_((pages[keep], rows[keep]), quantize(k[keep], K_SCALE, FP8))
    want_v.index_put_((pages[keep], rows[keep]), quantize(v[keep], V_SCALE, FP8))
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))
    stored = dequantize(k_cache[pages[keep], rows[keep]], K_SCALE, torch.float32)
    assert stored.abs().max() == FP8_E4M3_MAX * K_SCALE  # the saturating inputs stopped at 448 * scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_quantizes_the_rotated_k_and_v_as_torch(dtype):
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 4, 2, 32
    q = torch.randn(num_tokens, num_heads, head_dim, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    k = _grid_values(num_tokens * num_kv_heads * head_dim, K_SCALE, 3).view(num_tokens, num_kv_heads, head_dim)
    v = _grid_values(num_tokens * num_kv_heads * head_dim, V_SCALE, 4).view(num_tokens, num_kv_heads, head_dim)
    k, v = k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE)
    positions = torch.zeros(num_tokens, dtype=torch.int64) if INTERPRET else torch.tensor([0, 3, 17, 100, 4095])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rope.cos_sin(positions.to(DEVICE), inv_freq.to(DEVICE), dtype)
    k_cache, v_cache, _ = _pool("page-major", 9, 4, num_kv_heads, head_dim, fill=False)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    pages = torch.tensor([2, 2, 8, -1, 0], device=DEVICE)
    rows = torch.tensor([0, 3, 1, 2, 3], device=DEVICE)
    rotated = rope.apply_rotary(k, cos, sin)
    triton_fused.rope_store(q, k, v, cos, sin, k_cache, v_cache, pages, rows, K_SCALE, V_SCALE)
    keep = pages >= 0
    want_k.index_put_((pages[keep], rows[keep]), quantize(rotated[keep], K_SCALE, FP8))
    want_v.index_put_((pages[keep], rows[keep]), quantize(v[keep], V_SCALE, FP8))
    if INTERPRET or dtype == torch.float32:
        assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    else:  # the kernel rotates in fp32 and rounds once; torch rounds after each op: one bf16 step apart
        close = dequantize(k_cache, K_SCALE, torch.float32) - dequantize(want_k, K_SCALE, torch.float32)
        assert close.abs().max() <= 2**-3 * dequantize(want_k, K_SCALE, torch.float32).abs().max()
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))


def _tables(kv_lens: list[int], page_size: int, num_pages: int, seed: int = 0) -> list[list[int]]:
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    out, at = [], 0
    for n in kv_lens:
        need = -(-n // page_size)
        out.append(perm[at:at + need])
        at += need
    return out


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)


def _reference(k_cache, v_cache, q, query_lens, starts, tables, page_size, scale):
    """The torch path over the same FP8 pages (it dequantizes after its gather)."""
    plan = attention.build_plan(query_lens, starts, tables, page_size, torch.device(DEVICE))
    return attention.paged_attention(q.float(), k_cache, v_cache, plan, None, scale, K_SCALE, V_SCALE)


@pytest.mark.parametrize("layout", ["page-major", "layer-major"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_over_fp8_pages_equals_torch(layout, dtype):
    kv_lens, page_size, heads, head_dim = [1, 15, 16, 17, 70], 16, (8, 2), 64
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 5
    k_cache, v_cache, _ = _pool(layout, num_pages, page_size, heads[1], head_dim, fill=True)
    tables = _tables(kv_lens, page_size, num_pages)
    q = torch.randn(len(kv_lens), heads[0], head_dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    q = q.to(DEVICE)
    scale = head_dim**-0.5
    splits = triton_attention.num_decode_splits(len(kv_lens), heads[1], 16 if INTERPRET else 132)
    got = triton_attention.decode_attention(q, k_cache, v_cache, _padded(tables),
                                            torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE), scale, None,
                                            splits, K_SCALE, V_SCALE)
    want = _reference(k_cache, v_cache, q, [1] * len(kv_lens), [n - 1 for n in kv_lens], tables, page_size, scale)
    torch.testing.assert_close(got.float(), want, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("layout", ["page-major", "layer-major"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_over_fp8_pages_equals_torch(layout, dtype):
    """Verify / chunked prefill / extend over cached prefix pages, and plain prefill (prefix 0)."""
    prefix_lens, query_lens, page_size, heads, head_dim = [0, 7, 33], [20, 5, 17], 16, (4, 2), 32
    kv_lens = [p + n for p, n in zip(prefix_lens, query_lens)]
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 3
    k_cache, v_cache, _ = _pool(layout, num_pages, page_size, heads[1], head_dim, fill=True, seed=1)
    tables = _tables(kv_lens, page_size, num_pages, seed=1)
    q = torch.randn(sum(query_lens), heads[0], head_dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    q = q.to(DEVICE)
    scale = head_dim**-0.5
    starts = torch.tensor([0] + query_lens[:-1]).cumsum(0).to(torch.int32).to(DEVICE)
    got = triton_attention.extend_attention(
        q, k_cache, v_cache, _padded(tables), starts, torch.tensor(query_lens, dtype=torch.int32, device=DEVICE),
        torch.tensor(prefix_lens, dtype=torch.int32, device=DEVICE), max(query_lens), scale, None, K_SCALE, V_SCALE)
    want = _reference(k_cache, v_cache, q, query_lens, prefix_lens, tables, page_size, scale)
    torch.testing.assert_close(got.float(), want, atol=ATOL[dtype], rtol=0)


def test_dense_prefill_sees_what_a_read_of_its_pages_gives():
    """The dense prefill attends over the new K/V without reading the pool: with an FP8 pool it must
    see the round-tripped values, so that it equals the extend kernel over the pages just written
    (prefill from scratch and prefill over a cached prefix give the same tokens)."""
    query_lens, page_size, heads, head_dim = [300, 40], 16, (4, 2), 32
    num_pages = sum(-(-n // page_size) for n in query_lens) + 2
    k_cache, v_cache, _ = _pool("page-major", num_pages, page_size, heads[1], head_dim, fill=False)
    tables = _tables(query_lens, page_size, num_pages, seed=2)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(query_lens), heads[0], head_dim, generator=gen).to(DEVICE)
    k = (torch.randn(sum(query_lens), heads[1], head_dim, generator=gen) * 4 * K_SCALE).to(DEVICE)
    v = torch.randn(sum(query_lens), heads[1], head_dim, generator=gen).to(DEVICE)
    torch_plan = attention.build_plan(query_lens, [0, 0], tables, page_size, torch.device(DEVICE))
    attention.write_kv(k_cache, v_cache, k, v, torch_plan, K_SCALE, V_SCALE)
    starts = torch.tensor([0, query_lens[0]], device=DEVICE)
    lens = torch.tensor(query_lens, device=DEVICE)
    plan = TritonPlan(positions=torch_plan.positions, write_pages=torch_plan.write_pages,
                      write_rows=torch_plan.write_rows, last_index=torch_plan.last_index, kv_lens=lens,
                      q_starts=starts, q_lens=lens, prefix_lens=torch.zeros_like(lens), page_table=_padded(tables),
                      query_lens=query_lens, max_query=max(query_lens), num_splits=1, is_long_prefill=True,
                      starts=[0, 0])
    backend = TritonBackend(torch.device(DEVICE), heads[1])
    scale = head_dim**-0.5
    got = backend.attend(q, k, v, k_cache, v_cache, plan, None, scale, K_SCALE, V_SCALE)
    want = _reference(k_cache, v_cache, q, query_lens, [0, 0], tables, page_size, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    # what it would see without the round trip: SDPA per prompt over the unquantized rows
    unquantized = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None], is_causal=True,
        scale=scale, enable_gqa=True)[0].transpose(0, 1) for rows in (slice(0, 300), slice(300, 340))])
    assert not torch.allclose(unquantized, want, atol=2e-5, rtol=0)
