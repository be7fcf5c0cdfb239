"""Multi-head latent attention (DeepSeek-V2/V3, absorbed form) in Triton over the paged latent cache.

A cache row is ``[c (L = kv_lora_rank) | k_pe (R = qk_rope_head_dim)]`` per token
(``common/cache/mla_cache.py``), a query ``[q_latent (L) | q_pe (R)]`` per head
(``common/layers/mla.py``)::

    score[h, n] = (q_latent[h] . c[n] + q_pe[h] . k_pe[n]) * scale
    out[h]      = softmax_n(score[h]) @ c                    # [H, L]

Every head reads the same row, so a latent tile, once loaded, serves a whole block of heads: for
the score and again as the value. L and R are loaded as two tiles (L + R = 576 is no power of two,
one tile would be padded to 1024). Three kernels, checked against the torch path
(``TorchBackend.mla_attend``: ``attention.paged_attention`` over the latent as one KV head) in
``tests/gpu/test_triton_mla.py``:

- ``latent_rows``: token t's cache row [L + R] made from kv_a_proj's output (RMSNorm of the
  latent, rope of k_pe) and stored at row ``slots[t]`` of page ``pages[t]`` (a negative page skips
  the token: padding rows of a CUDA graph bucket), and its q_pe roped, in one launch.
- ``decode_attention``: one query token per sequence, at position ``kv_lens[b] - 1``. Split-K: a
  program per (sequence, block of heads, split) scores its share of the context for those heads,
  then ``triton_attention``'s merge kernel combines the splits by their log-sum-exp. The split count
  depends on the batch size only (a CUDA graph keeps it); a split's range comes from ``kv_lens``.
- ``extend_attention``: several query tokens per sequence after ``prefix_lens[b]`` cached ones,
  causal (prefill, chunked prefill, spec-dec verify). The tile's rows are (token, head) pairs,
  token-major, so a verify step's few tokens still fill a tile with heads, and a tile reads the
  keys up to its last token only. The new rows must already be stored.

The cache is a ``[num_pages, page_size, L + R]`` view of the pool (both ``--kv-layout`` values:
only the page stride differs), addressed through its strides with int64 offsets, never copied.
SGLang's Triton MLA decode (``decode_attention.py``'s grouped kernel) is the public design the
decode follows; the code is our own. Model-dtype pools only (``make_kv_cache`` refuses FP8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvferry.common.kernels.pdl import enter as pdl_enter, kw as pdl_kw

# the dense kernels' constants, dot precision and split merge (the merge is per head and width-blind)
from kvferry.common.kernels.triton_attention import (_LOG2E, _NEG, DecodeTiles, _decode_merge_kernel, _precision,
                                                      _split_len, merge_splits)


@triton.jit
def _rope_pair(src, cos, sin, j, mask, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The rotated halves (fp32) of the rope part at ``src`` [.., R]: pairs (2j, 2j + 1) when
    INTERLEAVED, else (j, j + R/2); ``cos``/``sin`` [.., R/2] broadcast against them."""
    if INTERLEAVED:
        x1 = tl.load(src + 2 * j, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + 2 * j + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(src + j, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + j, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _latent_row(kv_a, cos, sin, norm, rows, cache, pages, slots, eps, t, stride_kv, stride_rt, stride_cp, stride_cr,
                LATENT: tl.constexpr, HALF: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_HALF: tl.constexpr,
                INTERLEAVED: tl.constexpr, STORE: tl.constexpr, WRITE_ROWS: tl.constexpr):
    """Token t's cache row [rms_norm(latent) | roped k_pe] from kv_a's row: written to ``rows`` (WRITE_ROWS)
    and stored at (pages[t], slots[t]) (STORE; a negative page skips it). Returns (cos, sin) of t, fp32."""
    ty = kv_a.dtype.element_ty
    src = kv_a + t * stride_kv
    lat = tl.arange(0, BLOCK_L)
    lat_ok = lat < LATENT
    x = tl.load(src + lat, mask=lat_ok, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / LATENT + eps)
    w = tl.load(norm + lat, mask=lat_ok, other=0.0).to(tl.float32)
    latent = (w * (x * r).to(ty).to(tl.float32)).to(ty)  # as norm.rms_norm rounds
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    c = tl.load(cos + t * HALF + j, mask=j_ok, other=0.0).to(tl.float32)
    s = tl.load(sin + t * HALF + j, mask=j_ok, other=0.0).to(tl.float32)
    k1, k2 = _rope_pair(src + LATENT, c, s, j, j_ok, HALF, INTERLEAVED)
    if WRITE_ROWS:
        dst = rows + t * stride_rt
        tl.store(dst + lat, latent, mask=lat_ok)
        tl.store(dst + LATENT + j, k1.to(ty), mask=j_ok)
        tl.store(dst + LATENT + HALF + j, k2.to(ty), mask=j_ok)
    if STORE:
        page = tl.load(pages + t).to(tl.int64)
        if page >= 0:
            row = cache + page * stride_cp + tl.load(slots + t).to(tl.int64) * stride_cr
            cache_ty = cache.dtype.element_ty
            tl.store(row + lat, latent.to(cache_ty), mask=lat_ok)
            tl.store(row + LATENT + j, k1.to(ty).to(cache_ty), mask=j_ok)
            tl.store(row + LATENT + HALF + j, k2.to(ty).to(cache_ty), mask=j_ok)
    return c, s


@triton.jit
def _latent_rows_kernel(kv_a, q_pe, cos, sin, norm, rows, q_out, cache, pages, slots, eps, stride_kv, stride_qt,
                        stride_qh, stride_rt, stride_ot, stride_oh, stride_cp, stride_cr, NUM_HEADS: tl.constexpr,
                        LATENT: tl.constexpr, HALF: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr, STORE: tl.constexpr,
                        PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c, s = _latent_row(kv_a, cos, sin, norm, rows, cache, pages, slots, eps, t, stride_kv, stride_rt, stride_cp,
                       stride_cr, LATENT, HALF, BLOCK_L, BLOCK_HALF, INTERLEAVED, STORE, True)
    j = tl.arange(0, BLOCK_HALF)
    h = tl.arange(0, BLOCK_H)
    hj_ok = (h[:, None] < NUM_HEADS) & (j < HALF)[None, :]
    q1, q2 = _rope_pair(q_pe + t * stride_qt + h[:, None] * stride_qh, c[None, :], s[None, :], j[None, :], hj_ok,
                        HALF, INTERLEAVED)
    ty = rows.dtype.element_ty
    q_dst = q_out + t * stride_ot + h[:, None] * stride_oh + j[None, :]
    tl.store(q_dst, q1.to(ty), mask=hj_ok)
    tl.store(q_dst + HALF, q2.to(ty), mask=hj_ok)


def latent_rows(kv_a: torch.Tensor, q_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: torch.Tensor,
                eps: float, interleaved: bool, cache: torch.Tensor | None = None, pages: torch.Tensor | None = None,
                slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's per-token work after the projections, in one launch: kv_a [T, L + R] (kv_a_proj's
    output: latent then k_pe), q_pe [T, H, R] (a strided view is fine), cos/sin [T, 1, R/2], the
    kv_a_layernorm weight [L] -> (roped q_pe [T, H, R], cache rows [T, L + R] = [rms_norm(latent) |
    roped k_pe]); with ``cache``, each row is also stored at (pages[t], slots[t]), a negative page
    skipping the token. The rotation as ``mla.LatentRope.apply`` (interleaved pairs or
    halves, written as halves), once rounded."""
    num_tokens, width = kv_a.shape
    num_heads, rope_dim = q_pe.shape[1], q_pe.shape[2]
    latent_dim, half = width - rope_dim, rope_dim // 2
    if kv_a.stride(-1) != 1 or q_pe.stride(-1) != 1 or (cache is not None and cache.stride(-1) != 1):
        raise ValueError(f"latent_rows: kv_a {tuple(kv_a.shape)} (strides {kv_a.stride()}), q_pe "
                         f"{tuple(q_pe.shape)} (strides {q_pe.stride()}): last strides must be 1")
    if cache is not None and cache.shape[-1] != kv_a.shape[1]:
        raise ValueError(f"latent_rows: rows {kv_a.shape[1]} wide into a cache of {cache.shape[-1]}-wide rows")
    rows = torch.empty(num_tokens, width, dtype=kv_a.dtype, device=kv_a.device)
    q_out = torch.empty(num_tokens, num_heads, rope_dim, dtype=q_pe.dtype, device=q_pe.device)
    if num_tokens == 0:
        return q_out, rows
    store = cache is not None
    _latent_rows_kernel[(num_tokens,)](
        kv_a, q_pe, cos, sin, norm, rows, q_out, cache if store else rows, pages if store else rows,
        slots if store else rows, eps, kv_a.stride(0), q_pe.stride(0), q_pe.stride(1), rows.stride(0),
        q_out.stride(0), q_out.stride(1), cache.stride(0) if store else 0, cache.stride(1) if store else 0,
        NUM_HEADS=num_heads, LATENT=latent_dim, HALF=half, BLOCK_L=triton.next_power_of_2(latent_dim),
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HALF=triton.next_power_of_2(half),
        INTERLEAVED=interleaved, STORE=store, num_warps=4, **pdl_kw())
    return q_out, rows


@triton.jit
def _score(q_lat, q_pe, cache, offs, n_mask, LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr,
           BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    """(scores [rows, BLOCK_N] unscaled, the latent tile [BLOCK_N, BLOCK_L]) of the keys at ``offs``."""
    lat = tl.arange(0, BLOCK_L)
    pe = tl.arange(0, BLOCK_R)
    c_tile = tl.load(cache + offs[:, None] + lat[None, :], mask=n_mask[:, None] & (lat[None, :] < LATENT), other=0.0)
    pe_tile = tl.load(cache + offs[:, None] + LATENT + pe[None, :], mask=n_mask[:, None] & (pe[None, :] < ROPE),
                      other=0.0)
    s = tl.dot(q_lat, tl.trans(c_tile), input_precision=PRECISION)
    s += tl.dot(q_pe, tl.trans(pe_tile), input_precision=PRECISION)
    return s, c_tile


# stride_pb (the page table's width) and num_splits vary from batch to batch: no recompiles for them
@triton.jit(do_not_specialize=["stride_pb", "num_splits"])
def _decode_split_kernel(q, cache, page_table, kv_lens, mid_o, mid_lse, stride_qb, stride_qh, stride_cp, stride_cr,
                         stride_pb, scale_log2, num_splits, NUM_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                         MIN_SPLIT: tl.constexpr = 0, DIRECT: tl.constexpr = 0, PDL: tl.constexpr = 0):
    """MIN_SPLIT and DIRECT as the dense split kernel's: a split covers at least MIN_SPLIT keys (splits
    past the context return at once, the merge reads the others); one split stores [B, H, L] in
    mid_o's dtype itself, no merge."""
    pdl_enter(PDL)
    b, head_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_len = tl.load(kv_lens + b).to(tl.int32)
    split_len = _split_len(kv_len, num_splits, BLOCK_N, MIN_SPLIT)
    lo = split * split_len
    if MIN_SPLIT > 0 and lo >= kv_len and split > 0:
        return
    hi = tl.minimum(lo + split_len, kv_len)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < NUM_HEADS
    lat = tl.arange(0, BLOCK_L)
    pe = tl.arange(0, BLOCK_R)
    q_rows = q + b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + lat[None, :], mask=h_mask[:, None] & (lat[None, :] < LATENT), other=0.0)
    q_pe = tl.load(q_rows + LATENT + pe[None, :], mask=h_mask[:, None] & (pe[None, :] < ROPE), other=0.0)
    m_i = tl.full([BLOCK_H], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        page = tl.load(page_table + b * stride_pb + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        offs = page * stride_cp + (n % PAGE_SIZE).to(tl.int64) * stride_cr
        s, c_tile = _score(q_lat, q_pe, cache, offs, n_mask, LATENT, ROPE, BLOCK_L, BLOCK_R, PRECISION)
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_tile.dtype), c_tile, input_precision=PRECISION)
        m_i = m_new
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    base = (b * NUM_HEADS + heads) * num_splits + split  # mid_o: [B, H, num_splits, L]
    o_mask = h_mask[:, None] & (lat[None, :] < LATENT)
    if DIRECT:
        tl.store(mid_o + base[:, None] * LATENT + lat[None, :], out.to(mid_o.dtype.element_ty), mask=o_mask)
    else:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), _NEG)  # log2 units
        tl.store(mid_o + base[:, None] * LATENT + lat[None, :], out, mask=o_mask)
        tl.store(mid_lse + base, lse, mask=h_mask)


