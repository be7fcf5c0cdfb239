"""The Triton paged-attention kernels against the torch path (``common/layers/attention.py``).

Random page tables over a pool bigger than the batch needs, lengths from 1 to 32k with page
boundaries, both KV layouts, page sizes 1/16/64, GQA, sliding windows, bf16 and fp32.
Tolerances: fp32 max abs error 2e-5 (``input_precision="ieee"``: the same maths, another order of
summation); bf16 2e-2 (P is rounded to bf16 before P @ V, as SGLang does; outputs are O(1)).
With ``TRITON_INTERPRET=1`` the short cases run on CPU tensors (fp32 and fp16, fp16 at 5e-3).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvferry.common.layers import attention

pytestmark = pytest.mark.gpu
triton_attention = pytest.importorskip("kvferry.common.kernels.triton_attention")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
# SMs the decode's split count is sized for: an H200's 132 on CUDA (up to 32 splits); the interpreter
# runs each program in Python, so there 16 (2 splits of the 9-sequence batch: split-k, empty splits)
NUM_SMS = 16 if INTERPRET else 132


class Pool:
    """A KV pool shaped like ``KvCache`` (one layer of it is what a kernel sees) with random pages."""

    def __init__(self, layout: str, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype,
                 num_layers: int = 3, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        shape = (num_pages, num_layers, 2) if layout == "page-major" else (num_layers, 2, num_pages)
        # heads-outer page items [Hkv, page_size, D], seen as [page, token, head, D] as KvCache does
        buffer = torch.randn(shape + (num_kv_heads, page_size, head_dim), generator=gen).to(dtype).to(DEVICE)
        views = buffer.permute(1, 2, 0, 4, 3, 5) if layout == "page-major" else buffer.permute(0, 1, 2, 4, 3, 5)
        self.k, self.v = views[1, 0], views[1, 1]  # a middle layer: strided in both layouts
        self.page_size, self.num_pages = page_size, num_pages
        self.rng = random.Random(seed)

    def tables(self, kv_lens: list[int]) -> list[list[int]]:
        need = [-(-n // self.page_size) for n in kv_lens]
        pages = self.rng.sample(range(self.num_pages), sum(need))
        out, at = [], 0
        for n in need:
            out.append(pages[at:at + n])
            at += n
        return out


def _padded_table(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)


def _reference(pool: Pool, q, query_lens, starts, tables, window, scale):
    plan = attention.build_plan(query_lens, starts, tables, pool.page_size, torch.device(DEVICE))
    return attention.paged_attention(q.float(), pool.k.float(), pool.v.float(), plan, window, scale)


def _check_decode(layout, page_size, kv_lens, dtype, heads=(8, 2), head_dim=64, window=None):
    num_heads, num_kv_heads = heads
    pages_needed = sum(-(-n // page_size) for n in kv_lens)
    pool = Pool(layout, pages_needed + 7, page_size, num_kv_heads, head_dim, dtype)
    tables = pool.tables(kv_lens)
    q = torch.randn(len(kv_lens), num_heads, head_dim).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    splits = triton_attention.num_decode_splits(len(kv_lens), num_kv_heads, NUM_SMS)
    got = triton_attention.decode_attention(q, pool.k, pool.v, _padded_table(tables),
                                            torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE), scale, window,
                                            splits)
    want = _reference(pool, q, [1] * len(kv_lens), [n - 1 for n in kv_lens], tables, window, scale)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("heads, head_dim", [((8, 2), 64), ((6, 2), 64), ((32, 8), 128)])
def test_unsplit_decode_quantizes_its_rows_per_token_for_o_proj(heads, head_dim, monkeypatch):
    """``quant`` at one split: the last of each sequence's KV-head programs quantizes its whole row
    [Hq * D] (a width that is not a power of two too): the rows equal the unquantized output, and
    the e4m3 rows and scales equal ``per_token_quant`` of them bit for bit, a padding row (length 0)
    included; the counts are back at 0 (the same again on the next launch). Split, or with
    ``QUANT_OUT`` off, the output comes unquantized (o_proj's linear quantizes it)."""
    from kvferry.common.kernels import split_sum, triton_fp8_gemm

    dtype = torch.float16 if INTERPRET else torch.bfloat16
    (num_heads, num_kv_heads), page_size = heads, 16
    kv_lens = [33, 1, 0, 70]
    pool = Pool("page-major", sum(-(-n // page_size) for n in kv_lens) + 3, page_size, num_kv_heads, head_dim, dtype)
    tables = pool.tables(kv_lens)
    q = torch.randn(len(kv_lens), num_heads, head_dim).to(dtype).to(DEVICE)
    table, lens = _padded_table([t or [0] for t in tables]), torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)

    def run(splits, quant=True):
        return triton_attention.decode_attention(q, pool.k, pool.v, table, lens, head_dim**-0.5, None, splits,
                                                 quant=quant)

    plain = run(1, quant=False).view(len(kv_lens), num_heads * head_dim)
    want_q, want_s = triton_fp8_gemm.per_token_quant(plain)
    for got in (run(1), run(1)):
        assert torch.equal(got.rows, plain)
        assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got.scale, want_s)
    assert not split_sum.counters(q.device, 1).any()
    assert isinstance(run(2), torch.Tensor)
    monkeypatch.setattr(triton_attention, "QUANT_OUT", False)
    assert torch.equal(run(1), plain.view(q.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16 if INTERPRET else torch.bfloat16])
@pytest.mark.parametrize("merge_tile", [True, False])
def test_decode_one_split_and_fewest_keys_a_split(dtype, merge_tile, monkeypatch):
    """Both merges (the splits as one tile, the default, and one after another: ``MERGE_TILE``).
    One split: the split kernel stores the output itself (no merge), bit for bit what merging a
    single split gives (two splits of at least 512 keys: the second returns at once, unwritten, and
    the merge must read the first alone). ``min_split``: splits of at least that many keys, the
    programs past the context returning at once and the merge reading only the splits in use
    (lengths 1 to 300 over 8 splits of at least 64: 1 to 5 in use); both against the reference,
    and the splits in use equal to as many splits without a minimum. A padding row (length 0) gets
    zeros either way."""
    monkeypatch.setattr(triton_attention, "MERGE_TILE", merge_tile)
    kv_lens, (num_heads, num_kv_heads), head_dim, page_size = [300, 1, 64, 65, 0, 129], (8, 2), 64, 16
    pool = Pool("page-major", sum(-(-n // page_size) for n in kv_lens) + 3, page_size, num_kv_heads, head_dim, dtype)
    tables = pool.tables(kv_lens)
    q = torch.randn(len(kv_lens), num_heads, head_dim).to(dtype).to(DEVICE)
    table, lens = _padded_table([t or [0] for t in tables]), torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    tiles = triton_attention.DecodeTiles(block_n=32)

    def run(splits, tiles):
        return triton_attention.decode_attention(q, pool.k, pool.v, table, lens, head_dim**-0.5, None, splits,
                                                 tiles=tiles)

    live = [i for i, n in enumerate(kv_lens) if n]
    want = _reference(pool, q[live], [1] * len(live), [kv_lens[i] - 1 for i in live], [tables[i] for i in live],
                      None, head_dim**-0.5)
    direct = run(1, tiles)
    # 2 splits of at least 512 keys: the second never runs, the merge reads the first alone
    merged = run(2, tiles._replace(min_split=512))
    assert torch.equal(direct, merged)
    for got in (direct, run(8, tiles._replace(min_split=64)), run(8, tiles._replace(min_split=50))):
        torch.testing.assert_close(got[live].float(), want, atol=TOL[dtype], rtol=0)
        assert not got[4].any()
    # 300 keys in splits of at least 64: 5 of 8 in use, each 64 keys, the same as 5 splits of 64
    assert torch.equal(run(8, tiles._replace(min_split=64))[0], run(5, tiles)[0])


def _check_extend(layout, page_size, prefix_lens, query_lens, dtype, heads=(8, 2), head_dim=64, window=None):
    num_heads, num_kv_heads = heads
    kv_lens = [p + n for p, n in zip(prefix_lens, query_lens)]
    pool = Pool(layout, sum(-(-n // page_size) for n in kv_lens) + 5, page_size, num_kv_heads, head_dim, dtype)
    tables = pool.tables(kv_lens)
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    starts = torch.tensor([0] + query_lens[:-1], dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    got = triton_attention.extend_attention(
        q, pool.k, pool.v, _padded_table(tables), starts, torch.tensor(query_lens, dtype=torch.int32, device=DEVICE),
        torch.tensor(prefix_lens, dtype=torch.int32, device=DEVICE), max(query_lens), scale, window)
    want = _reference(pool, q, query_lens, prefix_lens, tables, window, scale)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=0)


LAYOUTS = ["page-major", "layer-major"]
# The interpreter's tl.dot misreads bf16 tiles (triton 3.9): there fp16 stands in for the 16-bit path.
DTYPES = [torch.float32, torch.float16 if INTERPRET else torch.bfloat16]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode_short(layout, dtype, page_size):
    _check_decode(layout, page_size, [1, 2, 15, 16, 17, 63, 64, 65, 200], dtype)


@pytest.mark.skipif(INTERPRET, reason="long contexts are too slow for the interpreter")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_long_split_k(layout, dtype):
    _check_decode(layout, 16, [1, 1000, 4097, 32768], dtype, heads=(32, 8), head_dim=128)
    _check_decode(layout, 16, [32768], dtype, heads=(32, 8), head_dim=128)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_window_and_odd_head_dim(dtype):
    _check_decode("page-major", 16, [5, 40, 130], dtype, heads=(6, 3), head_dim=40, window=32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_and_chunked_prefill(layout, dtype, page_size):
    # verify: k + 1 tokens after a prefix; chunked prefill: a chunk after a prefix; plain prefill: no prefix
    _check_extend(layout, page_size, [0, 7, 16, 33, 100], [5, 5, 5, 5, 5], dtype)
    _check_extend(layout, page_size, [0, 31, 64], [70, 17, 130], dtype)


@pytest.mark.skipif(INTERPRET, reason="long contexts are too slow for the interpreter")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_long(layout, dtype):
    _check_extend(layout, 16, [0, 8192, 30000], [4096, 1000, 2768], dtype, heads=(32, 8), head_dim=128)


def _check_long_prefill(layout, page_size, prefix_lens, query_lens, dtype, heads=(8, 2), head_dim=64):
    """``TritonBackend.attend`` on a batch with a chunk past ``DENSE_PREFILL_MIN_TOKENS``: SDPA per
    chunk, a chunk with no prefix over the new K/V passed in, one after a prefix over its context
    gathered from the pages (causal lower-right)."""
    from types import SimpleNamespace

    from kvferry.common.layers.attn_backend import DENSE_PREFILL_MIN_TOKENS, TritonBackend

    num_heads, num_kv_heads = heads
    kv_lens = [p + n for p, n in zip(prefix_lens, query_lens)]
    pool = Pool(layout, sum(-(-n // page_size) for n in kv_lens) + 5, page_size, num_kv_heads, head_dim, dtype)
    tables = pool.tables(kv_lens)
    backend = TritonBackend(torch.device(DEVICE), num_kv_heads)
    chunks = [SimpleNamespace(token_ids=[7] * n, start_pos=p, page_ids=t)
              for p, n, t in zip(prefix_lens, query_lens, tables)]
    _, plan = backend.plan(chunks, page_size, torch.device(DEVICE))
    assert plan.is_long_prefill and max(query_lens) > DENSE_PREFILL_MIN_TOKENS
    # the new rows' K/V as the pool holds them (stored before attention runs)
    where = [(torch.tensor(t)[torch.arange(p, p + n) // page_size], torch.arange(p, p + n) % page_size)
             for p, n, t in zip(prefix_lens, query_lens, tables)]
    k = torch.cat([pool.k[pages.to(DEVICE), rows.to(DEVICE)] for pages, rows in where])
    v = torch.cat([pool.v[pages.to(DEVICE), rows.to(DEVICE)] for pages, rows in where])
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    got = backend.attend(q, k, v, pool.k, pool.v, plan, None, scale)
    want = _reference(pool, q, query_lens, prefix_lens, tables, None, scale)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_long_chunks_after_a_prefix_attend_with_sdpa(layout, dtype, page_size):
    """A prefix hit's long extend (and a long chunk of a chunked prompt) next to a prompt from
    scratch, a one-token and a short chunk after prefixes: each row sees exactly its causal context."""
    _check_long_prefill(layout, page_size, [0, 500, 37, 64, 1000], [300, 260, 1, 9, 513], dtype)
    _check_long_prefill(layout, page_size, [130], [257], dtype, heads=(4, 4), head_dim=32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_window(dtype):
    _check_extend("layer-major", 16, [0, 50], [90, 20], dtype, heads=(4, 4), head_dim=32, window=24)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_store_kv_matches_index_put_and_skips_padding(layout):
    pool = Pool(layout, 20, 16, 2, 64, torch.bfloat16)
    want_k, want_v = pool.k.clone(), pool.v.clone()
    qkv = torch.randn(6, 3 * 2 * 64).to(torch.bfloat16).to(DEVICE)  # k, v as strided views of one qkv row
    k = qkv[:, 128:256].view(6, 2, 64)
    v = qkv[:, 256:].view(6, 2, 64)
    pages = torch.tensor([3, 3, 17, 0, -1, 9], device=DEVICE)
    rows = torch.tensor([0, 15, 7, 1, 4, 8], device=DEVICE)
    triton_attention.store_kv(pool.k, pool.v, k, v, pages, rows)
    keep = pages >= 0
    want_k.index_put_((pages[keep], rows[keep]), k[keep])
    want_v.index_put_((pages[keep], rows[keep]), v[keep])
    assert torch.equal(pool.k, want_k) and torch.equal(pool.v, want_v)
