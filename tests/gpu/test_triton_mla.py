"""The Triton MLA kernels (``triton_mla.py``) against the torch path (``TorchBackend.mla_attend``:
the paged attention over the latent as one KV head), and a tiny DeepSeek on the triton backend.

Random page tables over a latent pool bigger than the batch needs, both KV layouts, page sizes 4
and 16, ragged lengths across page boundaries, head counts that are and are not a multiple of the
kernels' 16-head tile, padding sequences (kv_len 0 in decode, q_len 0 in extend) and padding store
rows (page -1). Under ``TRITON_INTERPRET=1`` the small shapes run on CPU (fp32 and fp16); on CUDA
also DeepSeek's real ones (kv_lora_rank 512, rope 64, 16 and 128 heads, contexts to 4k, bf16).
Tolerances: fp32 2e-5 (ieee dots, another summation order), fp16 5e-3, bf16 2e-2 (P is rounded to
the dtype before P @ c; outputs are O(1)). The tiny DeepSeek runs whole on the triton backend, eagerly
and over a CUDA graph bucket's static plan with a padding row, against the torch backend, and in
MLA's expanded form (``mla.py``) over the eager plans' page tables.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvferry.common.layers import attention
from kvferry.common.layers.attn_backend import TorchBackend

pytestmark = pytest.mark.gpu
triton_mla = pytest.importorskip("kvferry.common.kernels.triton_mla")
triton_attention = pytest.importorskip("kvferry.common.kernels.triton_attention")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
NUM_SMS = 16 if INTERPRET else 132  # as test_triton_attention: several splits, some of them empty
LAYOUTS = ["page-major", "layer-major"]
# The interpreter's tl.dot misreads bf16 tiles (triton 3.9): there fp16 stands in for the 16-bit path.
DTYPES = [torch.float32, torch.float16 if INTERPRET else torch.bfloat16]


class LatentPool:
    """One middle layer of a latent pool laid out as ``LatentCache`` lays it, random rows."""

    def __init__(self, layout: str, num_pages: int, page_size: int, width: int, dtype, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        shape = (num_pages, 3) if layout == "page-major" else (3, num_pages)
        buffer = torch.randn(shape + (page_size, width), generator=gen).to(dtype).to(DEVICE)
        self.cache = buffer[:, 1] if layout == "page-major" else buffer[1]  # [num_pages, page_size, width]
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


def _pool(layout, page_size, kv_lens, width, dtype) -> LatentPool:
    return LatentPool(layout, sum(-(-n // page_size) for n in kv_lens) + 5, page_size, width, dtype)


def _ints(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def _padded_table(tables: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(t) for t in tables))
    return _ints([t + [0] * (width - len(t)) for t in tables])


def _reference(pool: LatentPool, q, query_lens, starts, tables, latent_dim, scale) -> torch.Tensor:
    plan = attention.build_plan(query_lens, starts, tables, pool.page_size, torch.device(DEVICE))
    return TorchBackend.mla_attend(q.float(), pool.cache.float(), plan, latent_dim, scale)


def _query(num_tokens: int, num_heads: int, width: int, dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_heads, width, generator=gen).to(dtype).to(DEVICE)


def _check_decode(layout, page_size, kv_lens, dtype, num_heads=4, latent_dim=32, rope_dim=16, num_padding=0,
                  splits=None, tiles=None):
    """``num_padding`` trailing rows of kv_len 0 (a graph bucket's padding): their outputs are 0.
    ``splits``/``tiles``: the split count (default the batch's) and the split kernel's tiles."""
    width = latent_dim + rope_dim
    pool = _pool(layout, page_size, kv_lens, width, dtype)
    tables = pool.tables(kv_lens)
    batch = len(kv_lens) + num_padding
    q = _query(batch, num_heads, width, dtype)
    scale = (width + 32) ** -0.5
    splits = splits or triton_attention.num_decode_splits(batch, 1, NUM_SMS)
    got = triton_mla.decode_attention(q, pool.cache, _padded_table(tables + [[]] * num_padding),
                                      _ints(kv_lens + [0] * num_padding), latent_dim, scale, splits, tiles)
    assert got.shape == (batch, num_heads, latent_dim) and got.dtype == dtype
    want = _reference(pool, q[:len(kv_lens)], [1] * len(kv_lens), [n - 1 for n in kv_lens], tables, latent_dim,
                      scale)
    torch.testing.assert_close(got[:len(kv_lens)].float(), want, atol=TOL[dtype], rtol=0)
    assert torch.count_nonzero(got[len(kv_lens):]) == 0


def _check_extend(layout, page_size, prefix_lens, query_lens, dtype, num_heads=4, latent_dim=32, rope_dim=16,
                  num_padding=0):
    """``num_padding`` trailing sequences of q_len 0 (a verify graph's padding) read nothing."""
    width = latent_dim + rope_dim
    kv_lens = [p + n for p, n in zip(prefix_lens, query_lens)]
    pool = _pool(layout, page_size, kv_lens, width, dtype)
    tables = pool.tables(kv_lens)
    num_tokens = sum(query_lens)
    q = _query(num_tokens, num_heads, width, dtype)
    scale = (width + 32) ** -0.5
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))] + [0] * num_padding
    got = triton_mla.extend_attention(
        q, pool.cache, _padded_table(tables + [[]] * num_padding), _ints(starts),
        _ints(query_lens + [0] * num_padding), _ints(prefix_lens + [0] * num_padding), max(query_lens), latent_dim,
        scale)
    assert got.shape == (num_tokens, num_heads, latent_dim) and got.dtype == dtype
    want = _reference(pool, q, query_lens, prefix_lens, tables, latent_dim, scale)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [4, 16])