@triton.jit(do_not_specialize=["stride_pb"])
def _extend_kernel(q, o, cache, page_table, q_starts, q_lens, prefix_lens, stride_qt, stride_qh, stride_ot,
                   stride_oh, stride_cp, stride_cr, stride_pb, scale_log2, NUM_HEADS: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                   PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    b, block = tl.program_id(0), tl.program_id(1)
    q_len = tl.load(q_lens + b).to(tl.int32)
    q_start = tl.load(q_starts + b).to(tl.int64)
    prefix = tl.load(prefix_lens + b).to(tl.int32)
    pair = block * BLOCK_M + tl.arange(0, BLOCK_M)  # (token, head) rows, token-major
    token, head = pair // NUM_HEADS, pair % NUM_HEADS
    m_mask = token < q_len
    q_pos = prefix + token
    lat = tl.arange(0, BLOCK_L)
    pe = tl.arange(0, BLOCK_R)
    q_rows = (q_start + token.to(tl.int64)) * stride_qt + head * stride_qh
    q_lat = tl.load(q + q_rows[:, None] + lat[None, :], mask=m_mask[:, None] & (lat[None, :] < LATENT), other=0.0)
    q_pe = tl.load(q + q_rows[:, None] + LATENT + pe[None, :], mask=m_mask[:, None] & (pe[None, :] < ROPE),
                   other=0.0)
    # keys this tile can see: causal up to its last token (a tile past the sequence's rows sees none)
    last_token = tl.minimum((block * BLOCK_M + BLOCK_M - 1) // NUM_HEADS, q_len - 1)
    hi = tl.where(block * BLOCK_M < q_len * NUM_HEADS, prefix + last_token + 1, 0)
    lo = prefix * 0
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        page = tl.load(page_table + b * stride_pb + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        offs = page * stride_cp + (n % PAGE_SIZE).to(tl.int64) * stride_cr
        s, c_tile = _score(q_lat, q_pe, cache, offs, n_mask, LATENT, ROPE, BLOCK_L, BLOCK_R, PRECISION)
        allowed = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_tile.dtype), c_tile, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + token.to(tl.int64)) * stride_ot + head * stride_oh
    tl.store(o + o_rows[:, None] + lat[None, :], out.to(o.dtype.element_ty),
             mask=m_mask[:, None] & (lat[None, :] < LATENT))


def _check(q: torch.Tensor, cache: torch.Tensor, latent_dim: int) -> int:
    """The rope width R; raises ValueError where q and the cache disagree or are not unit-strided."""
    width = cache.shape[-1]
    if q.shape[-1] != width or not 0 < latent_dim < width:
        raise ValueError(f"MLA attention: query rows are {q.shape[-1]} wide and cache rows {width}, with "
                         f"kv_lora_rank {latent_dim}; both must be kv_lora_rank + qk_rope_head_dim")
    if q.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError(f"MLA attention: q strides {q.stride()} and cache strides {cache.stride()} need a unit "
                         "last stride")
    return width - latent_dim


def _blocks(latent_dim: int, rope_dim: int) -> tuple[int, int]:
    return max(16, triton.next_power_of_2(latent_dim)), max(16, triton.next_power_of_2(rope_dim))


def decode_tiles(num_splits: int) -> DecodeTiles:
    """The split kernel's tiles for a 512 + 64 latent row, from an H100 sweep (``bench/attn_tune.py
    --mla``, bench/RESULTS.md): a context split 16 or more ways (batches up to 8) 64 keys a step over
    8 warps, 2 stages, splits of at least 64 keys; fewer splits (a batch that fills the GPU) 32 keys
    over 4 warps, 3 stages, at least 256 keys (at batch 64 and 1k: 4 of its 5 splits)."""
    if num_splits >= 16:
        return DecodeTiles(block_n=64, num_warps=8, num_stages=2, min_split=64)
    return DecodeTiles(block_n=32, num_warps=4, num_stages=3, min_split=256)


def decode_attention(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, kv_lens: torch.Tensor,
                     latent_dim: int, scale: float, num_splits: int, tiles: DecodeTiles | None = None) -> torch.Tensor:
    """q [B, H, L + R] (the token at position kv_lens[b] - 1, its row already stored); cache
    [num_pages, page_size, L + R]; page_table [B, max_pages] int; kv_lens [B] int (0: a padding row,
    output 0) -> [B, H, L] in q's dtype. ``latent_dim`` is L, ``scale`` the softmax scale; ``tiles``
    the split kernel's (``decode_tiles`` by default). One split: no merge."""
    rope_dim = _check(q, cache, latent_dim)
    batch, num_heads, _ = q.shape
    block_l, block_r = _blocks(latent_dim, rope_dim)
    block_h = 16  # tl.dot's smallest tile; more heads per program would cut the splits a batch can use
    tiles = tiles or decode_tiles(num_splits)
    min_split = -(-tiles.min_split // tiles.block_n) * tiles.block_n
    direct = num_splits == 1
    out = q.new_empty(batch, num_heads, latent_dim)
    mid_o = out if direct else torch.empty(batch, num_heads, num_splits, latent_dim, dtype=torch.float32,
                                           device=q.device)
    mid_lse = torch.empty(batch, num_heads, 0 if direct else num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, triton.cdiv(num_heads, block_h), num_splits)](
        q, cache, page_table, kv_lens, mid_o, mid_lse, q.stride(0), q.stride(1), cache.stride(0), cache.stride(1),
        page_table.stride(0), scale * _LOG2E, num_splits, NUM_HEADS=num_heads, PAGE_SIZE=cache.shape[1],
        LATENT=latent_dim, ROPE=rope_dim, BLOCK_H=block_h, BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_N=tiles.block_n,
        PRECISION=_precision(q.dtype), MIN_SPLIT=min_split, DIRECT=int(direct), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **pdl_kw())
    if not direct:
        _decode_merge_kernel[(batch, num_heads)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1), num_splits, kv_lens, HEAD_DIM=latent_dim,
            BLOCK_D=block_l, BLOCK_N=tiles.block_n, MIN_SPLIT=min_split, BLOCK_S=merge_splits(num_splits),
            num_warps=8 if num_splits > 8 else 4, **pdl_kw())
    return out


