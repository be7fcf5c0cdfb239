"""An FP8 attention's q/k/v projection with its rotary embedding and K/V store, for the W8A8 decode
rows (17-64).

The unfused step runs the qkv GEMV (``triton_gemv.fp8_gemv``, bf16 [T, (Hq + 2 Hkv) D] out), then
``triton_fused.rope_store``: a few programs a token rotate q and k and store k and v into their
pages (3 µs a layer at 64 rows of Llama-3-8B, bench/RESULTS.md). ``qkv_rope_store`` does both in
the GEMV's launch: each program takes PAIR columns of the low half of one head *and* the same PAIR
columns of its high half (weight rows h D + c and h D + D/2 + c), so its epilogue holds both halves of
the rotation:
- a q head's: rotated into ``q_out`` [T, Hq, D];
- a k head's: rotated, written back into qkv's k columns (as ``rope_store`` rotates k in place) and
  into the K page (quantized by the layer's scale into an FP8 pool);
- a v head's: into qkv's v columns and the V page.
qkv's q columns are not written: ``q_out`` holds q.

Each value is rounded to the model dtype as the GEMV's output is, then rotated in fp32 as
``rope_store``'s ``_rotate`` rotates it (``rotate_pair``): the result is ``fp8_gemv`` then ``rope_store`` bit for bit
(``tests/gpu/test_triton_qkv.py``), where the GEMV's tiles run K whole (``takes``). No q/k norm
(Qwen3's needs a whole head a program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvferry.common.kernels.gemv_tiles import fitted_tiles, fp8_config
from kvferry.common.kernels.kv_quant import is_quantized
from kvferry.common.kernels.pdl import enter as pdl_enter, kw as pdl_kw
from kvferry.common.kernels.triton_attention import quantize_tile
from kvferry.common.kernels.triton_fused import rotate_pair


@triton.jit
def _qkv_rope_kernel(x, x_scale, w, w_scale, qkv, q_out, cos, sin, k_cache, v_cache, pages, page_rows, M, K,
                     stride_xm, stride_wn, stride_om, stride_cp, stride_cr, stride_ch, k_inv_scale, v_inv_scale,
                     NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, PAIR: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr = 0):
    """Program (i, m): head i // (HALF // PAIR), columns c0 + [0, PAIR) of each half, rows m BLOCK_M."""
    pdl_enter(PDL)
    head = tl.program_id(0) // (HALF // PAIR)
    c0 = (tl.program_id(0) % (HALF // PAIR)) * PAIR
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    t = rows.to(tl.int64)
    j = tl.arange(0, PAIR)
    lo_cols = (head * 2 * HALF + c0 + j).to(tl.int64)
    hi_cols = lo_cols + HALF
    ks = tl.arange(0, BLOCK_K)
    x_rows = x + t[:, None] * stride_xm
    acc_lo = tl.zeros((BLOCK_M, PAIR), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, PAIR), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        xv = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_lo = tl.load(w + lo_cols[:, None] * stride_wn + k[None, :], mask=k_ok[None, :], other=0.0)
        w_hi = tl.load(w + hi_cols[:, None] * stride_wn + k[None, :], mask=k_ok[None, :], other=0.0)
        acc_lo += tl.dot(xv, tl.trans(w_lo.to(xv.dtype)))
        acc_hi += tl.dot(xv, tl.trans(w_hi.to(xv.dtype)))
    # _gemv_kernel's epilogue (per-row weight scales, then x's per-row scales), then its output's rounding
    ty = qkv.dtype.element_ty
    xs = tl.load(x_scale + rows, mask=row_ok, other=0.0)[:, None]
    lo = (acc_lo * tl.load(w_scale + lo_cols)[None, :] * xs).to(ty)
    hi = (acc_hi * tl.load(w_scale + hi_cols)[None, :] * xs).to(ty)
    mask = row_ok[:, None] & (j[None, :] < PAIR)
    if head < NUM_Q_HEADS + NUM_KV_HEADS:  # q or k: rotated as _rotate rotates a loaded head
        cos_t, sin_t = cos + t[:, None] * 2 * HALF + c0 + j[None, :], sin + t[:, None] * 2 * HALF + c0 + j[None, :]
        lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
        cos_lo = tl.load(cos_t, mask=mask, other=0.0).to(tl.float32)
        cos_hi = tl.load(cos_t + HALF, mask=mask, other=0.0).to(tl.float32)
        sin_lo = tl.load(sin_t, mask=mask, other=0.0).to(tl.float32)
        sin_hi = tl.load(sin_t + HALF, mask=mask, other=0.0).to(tl.float32)
        rot_lo, rot_hi = rotate_pair(lo32, hi32, cos_lo, cos_hi, sin_lo, sin_hi)
        lo, hi = rot_lo.to(ty), rot_hi.to(ty)
    if head < NUM_Q_HEADS:
        q_dst = q_out + t[:, None] * (NUM_Q_HEADS * 2 * HALF) + head * 2 * HALF + c0 + j[None, :]
        tl.store(q_dst, lo, mask=mask)
        tl.store(q_dst + HALF, hi, mask=mask)
    else:  # k (rotated in place, as rope_store leaves it) or v: into qkv, then into the token's page
        tl.store(qkv + t[:, None] * stride_om + lo_cols[None, :], lo, mask=mask)
        tl.store(qkv + t[:, None] * stride_om + hi_cols[None, :], hi, mask=mask)
        page = tl.load(pages + rows, mask=row_ok, other=-1).to(tl.int64)
        at = page * stride_cp + tl.load(page_rows + rows, mask=row_ok, other=0).to(tl.int64) * stride_cr
        keep = mask & (page >= 0)[:, None]
        if head < NUM_Q_HEADS + NUM_KV_HEADS:
            k_dst = k_cache + at[:, None] + (head - NUM_Q_HEADS) * stride_ch + c0 + j[None, :]
            tl.store(k_dst, quantize_tile(lo, k_inv_scale, k_cache.dtype.element_ty, QUANT), mask=keep)
            tl.store(k_dst + HALF, quantize_tile(hi, k_inv_scale, k_cache.dtype.element_ty, QUANT), mask=keep)
        else:
            v_dst = v_cache + at[:, None] + (head - NUM_Q_HEADS - NUM_KV_HEADS) * stride_ch + c0 + j[None, :]
            tl.store(v_dst, quantize_tile(lo, v_inv_scale, v_cache.dtype.element_ty, QUANT), mask=keep)
            tl.store(v_dst + HALF, quantize_tile(hi, v_inv_scale, v_cache.dtype.element_ty, QUANT), mask=keep)


def _tiles(num_rows: int, n: int, k: int, head_dim: int):
    """The unfused W8A8 GEMV's tiles for these rows (``fitted_tiles``) and PAIR, the columns of each half
    a program takes: half its weight rows, at most a half-head."""
    tiles = fitted_tiles(fp8_config(num_rows, n, k, None, fp8_x=True), num_rows, k, 1)
    return tiles, min(tiles.config.block_n // 2, head_dim // 2)


def takes(num_rows: int, n: int, k: int, head_dim: int) -> bool:
    """Whether ``qkv_rope_store`` takes ``num_rows`` rows of a qkv weight [n, k] of heads of ``head_dim``:
    2 to 64 rows, the unfused GEMV's tiles run K whole (the result is then its bit for bit), and each
    program's columns lie within a half-head (at least 16 of them, for tl.dot)."""
    if not 2 <= num_rows <= 64 or head_dim % 32 or n % head_dim:
        return False
    tiles, pair = _tiles(num_rows, n, k, head_dim)
    return pair >= 16 and (head_dim // 2) % pair == 0 and tiles.parts == 1


def qkv_rope_store(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, page_rows: torch.Tensor,
                   k_scale: float = 1.0, v_scale: float = 1.0):
    """xq e4m3 [T, K] with per-row scales ``x_scale`` [T, 1] (2 <= T <= 64), an e4m3 qkv weight
    [(Hq + 2 Hkv) D, K] with per-row scales -> (q [T, Hq, D] rotated, k, v [T, Hkv, D]: k rotated), k
    and v stored at (pages[t], page_rows[t]) (page < 0 skipped), as ``fp8_gemv(..., x_scale=)`` then
    ``rope_store`` (``cos``, ``sin``: [T, D] rows, contiguous)."""
    num_rows, k = xq.shape
    n = weight.shape[0]
    head_dim = n // (num_q_heads + 2 * num_kv_heads)
    if weight.shape[1] != k or head_dim * (num_q_heads + 2 * num_kv_heads) != n or not takes(num_rows, n, k, head_dim):
        raise ValueError(f"qkv_rope_store: x {tuple(xq.shape)} for a qkv weight {tuple(weight.shape)} of "
                         f"{num_q_heads} + 2 x {num_kv_heads} heads: not a shape it takes (takes())")
    half = head_dim // 2
    (cfg, block_m, block_k, _, _), pair = _tiles(num_rows, n, k, head_dim)
    qkv = torch.empty(num_rows, n, dtype=dtype, device=xq.device)
    q_out = torch.empty(num_rows, num_q_heads, head_dim, dtype=dtype, device=xq.device)
    xq = xq if xq.stride(-1) == 1 else xq.contiguous()
    _qkv_rope_kernel[((num_q_heads + 2 * num_kv_heads) * (half // pair), triton.cdiv(num_rows, block_m))](
        xq, x_scale, weight, scale, qkv, q_out, cos, sin, k_cache, v_cache, pages, page_rows, num_rows, k,
        xq.stride(0), weight.stride(0), qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        1.0 / k_scale, 1.0 / v_scale, NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, PAIR=pair,
        BLOCK_M=block_m, BLOCK_K=block_k, QUANT=is_quantized(k_cache.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_kw())
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    k_rows = qkv[:, q_size:q_size + kv_size].view(num_rows, num_kv_heads, head_dim)
    v_rows = qkv[:, q_size + kv_size:].view(num_rows, num_kv_heads, head_dim)
    return q_out, k_rows, v_rows