def test_decode_ragged(layout, dtype, page_size):
    _check_decode(layout, page_size, [1, 3, 4, 5, 16, 17, 40, 130], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_partial_head_tile_and_padding_rows(dtype):
    # 20 heads: a full 16-head tile and a partial one; 64-wide latent; two padding rows of kv_len 0
    _check_decode("layer-major", 4, [2, 33, 70], dtype, num_heads=20, latent_dim=64, num_padding=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 8])
def test_decode_one_split_and_fewest_keys_a_split(dtype, splits):
    """One split stores the output from the split kernel (no merge); with splits of at least 32 keys
    (two 16-key steps) a 40-key context runs 2 of its 8 splits and the merge reads those two, a
    3-key one runs 1; a padding row (kv_len 0) gets zeros either way."""
    tiles = triton_attention.DecodeTiles(block_n=16, min_split=32)
    _check_decode("page-major", 4, [3, 40, 130, 17], dtype, splits=splits, tiles=tiles, num_padding=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_absorbed_projections_equal_the_einsums(dtype, num_tokens):
    """triton_absorb's two products against mla.absorb_q_ref/absorb_v_ref, from W_UK/W_UV as views
    of one kv_b weight (strided heads) and q_nope/q_pe as views of one q projection; 5 heads, a
    latent wider than one 128-column block and a v narrower than one 32-column block."""
    from kvferry.common.kernels import triton_absorb
    from kvferry.common.layers import mla

    heads, nope, rope_dim, latent, v_dim = 5, 24, 16, 160, 20
    g = torch.Generator().manual_seed(3)
    kv_b = (torch.randn(heads, nope + v_dim, latent, generator=g) / latent ** 0.5).to(dtype).to(DEVICE)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]
    q = torch.randn(num_tokens, heads, nope + rope_dim, generator=g).to(dtype).to(DEVICE)
    q_nope, q_pe = q.split([nope, rope_dim], -1)
    o = torch.randn(num_tokens, heads, latent, generator=g).to(dtype).to(DEVICE)
    tol = TOL[dtype] if dtype == torch.float32 else 2 * TOL[dtype]  # one rounding of O(1) sums each way
    got_q = triton_absorb.absorb_q(q_nope, w_uk, q_pe)
    torch.testing.assert_close(got_q.float(), mla.absorb_q_ref(q_nope, w_uk, q_pe).float(), atol=tol, rtol=tol)
    assert torch.equal(got_q[..., latent:], q_pe)  # q_pe copied as it is
    got_v = triton_absorb.absorb_v(o, w_uv)
    assert got_v.shape == (num_tokens, heads * v_dim) and got_v.is_contiguous()
    torch.testing.assert_close(got_v.float(), mla.absorb_v_ref(o, w_uv).float(), atol=tol, rtol=tol)