def extend_attention(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, q_starts: torch.Tensor,
                     q_lens: torch.Tensor, prefix_lens: torch.Tensor, max_query: int, latent_dim: int,
                     scale: float) -> torch.Tensor:
    """q [T, H, L + R] packed, sequence b's rows at [q_starts[b], + q_lens[b]) and positions
    prefix_lens[b] + i (their rows already stored) -> [T, H, L] in q's dtype; a sequence with
    q_lens 0 (padding) reads nothing."""
    rope_dim = _check(q, cache, latent_dim)
    _, num_heads, _ = q.shape
    block_l, block_r = _blocks(latent_dim, rope_dim)
    is_wide = block_l > 128 or q.dtype == torch.float32
    block_m = 32 if is_wide else 64
    out = q.new_zeros(q.shape[:-1] + (latent_dim,))  # rows of padding tokens stay 0, never garbage
    grid = (q_lens.shape[0], triton.cdiv(max_query * num_heads, block_m))
    _extend_kernel[grid](
        q, out, cache, page_table, q_starts, q_lens, prefix_lens, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), cache.stride(0), cache.stride(1), page_table.stride(0), scale * _LOG2E, NUM_HEADS=num_heads,
        PAGE_SIZE=cache.shape[1], LATENT=latent_dim, ROPE=rope_dim, BLOCK_M=block_m, BLOCK_N=32 if is_wide else 64,
        BLOCK_L=block_l, BLOCK_R=block_r, PRECISION=_precision(q.dtype), num_warps=8 if block_l > 128 else 4,
        num_stages=2, **pdl_kw())
    return out
