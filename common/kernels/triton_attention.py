"""Paged attention in Triton: K/V read straight from the KV pool through page tables, no gather.

Three kernels, each checked against the torch path (``common/layers/attention.py``) in ``tests/gpu``:

- ``store_kv``: token t's K/V [Hkv, D] goes to row ``rows[t]`` of page ``pages[t]``; a negative
  page skips the token (padding rows of a CUDA graph bucket).
- ``decode_attention``: one query token per sequence, at position ``kv_lens[b] - 1``. Split-K: each
  (sequence, KV head, split) program scores its share of the context for all the query heads of
  its KV head (GQA folded into the tile's rows), then a second kernel merges the splits by their
  log-sum-exp. The number of splits is fixed per batch size, so a CUDA graph can capture it; each
  split's range comes from ``kv_lens`` at run time, at least ``MIN_SPLIT_KEYS`` keys, so a short
  context runs fewer splits (the merge reads only those). An unsplit batch (one split) stores its
  output from the split kernel; no merge runs.
- ``extend_attention``: several query tokens per sequence after ``prefix_lens[b]`` cached ones,
  causal over prefix + themselves (chunked prefill, spec-dec verify, plain prefill when the prefix
  is 0). Their K/V must already be stored in the pages.

An FP8 (e4m3) pool is quantized in the store (times 1 / scale, clamped to +-448, cast) and
dequantized in registers right after each page load (times scale, cast to q's dtype), as
``common/kernels/kv_quant.py`` does in torch; ``k_scale``/``v_scale`` are the layer's scales.

A cache is a ``[num_pages, page_size, Hkv, D]`` view of the pool; both ``--kv-layout`` values give
such a view (only the page stride differs), so the kernels take strides and never copy. Offsets are
int64: a page-major 8B pool is far over 2**31 elements. SGLang's Triton backend
(``srt/layers/attention/triton_ops/decode_attention.py``, ``extend_attention.py``) is the public
design these follow; the code is our own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvferry.common.kernels.kv_quant import FP8_E4M3_MAX, is_quantized
from kvferry.common.kernels.pdl import enter as pdl_enter, kw as pdl_kw
from kvferry.common.kernels.quant_rows import TokenQuantized
from kvferry.common.kernels.split_sum import counters as sum_counters, last_of
from kvferry.common.kernels.triton_fp8_gemm import quantize_row

# A finite "minus infinity" for running maxima: exp(m_old - m_new) stays 0 or 1, never NaN.
_NEG = tl.constexpr(-1.0e30)
_LOG2E = 1.4426950408889634
FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def quantize_tile(x, inv_scale, out_ty: tl.constexpr, QUANT: tl.constexpr):
    """x as the pool stores it: saturate(x * inv_scale) for an FP8 pool (QUANT), else a plain cast."""
    if QUANT:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -FP8_MAX), FP8_MAX)
    return x.to(out_ty)


@triton.jit
def _dequantize(tile, scale, out_ty: tl.constexpr, QUANT: tl.constexpr):
    """A tile loaded from the pool as attention sees it (FP8: times its scale, in out_ty)."""
    if QUANT:
        tile = (tile.to(tl.float32) * scale).to(out_ty)
    return tile


@triton.jit
def _store_kv_kernel(k, v, k_cache, v_cache, pages, rows, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cp, stride_cr, stride_ch, k_inv_scale, v_inv_scale, NUM_HEADS: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
                     PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    t = tl.program_id(0)
    page = tl.load(pages + t).to(tl.int64)
    if page >= 0:
        row = tl.load(rows + t).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
        dst = page * stride_cp + row * stride_cr + h[:, None] * stride_ch + d[None, :]
        k_row = tl.load(k + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v_row = tl.load(v + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(k_cache + dst, quantize_tile(k_row, k_inv_scale, k_cache.dtype.element_ty, QUANT), mask=mask)
        tl.store(v_cache + dst, quantize_tile(v_row, v_inv_scale, v_cache.dtype.element_ty, QUANT), mask=mask)


# The page table's row stride is its width, the longest sequence's page count: a value Triton would
# specialize on (divisible by 16 or not), compiling the kernel again the first time a batch's width
# changes class; a prefix-cache hit changes the widths a prefill sees from one turn to the next.
@triton.jit(do_not_specialize=["stride_pb", "num_splits"])
def _decode_split_kernel(q, k_cache, v_cache, page_table, kv_lens, mid_o, mid_lse, stride_qb, stride_qh,
                         stride_cp, stride_cr, stride_ch, stride_pb, scale_log2, window, num_splits,
                         k_scale, v_scale, o, stride_ob, stride_oh, oq, oq_scale, counts, GROUP: tl.constexpr,
                         PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
                         MIN_SPLIT: tl.constexpr = 0, DIRECT: tl.constexpr = 0, ROW: tl.constexpr = 0,
                         PDL: tl.constexpr = 0):
    """MIN_SPLIT (a multiple of BLOCK_N): a split covers at least this many keys, so a short context
    uses fewer of the num_splits programs: those past the context return at once, and the merge
    reads only the splits in use (``_split_len``). DIRECT (one split): the program stores the
    output itself, in o's dtype; no merge runs. ROW (DIRECT, o contiguous, a power of two >= the
    Hq * D of a row): the last of a sequence's KV-head programs (``split_sum.last_of``, counts in
    ``counts``) also quantizes the sequence's whole output row per token into oq [B, Hq * D] e4m3 and
    oq_scale [B] (``per_token_quant``'s arithmetic), for the W8A8 o_proj that reads it."""
    pdl_enter(PDL)
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_len = tl.load(kv_lens + b).to(tl.int32)
    split_len = _split_len(kv_len, num_splits, BLOCK_N, MIN_SPLIT)
    lo = split * split_len
    if MIN_SPLIT > 0 and lo >= kv_len and split > 0:
        return
    hi = tl.minimum(lo + split_len, kv_len)
    if window > 0:  # the one query sits at kv_len - 1 and sees keys > kv_len - 1 - window
        lo = tl.maximum(lo, kv_len - window)
    g = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q_tile = tl.load(q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    m_i = tl.full([BLOCK_H], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        page = tl.load(page_table + b * stride_pb + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        offs = page * stride_cp + (n % PAGE_SIZE).to(tl.int64) * stride_cr + kv_head * stride_ch
        kv_mask = n_mask[:, None] & (d[None, :] < HEAD_DIM)
        k_tile = _dequantize(tl.load(k_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0), k_scale,
                             q_tile.dtype, QUANT)
        s = tl.dot(q_tile, tl.trans(k_tile), input_precision=PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_tile = _dequantize(tl.load(v_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0), v_scale,
                             q_tile.dtype, QUANT)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
        m_i = m_new
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), _NEG)  # log2 units
    if DIRECT:
        tl.store(o + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(o.dtype.element_ty), mask=q_mask)
        if ROW > 0:
            if last_of(counts, b, tl.num_programs(1)):
                width = GROUP * tl.num_programs(1) * HEAD_DIM
                cols = tl.arange(0, ROW)
                row_ok = cols < width
                v = tl.load(o + b * stride_ob + cols, mask=row_ok, other=0.0, cache_modifier=".cg")
                quantize_row(v, oq + b * width, oq_scale, b, cols, row_ok)
    else:
        base = (b * GROUP * tl.num_programs(1) + heads) * num_splits + split  # mid_o: [B, Hq, num_splits, D]
        tl.store(mid_o + base[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
        tl.store(mid_lse + base, lse, mask=g < GROUP)


@triton.jit
def _split_len(kv_len, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """The keys each split of a kv_len context covers: whole BLOCK_N steps, at least MIN_SPLIT."""
    return tl.maximum(tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT)


@triton.jit
def _decode_merge_kernel(mid_o, mid_lse, o, stride_ob, stride_oh, num_splits, kv_lens, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr = 0, MIN_SPLIT: tl.constexpr = 0,
                         BLOCK_S: tl.constexpr = 0, PDL: tl.constexpr = 0):
    """MIN_SPLIT > 0: only the splits the split kernel ran for sequence b's length (its BLOCK_N and
    MIN_SPLIT); else all num_splits (``kv_lens`` unread). BLOCK_S (a power of two >= num_splits): the
    splits are loaded as one [BLOCK_S, BLOCK_D] tile and weighted by their maximum, so the loads do
    not wait on each other; 0: one split after another, each rescaling the running sum."""
    pdl_enter(PDL)
    b, head = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    base = (b * tl.num_programs(1) + head) * num_splits
    used = num_splits
    if MIN_SPLIT > 0:
        kv_len = tl.load(kv_lens + b).to(tl.int32)
        used = tl.minimum(tl.cdiv(kv_len, _split_len(kv_len, num_splits, BLOCK_N, MIN_SPLIT)), num_splits)
    if BLOCK_S > 0:
        s = tl.arange(0, BLOCK_S)
        s_ok = s < used
        lse = tl.load(mid_lse + base + s, mask=s_ok, other=_NEG)
        weight = tl.where(lse > _NEG, tl.exp2(lse - tl.max(lse, 0)), 0.0)  # [BLOCK_S]
        parts = tl.load(mid_o + (base + s)[:, None] * HEAD_DIM + d[None, :],
                        mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        acc = tl.sum(parts * weight[:, None], 0)
        total = tl.sum(weight, 0)
    else:
        m = -1.0e30
        total = 0.0
        acc = tl.zeros([BLOCK_D], tl.float32)
        for split in range(used):
            lse = tl.load(mid_lse + base + split)
            part = tl.load(mid_o + (base + split) * HEAD_DIM + d, mask=d < HEAD_DIM, other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            weight = tl.where(lse > _NEG, tl.exp2(lse - m_new), 0.0)
            acc = acc * alpha + weight * part
            total = total * alpha + weight
            m = m_new
    out = acc / tl.where(total > 0, total, 1.0)  # a padding row (kv_len 0) gets zeros
    tl.store(o + b * stride_ob + head * stride_oh + d, out.to(o.dtype.element_ty), mask=d < HEAD_DIM)


MERGE_TILE = True  # the merge loads every split at once (BLOCK_S); False: the loop (bench/engine.py --merge-ab)


def merge_splits(num_splits: int) -> int:
    """The merge kernel's BLOCK_S for ``num_splits``: the next power of two, or 0 (the loop)."""
    return triton.next_power_of_2(num_splits) if MERGE_TILE else 0


@triton.jit(do_not_specialize=["stride_pb"])
def _extend_kernel(q, o, k_cache, v_cache, page_table, q_starts, q_lens, prefix_lens, stride_qt, stride_qh,
                   stride_ot, stride_oh, stride_cp, stride_cr, stride_ch, stride_pb, scale_log2, window,
                   k_scale, v_scale, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                   QUANT: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    b, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // GROUP
    q_len = tl.load(q_lens + b).to(tl.int32)
    q_start = tl.load(q_starts + b).to(tl.int64)
    prefix = tl.load(prefix_lens + b).to(tl.int32)
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < q_len
    q_pos = prefix + m
    tile_mask = m_mask[:, None] & (d[None, :] < HEAD_DIM)
    rows = q_start + m.to(tl.int64)
    q_tile = tl.load(q + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=tile_mask, other=0.0)
    # Keys this block can see: causal up to its last row; with a window, from its first row's edge.
    hi = tl.minimum(prefix + q_len, prefix + (block + 1) * BLOCK_M)
    hi = tl.where(block * BLOCK_M < q_len, hi, 0)
    lo = prefix * 0
    if window > 0:
        lo = tl.maximum(prefix + block * BLOCK_M - window + 1, 0)
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        page = tl.load(page_table + b * stride_pb + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        offs = page * stride_cp + (n % PAGE_SIZE).to(tl.int64) * stride_cr + kv_head * stride_ch
        kv_mask = n_mask[:, None] & (d[None, :] < HEAD_DIM)
        k_tile = _dequantize(tl.load(k_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0), k_scale,
                             q_tile.dtype, QUANT)
        s = tl.dot(q_tile, tl.trans(k_tile), input_precision=PRECISION) * scale_log2
        allowed = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        if window > 0:
            allowed = allowed & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_tile = _dequantize(tl.load(v_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0), v_scale,
                             q_tile.dtype, QUANT)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o + rows[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(o.dtype.element_ty),
             mask=tile_mask)


def _precision(dtype: torch.dtype) -> str:
    # fp32 models are the exact reference path: no tf32 rounding inside tl.dot (q's dtype decides:
    # an FP8 pool is dequantized to it before each dot)
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "K and V views must share strides"


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             pages: torch.Tensor, rows: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [T, Hkv, D] (any row stride, last dim contiguous) into k_cache, v_cache
    [num_pages, page_size, Hkv, D]; pages, rows: [T] int (page < 0: skip); an FP8 pool stores them
    quantized by ``k_scale``/``v_scale``."""
    _check_caches(k_cache, v_cache)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, pages, rows, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), 1.0 / k_scale, 1.0 / v_scale, NUM_HEADS=num_heads,
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=is_quantized(k_cache.dtype), **pdl_kw())


class DecodeTiles(NamedTuple):
    """The split kernel's tiles: keys a step, warps, pipeline stages, and the fewest keys a split
    takes (``MIN_SPLIT``; 0: none) (``bench/attn_tune.py`` sweeps them)."""
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    min_split: int = 0


MIN_SPLIT_KEYS = 128  # the fewest keys a split takes when the context is split


def decode_tiles(block_d: int, num_splits: int) -> DecodeTiles:
    """The H100 and H200 sweeps' tiles (``bench/attn_tune.py``, 8B shapes, bench/RESULTS.md): one
    split (a batch that fills the GPU by itself) 64 keys a step, 3 stages; a split context 128 keys,
    3 stages, splits of at least ``MIN_SPLIT_KEYS`` (a 1k context at batch 1: 8 of its 32 splits
    run, 8k: all 32). Heads wider than 128: 32 keys, 2 stages (registers)."""
    if block_d > 128:
        return DecodeTiles(block_n=32, min_split=MIN_SPLIT_KEYS)
    if num_splits == 1:
        return DecodeTiles(block_n=64, num_stages=3)
    return DecodeTiles(block_n=128, num_stages=3, min_split=MIN_SPLIT_KEYS)


def num_decode_splits(batch: int, num_kv_heads: int, num_sms: int, per_sm: int = 2) -> int:
    """Splits of the context per (sequence, KV head): about ``per_sm`` programs per SM, 1..32 (past
    that a batch runs unsplit, its output stored by the split kernel, no merge); depends only on the
    batch size, so a graph captured for a batch bucket keeps it."""
    return max(1, min(32, -(-per_sm * num_sms // max(1, batch * num_kv_heads))))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     kv_lens: torch.Tensor, scale: float, window: int | None, num_splits: int,
                     k_scale: float = 1.0, v_scale: float = 1.0, tiles: DecodeTiles | None = None,
                     quant: bool = False) -> torch.Tensor | TokenQuantized:
    """q: [B, Hq, D] (the token at position kv_lens[b] - 1, K/V already stored); page_table:
    [B, max_pages] int; kv_lens: [B] int (0: padding row, output 0) -> [B, Hq, D] in q's dtype.
    ``scale``: the softmax scale; ``k_scale``/``v_scale``: an FP8 pool's; ``tiles``: the split
    kernel's (``decode_tiles`` by default). One split: no merge (the split kernel stores the output),
    and with ``quant`` (and ``QUANT_OUT``) the output comes as ``TokenQuantized`` rows [B, Hq * D],
    quantized per token in the same launch; else as the tensor."""
    _check_caches(k_cache, v_cache)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    direct = num_splits == 1
    mid_o = torch.empty(batch, num_heads, 0 if direct else num_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, 0 if direct else num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    quant = quant and direct and QUANT_OUT and batch > 0
    width = num_heads * head_dim
    oq = torch.empty(batch, width, dtype=torch.float8_e4m3fn, device=q.device) if quant else out
    oq_scale = torch.empty(batch, 1, dtype=torch.float32, device=q.device) if quant else out
    block_d = max(16, triton.next_power_of_2(head_dim))
    tiles = tiles or decode_tiles(block_d, num_splits)
    min_split = -(-tiles.min_split // tiles.block_n) * tiles.block_n
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, kv_lens, mid_o, mid_lse, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0), scale * _LOG2E,
        window or 0, num_splits, k_scale, v_scale, out, out.stride(0), out.stride(1), oq, oq_scale,
        sum_counters(q.device, batch) if quant else out, GROUP=group,
        PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_N=tiles.block_n, PRECISION=_precision(q.dtype), QUANT=is_quantized(k_cache.dtype),
        MIN_SPLIT=min_split, DIRECT=direct, ROW=triton.next_power_of_2(width) if quant else 0,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_kw())
    if not direct:
        _decode_merge_kernel[(batch, num_heads)](mid_o, mid_lse, out, out.stride(0), out.stride(1), num_splits, kv_lens,
                                                 HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=tiles.block_n,
                                                 MIN_SPLIT=min_split, BLOCK_S=merge_splits(num_splits), **pdl_kw())
    return TokenQuantized(out.view(batch, width), oq, oq_scale) if quant else out


# True (the default): an unsplit decode attention asked for ``quant`` hands o_proj its rows quantized per token from
# the same launch; False: o_proj's linear runs the token quant kernel (bench/engine.py --attn-quant-ab)
QUANT_OUT = True


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     q_starts: torch.Tensor, q_lens: torch.Tensor, prefix_lens: torch.Tensor, max_query: int,
                     scale: float, window: int | None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q: [T, Hq, D] packed, sequence b's rows at [q_starts[b], + q_lens[b]) and positions
    prefix_lens[b] + i (their K/V already stored) -> [T, Hq, D]; ``k_scale``/``v_scale``: an FP8 pool's."""
    _check_caches(k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    batch = q_lens.shape[0]
    block_d = max(16, triton.next_power_of_2(head_dim))
    is_wide = q.dtype == torch.float32 or block_d > 128
    block_m = 16 if max_query <= 16 else (64 if is_wide else 128)
    block_n = 32 if is_wide else 64
    out = torch.empty_like(q)
    _extend_kernel[(batch, num_heads, triton.cdiv(max_query, block_m))](
        q, out, k_cache, v_cache, page_table, q_starts, q_lens, prefix_lens, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0),
        scale * _LOG2E, window or 0, k_scale, v_scale, GROUP=num_heads // num_kv_heads, PAGE_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=_precision(q.dtype),
        QUANT=is_quantized(k_cache.dtype), num_warps=8 if block_m == 128 else 4, num_stages=2, **pdl_kw())
    return out