def test_absorbed_projections_refuse_mismatched_heads():
    from kvferry.common.kernels import triton_absorb

    with pytest.raises(ValueError, match=r"absorb_q: activations \(2, 4, 8\) and weight \(3, 8, 32\) disagree"):
        triton_absorb.absorb_q(torch.zeros(2, 4, 8), torch.zeros(3, 8, 32), torch.zeros(2, 4, 4))
    with pytest.raises(ValueError, match=r"absorb_v: activations \(2, 4, 16\) and weight \(4, 8, 32\) disagree"):
        triton_absorb.absorb_v(torch.zeros(2, 4, 16), torch.zeros(4, 8, 32))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [4, 16])
def test_extend_verify_chunked_and_plain_prefill(layout, dtype, page_size):
    # verify: 4 tokens after a prefix; chunked prefill: a chunk after a prefix; plain prefill: no prefix
    _check_extend(layout, page_size, [0, 3, 16, 33], [4, 4, 4, 4], dtype)
    _check_extend(layout, page_size, [0, 13, 64], [37, 1, 21], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_partial_head_tiles_and_padding_sequences(dtype):
    # 5 heads: a tile's (token, head) rows straddle tokens; two padding sequences of q_len 0
    _check_extend("page-major", 4, [5, 0], [3, 9], dtype, num_heads=5, latent_dim=64, num_padding=2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_rows_equals_torch_and_skips_padding(layout, interleaved, dtype):
    """The one-launch latent rows against TorchBackend.mla_rows (RMSNorm of the latent, rope of
    k_pe and of q_pe, both rope layouts), from strided views of wider projections; page -1 stores
    nothing."""
    from types import SimpleNamespace

    from kvferry.common.layers.mla import LatentRope

    latent, rope_dim, heads, num_tokens = 48, 16, 5, 6
    pool = LatentPool(layout, 12, 4, latent + rope_dim, dtype)
    g = torch.Generator().manual_seed(7)
    kv_a = (torch.randn(num_tokens, latent + rope_dim + 8, generator=g) * 2).to(dtype).to(DEVICE)[:, :latent + rope_dim]
    q = torch.randn(num_tokens, heads, 32 + rope_dim, generator=g).to(dtype).to(DEVICE)
    q_pe = q[..., 32:]
    norm = (1 + 0.2 * torch.randn(latent, generator=g)).to(dtype).to(DEVICE)
    angles = torch.rand(num_tokens, 1, rope_dim // 2, generator=g) * 6
    cos_sin = (angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE))
    rotary = SimpleNamespace(is_interleaved=interleaved)
    rotary.apply = lambda x, cos, sin: LatentRope.apply(rotary, x, cos, sin)
    plan = SimpleNamespace(write_pages=_ints([3, 3, 11, 0, -1, 7]), write_rows=_ints([0, 3, 2, 1, 1, 2]))
    want_cache = pool.cache.clone()
    keep = plan.write_pages >= 0
    want_q, want_rows = TorchBackend.mla_rows(kv_a, q_pe, cos_sin, norm, 1e-6, rotary)
    want_cache.index_put_((plan.write_pages[keep], plan.write_rows[keep]), want_rows[keep])
    got_q, got_rows = triton_mla.latent_rows(kv_a, q_pe, *cos_sin, norm, 1e-6, interleaved, pool.cache,
                                             plan.write_pages, plan.write_rows)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the rotation rounds once here, three times in torch
    torch.testing.assert_close(got_q.float(), want_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_rows.float(), want_rows.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(pool.cache.float(), want_cache.float(), rtol=tol, atol=tol)
    untouched = torch.ones(pool.cache.shape[:2], dtype=torch.bool, device=DEVICE)  # page -1's row 1 among them
    untouched[plan.write_pages[keep], plan.write_rows[keep]] = False
    assert torch.equal(pool.cache[untouched], want_cache[untouched])


def test_width_mismatch_is_refused_with_the_values():
    pool = LatentPool("page-major", 4, 4, 48, torch.float32)
    q = _query(2, 4, 40, torch.float32)
    with pytest.raises(ValueError, match="40 wide and cache rows 48, with kv_lora_rank 32"):
        triton_mla.decode_attention(q, pool.cache, _ints([[0], [1]]), _ints([1, 2]), 32, 0.1, 1)
    with pytest.raises(ValueError, match="latent_rows: rows 40 wide into a cache of 48-wide rows"):
        triton_mla.latent_rows(q[:, 0], q[:, :, 32:], *(torch.ones(2, 1, 4, device=DEVICE),) * 2,
                               torch.ones(32, device=DEVICE), 1e-6, False, pool.cache, _ints([0, 1]), _ints([0, 0]))


@pytest.mark.skipif(INTERPRET, reason="DeepSeek's shapes are too slow for the interpreter")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_heads", [16, 128])
def test_real_shapes_on_cuda(layout, num_heads):
    dtype = torch.bfloat16
    _check_decode(layout, 16, [1, 17, 1000, 4097], dtype, num_heads=num_heads, latent_dim=512, rope_dim=64,
                  num_padding=1)
    _check_extend(layout, 16, [0, 4, 1000], [700, 4, 300], dtype, num_heads=num_heads, latent_dim=512, rope_dim=64)


@pytest.mark.parametrize("preset", ["deepseek-v2-tiny", "deepseek-v3-tiny"])
def test_tiny_deepseek_on_the_triton_backend_equals_torch(tmp_path, preset):
    """The whole tiny DeepSeek (MLA through the kernels, its MoE through ``fused_moe``) on the triton
    backend gives the torch backend's greedy tokens, logits and latent rows: a batched prefill, three
    decode steps, then a 3-token extend beside a decode step."""
    from kvferry.common.layers.attn_backend import TritonBackend
    from kvferry.common.models.llama import SeqChunk
    from kvferry.common.models.loader import load_model
    from kvferry.common.models.tiny import make_tiny_model

    target, _ = make_tiny_model(tmp_path, seed=3, preset=preset)
    model = load_model(target, dtype=torch.float32, device=DEVICE)
    prompts, pages = [[11, 200, 37, 5, 480], [9, 9, 301, 44, 17, 250, 3, 8, 90]], [[6, 1, 4], [0, 5, 2, 7]]
    runs = {}
    for backend in (TorchBackend(), TritonBackend(torch.device(DEVICE), 1)):
        model.attn = backend
        kv = type(model).make_kv_cache(model.config, 8, 4, torch.float32, DEVICE)
        seqs = [list(p) for p in prompts]
        logits = [model.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], kv)]
        for _ in range(3):
            for seq, row in zip(seqs, logits[-1]):
                seq.append(int(row.argmax()))
            logits.append(model.forward([SeqChunk(s[-1:], len(s) - 1, pg) for s, pg in zip(seqs, pages)], kv))
        extend = [SeqChunk([7, 8, 9], len(seqs[0]), pages[0]), SeqChunk([5], len(seqs[1]), pages[1])]
        logits.append(torch.cat(model.forward(extend, kv, all_logits=True)))
        runs[backend.name] = (seqs, logits, kv.buffer.clone())
    (seqs, logits, buffer), (want_seqs, want_logits, want_buffer) = runs["triton"], runs["torch"]
    assert seqs == want_seqs
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(buffer, want_buffer, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens_per_seq", [1, 4])
def test_tiny_deepseek_graph_bucket_with_padding_rows_equals_eager(tmp_path, tokens_per_seq):
    """What a CUDA graph replays, run eagerly: a bucket of 4 over ``cuda_graph``'s static plan, 3
    sequences and a padding one (page -1, kv_len 0, q 0), decode (q = 1) or verify (q = 4), gives the
    torch backend's logits for the 3 and stores the rows that backend stores, nothing for the padding."""
    import numpy as np

    from kvferry.common.engine.cuda_graph import graph_inputs, static_plan
    from kvferry.common.layers.attn_backend import TritonBackend
    from kvferry.common.models.llama import SeqChunk
    from kvferry.common.models.loader import load_model
    from kvferry.common.models.tiny import make_tiny_model

    target, _ = make_tiny_model(tmp_path, seed=5, preset="deepseek-v3-tiny")
    model = load_model(target, dtype=torch.float32, device=DEVICE)
    kv = type(model).make_kv_cache(model.config, 12, 4, torch.float32, DEVICE)
    prompts = [[11, 200, 37, 5, 480], [9, 9, 301, 44, 17, 250, 3, 8, 90], [70, 71, 72]]
    pages = [[6, 1, 4], [0, 5, 2, 8], [9, 3]]
    model.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], kv)
    before = kv.buffer.clone()
    step = [SeqChunk([7, 8, 9, 10][:tokens_per_seq], len(p), pg) for p, pg in zip(prompts, pages)]
    batch, is_verify = 4, tokens_per_seq > 1
    token_inputs, seq_inputs, table = graph_inputs(step, kv.page_size, batch)
    page_table = np.zeros((batch, table.shape[1]), np.int64)
    page_table[:len(step)] = table
    last_index = torch.arange(1, batch + 1, device=DEVICE) * tokens_per_seq - 1
    model.attn = TritonBackend(torch.device(DEVICE), 1)
    token_ids, plan = static_plan(*(torch.from_numpy(a).to(DEVICE) for a in (token_inputs, seq_inputs, page_table)),
                                  last_index, tokens_per_seq, model.attn.num_splits(batch))
    got = model.run(token_ids, plan, kv, all_logits=is_verify)
    stored = kv.buffer.clone()
    kv.buffer.copy_(before)
    model.attn = TorchBackend()
    want = model.forward(step, kv, all_logits=is_verify)
    for got_rows, want_rows in zip(got[:len(step)], want):
        torch.testing.assert_close(got_rows, want_rows, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(stored, kv.buffer, rtol=1e-5, atol=1e-5)


def test_tiny_deepseek_expanded_prefill_on_triton_plans_equals_torch(tmp_path):
    """MLA's expanded form (``mla.py``) over the triton backend's eager plans: the cached prefix
    gathered through the page table, beside a plain prompt, gives the torch backend's absorbed
    logits and latent rows (forced expanded: at the tiny widths the cost estimate is a tie)."""
    from kvferry.common.layers.attn_backend import TritonBackend
    from kvferry.common.models.llama import SeqChunk
    from kvferry.common.models.loader import load_model
    from kvferry.common.models.tiny import make_tiny_model

    target, _ = make_tiny_model(tmp_path, seed=6, preset="deepseek-v2-tiny")
    model = load_model(target, dtype=torch.float32, device=DEVICE)
    rng = random.Random(6)
    first, second, other = ([rng.randrange(5, 500) for _ in range(n)] for n in (19, 18, 21))
    pages = [[9, 2, 14, 0, 7, 11, 3, 12, 5, 1], [4, 13, 6, 10, 8, 15]]
    runs = {}
    for backend, form in ((TorchBackend(), "absorbed"), (TritonBackend(torch.device(DEVICE), 1), "expanded")):
        model.attn = backend
        for layer in model.layers:
            layer.self_attn.form = form
        kv = type(model).make_kv_cache(model.config, 16, 4, torch.float32, DEVICE)
        logits = model.forward([SeqChunk(first, 0, pages[0])], kv, all_logits=True)
        logits += model.forward([SeqChunk(second, 19, pages[0]), SeqChunk(other, 0, pages[1])], kv, all_logits=True)
        runs[form] = (torch.cat(logits), kv.buffer.clone())
    for layer in model.layers:
        layer.self_attn.form = "auto"
    (got, stored), (want, want_stored) = runs["expanded"], runs["absorbed"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(stored, want_stored, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_absorbed_query_and_latent_rows_in_one_launch(interleaved, dtype):
    """``triton_absorb.absorb_q_rows`` (one grid: the absorbed query's tiles, then a program a token for
    its latent row) against ``latent_rows`` then ``absorb_q`` (two launches) and against the torch
    composition (``TorchBackend.mla_absorb_q_rows``): the query, the cache rows stored, page -1 skipped.
    5 heads, a latent of two 128-column blocks (the second partial), 3 tokens."""
    from types import SimpleNamespace

    from kvferry.common.kernels import triton_absorb
    from kvferry.common.layers.mla import LatentRope

    heads, nope, rope_dim, latent, num_tokens = 5, 24, 16, 160, 3
    g = torch.Generator().manual_seed(11)
    kv_b = (torch.randn(heads, nope + 20, latent, generator=g) / latent ** 0.5).to(dtype).to(DEVICE)
    w_uk = kv_b[:, :nope]
    proj = torch.randn(num_tokens, heads * (nope + rope_dim) + latent + rope_dim, generator=g).to(dtype).to(DEVICE)
    q, kv_a = proj.split([heads * (nope + rope_dim), latent + rope_dim], -1)  # views of one GEMM's rows
    q_nope, q_pe = q.view(num_tokens, heads, -1).split([nope, rope_dim], -1)
    norm = (1 + 0.2 * torch.randn(latent, generator=g)).to(dtype).to(DEVICE)
    angles = torch.rand(num_tokens, 1, rope_dim // 2, generator=g) * 6
    cos_sin = (angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE))
    rotary = SimpleNamespace(is_interleaved=interleaved)
    rotary.apply = lambda x, cos, sin: LatentRope.apply(rotary, x, cos, sin)
    plan = SimpleNamespace(write_pages=_ints([2, -1, 5]), write_rows=_ints([1, 0, 3]))
    pools = [LatentPool("page-major", 8, 4, latent + rope_dim, dtype) for _ in range(3)]
    for pool in pools[1:]:
        pool.cache.copy_(pools[0].cache)
    before = pools[0].cache.clone()
    got = triton_absorb.absorb_q_rows(q_nope, w_uk, q_pe, kv_a, *cos_sin, norm, 1e-6, interleaved, pools[0].cache,
                                      plan.write_pages, plan.write_rows)
    roped, _ = triton_mla.latent_rows(kv_a, q_pe, *cos_sin, norm, 1e-6, interleaved, pools[1].cache,
                                      plan.write_pages, plan.write_rows)
    two = triton_absorb.absorb_q(q_nope, w_uk, roped)
    torch.testing.assert_close(got.float(), two.float(), rtol=0, atol=0 if INTERPRET else 2**-7)
    assert torch.equal(pools[0].cache, pools[1].cache)  # the same helper makes the rows
    want = TorchBackend().mla_absorb_q_rows(q_nope, w_uk, q_pe, kv_a, cos_sin, norm, 1e-6, rotary, pools[2].cache,
                                            plan)
    tol = 1e-5 if dtype == torch.float32 else 2 * TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # (torch's index_put_ takes page -1 for the last page, 7: the torch path's plans have no padding rows)
    torch.testing.assert_close(pools[0].cache[:7].float(), pools[2].cache[:7].float(), rtol=tol, atol=tol)
    untouched = torch.ones(8, 4, dtype=torch.bool, device=DEVICE)  # all but (2, 1) and (5, 3): page -1 stores nothing
    untouched[2, 1] = untouched[5, 3] = False
    assert torch.equal(pools[0].cache[untouched], before[untouched])


def test_absorbed_query_and_rows_refuse_a_kv_a_of_the_wrong_width():
    from kvferry.common.kernels import triton_absorb

    with pytest.raises(ValueError, match=r"absorb_q_rows: kv_a \(2, 40\) and cache rows 48 wide, want \[2, 48\]"):
        triton_absorb.absorb_q_rows(torch.zeros(2, 4, 8), torch.zeros(4, 8, 32), torch.zeros(2, 4, 16),
                                    torch.zeros(2, 40), *(torch.ones(2, 1, 8),) * 2, torch.ones(32), 1e-6, False,
                                    torch.zeros(4, 4, 48), _ints([0, 1]), _ints([0, 0]))
