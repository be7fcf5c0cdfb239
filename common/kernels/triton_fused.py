"""Fused elementwise kernels for the CUDA path: one launch where the torch path runs several.

- ``add_rms_norm``: ``x + delta`` (the residual stream, rounded to the model dtype as torch
  rounds it) and RMSNorm of the sum (fp32 statistics, cast, then the weight), as
  ``llama.rms_norm`` computes it;
- ``rope_store``: rotary embedding of q and k (the cos/sin rows of ``rope.cos_sin``; Qwen3's
  per-head q/k RMSNorm first, when given) and the
  store of the rotated k and of v into their pages, in one pass over a token's heads (quantized
  by the layer's scales into an FP8 pool, as ``triton_attention.store_kv``);
- ``silu_mul``: ``silu(gate) * up`` of the fused gate-up projection;
- ``cos_sin``: a step's rotary cos/sin rows from its positions, once for every layer (torch ran
  seven or eight launches: the cast, the product, ``cat``, cos, sin, the scale and two casts).

``add_rms_norm`` and ``silu_mul`` with ``quant`` also quantize each output row per token (e4m3,
``amax / 448``, bit for bit as ``triton_fp8_gemm.per_token_quant`` would), for the W8A8 linear they
feed (``fp8.takes_token_quant``): one launch instead of two (``quant_rows.TokenQuantized``).

Each matches its torch composition to within one rounding of the model dtype (``tests/gpu``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvferry.common.kernels.kv_quant import is_quantized
from kvferry.common.kernels.pdl import enter as pdl_enter, kw as pdl_kw
from kvferry.common.kernels.quant_rows import SplitParts, TokenQuantized
from kvferry.common.kernels.split_sum import sum_in_order
from kvferry.common.kernels.triton_attention import quantize_tile
from kvferry.common.kernels.triton_fp8_gemm import e4m3_quantize, e4m3_scale, quantize_row


@triton.jit
def _add_rms_norm_kernel(x, delta, out_x, out_h, weight, eps, hq, hs, stride_part, stride_prow, HIDDEN: tl.constexpr,
                         BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, QUANT: tl.constexpr, PARTS: tl.constexpr = 0,
                         PDL: tl.constexpr = 0):
    """PARTS > 0: delta is fp32 parts (``SplitParts``: row r's part p at r * stride_prow + p *
    stride_part), added in part order and rounded first, as ``split_sum.sum_parts`` / ``slot_sum``
    would have."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < HIDDEN
    v = tl.load(x + row * HIDDEN + i, mask=mask, other=0.0)
    if PARTS > 0:
        d = sum_in_order(delta, row * stride_prow + i, stride_part, PARTS, mask).to(v.dtype)
        v = (v.to(tl.float32) + d.to(tl.float32)).to(v.dtype)
        tl.store(out_x + row * HIDDEN + i, v, mask=mask)
    elif HAS_DELTA:
        v = (v.to(tl.float32) + tl.load(delta + row * HIDDEN + i, mask=mask, other=0.0).to(tl.float32)).to(v.dtype)
        tl.store(out_x + row * HIDDEN + i, v, mask=mask)
    v32 = v.to(tl.float32)
    normed = (v32 * tl.rsqrt(tl.sum(v32 * v32, 0) / HIDDEN + eps)).to(v.dtype)
    w = tl.load(weight + i, mask=mask, other=0.0)
    h = (w.to(tl.float32) * normed.to(tl.float32)).to(v.dtype)
    tl.store(out_h + row * HIDDEN + i, h, mask=mask)
    if QUANT:
        quantize_row(h, hq + row * HIDDEN, hs, row, i, mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | SplitParts | None, weight: torch.Tensor, eps: float,
                 quant: bool = False, num_warps: int | None = None):
    """x, delta: [T, hidden] contiguous -> (x + delta, rms_norm(x + delta)); delta None: (x, rms_norm(x)).
    ``quant``: the normed rows also quantized per token -> (x + delta, ``fp8.TokenQuantized``). A
    ``SplitParts`` delta (a split-K GEMV's or a MoE block's slots, unsummed) is added up here, one
    launch for both."""
    num_rows, hidden = x.shape
    out_x = torch.empty_like(x) if delta is not None else x
    out_h = torch.empty_like(x)
    hq, hs = _quant_outputs(x, hidden, quant)
    block = triton.next_power_of_2(hidden)
    parts = delta.parts if isinstance(delta, SplitParts) else None
    if parts is not None and (parts.shape[1:] != x.shape or parts.stride(2) != 1 or delta.dtype != x.dtype):
        raise ValueError(f"add_rms_norm: split-K parts {tuple(parts.shape)} ({delta.dtype}) for x {tuple(x.shape)} "
                         f"({x.dtype}): parts [S, T, hidden], unit stride along hidden, of x's dtype")
    strides = parts.stride()[:2] if parts is not None else (0, 0)  # a part's, a row's
    if num_rows:
        _add_rms_norm_kernel[(num_rows,)](x, parts if parts is not None else delta if delta is not None else x, out_x,
                                          out_h, weight, eps, hq, hs, *strides, HIDDEN=hidden, BLOCK=block,
                                          HAS_DELTA=delta is not None, QUANT=quant,
                                          PARTS=0 if parts is None else parts.shape[0],
                                          num_warps=num_warps or (8 if block >= 4096 else 4), **pdl_kw())
    return out_x, (TokenQuantized(out_h, hq, hs) if quant else out_h)


def _quant_outputs(x: torch.Tensor, width: int, quant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 rows [T, width] and fp32 scales [T, 1] a ``quant`` kernel writes (else placeholders)."""
    if not quant:
        return x, x
    return (torch.empty(x.shape[0], width, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device))


@triton.jit
def _rotate(x_ptr, stride_h, cos, sin, norm, eps, num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """Loads heads [num_heads, 2 * HALF] at x_ptr; returns the rotated halves (fp32). HAS_NORM: each
    head is RMS-normalised first with the weight ``norm`` [2 * HALF] (Qwen3's q/k norm), rounded as
    ``norm.rms_norm`` rounds (the normalised head to x's dtype, then the product with the weight)."""
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < num_heads) & (j[None, :] < HALF)
    lo = tl.load(x_ptr + h[:, None] * stride_h + j[None, :], mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(x_ptr + h[:, None] * stride_h + HALF + j[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        ty = x_ptr.dtype.element_ty
        r = tl.rsqrt((tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)) / (2 * HALF) + eps)[:, None]
        w_lo = tl.load(norm + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        w_hi = tl.load(norm + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        lo = (w_lo * (lo * r).to(ty).to(tl.float32)).to(ty).to(tl.float32)
        hi = (w_hi * (hi * r).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    cos_lo = tl.load(cos + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    cos_hi = tl.load(cos + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    sin_lo = tl.load(sin + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    sin_hi = tl.load(sin + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    rot_lo, rot_hi = rotate_pair(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi)
    return rot_lo, rot_hi, mask


@triton.jit
def rotate_pair(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi):
    """(lo cos_lo - hi sin_lo, hi cos_hi + lo sin_hi) in fp32 with explicit fused multiply-adds, so that
    every kernel that rotates rounds alike (``triton_qkv`` equals ``rope_store`` bit for bit); the
    compiler's own contraction of ``a * b - c * d`` may differ from one kernel to another."""
    return tl.fma(lo, cos_lo, -(hi * sin_lo)), tl.fma(hi, cos_hi, lo * sin_hi)


@triton.jit
def _rope_store_kernel(q, k, v, q_out, cos, sin, k_cache, v_cache, pages, rows, stride_qt, stride_qh, stride_kt,
                       stride_kh, stride_vt, stride_vh, stride_cp, stride_cr, stride_ch, k_inv_scale, v_inv_scale,
                       q_norm, k_norm, eps, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       QUANT: tl.constexpr, HAS_NORM: tl.constexpr, SPLIT_Q: tl.constexpr = 0, PDL: tl.constexpr = 0):
    """Token t's q heads, then its k and v. SPLIT_Q: program (t, 0) does k and v, (t, i > 0) the
    BLOCK_QH q heads from (i - 1) * BLOCK_QH; else program (t, 0) does all of it."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cos_t, sin_t = cos + t * 2 * HALF, sin + t * 2 * HALF
    j = tl.arange(0, BLOCK_HALF)
    if SPLIT_Q == 0 or part > 0:
        h0 = (part - 1) * BLOCK_QH if SPLIT_Q else 0
        q_lo, q_hi, q_mask = _rotate(q + t * stride_qt + h0 * stride_qh, stride_qh, cos_t, sin_t, q_norm, eps,
                                     NUM_Q_HEADS - h0, HALF, BLOCK_QH, BLOCK_HALF, HAS_NORM)
        h = tl.arange(0, BLOCK_QH)
        q_dst = q_out + t * NUM_Q_HEADS * 2 * HALF + (h0 + h[:, None]) * 2 * HALF + j[None, :]
        tl.store(q_dst, q_lo.to(q_out.dtype.element_ty), mask=q_mask)
        tl.store(q_dst + HALF, q_hi.to(q_out.dtype.element_ty), mask=q_mask)
    if part == 0:
        _rope_store_kv(k, v, cos_t, sin_t, k_cache, v_cache, pages, rows, t, stride_kt, stride_kh, stride_vt,
                       stride_vh, stride_cp, stride_cr, stride_ch, k_inv_scale, v_inv_scale, k_norm, eps, NUM_KV_HEADS,
                       HALF, BLOCK_KH, BLOCK_HALF, QUANT, HAS_NORM)


@triton.jit
def _rope_store_kv(k, v, cos_t, sin_t, k_cache, v_cache, pages, rows, t, stride_kt, stride_kh, stride_vt,
                   stride_vh, stride_cp, stride_cr, stride_ch, k_inv_scale, v_inv_scale, k_norm, eps,
                   NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   QUANT: tl.constexpr, HAS_NORM: tl.constexpr):
    """Token t's k rotated in place and stored with its v at (pages[t], rows[t]) (page < 0: skipped)."""
    j = tl.arange(0, BLOCK_HALF)
    k_lo, k_hi, k_mask = _rotate(k + t * stride_kt, stride_kh, cos_t, sin_t, k_norm, eps, NUM_KV_HEADS, HALF,
                                 BLOCK_KH, BLOCK_HALF, HAS_NORM)
    hk = tl.arange(0, BLOCK_KH)
    # k rounds to the model dtype (and is rotated in place: a dense prefill attends to it), then to the cache's
    k_lo = k_lo.to(k.dtype.element_ty)
    k_hi = k_hi.to(k.dtype.element_ty)
    k_src = k + t * stride_kt + hk[:, None] * stride_kh + j[None, :]
    tl.store(k_src, k_lo, mask=k_mask)
    tl.store(k_src + HALF, k_hi, mask=k_mask)
    page = tl.load(pages + t).to(tl.int64)
    if page >= 0:
        row = tl.load(rows + t).to(tl.int64)
        dst = page * stride_cp + row * stride_cr + hk[:, None] * stride_ch + j[None, :]
        cache_ty = k_cache.dtype.element_ty
        tl.store(k_cache + dst, quantize_tile(k_lo, k_inv_scale, cache_ty, QUANT), mask=k_mask)
        tl.store(k_cache + dst + HALF, quantize_tile(k_hi, k_inv_scale, cache_ty, QUANT), mask=k_mask)
        for part in range(2):
            src = v + t * stride_vt + hk[:, None] * stride_vh + part * HALF + j[None, :]
            v_part = quantize_tile(tl.load(src, mask=k_mask), v_inv_scale, v_cache.dtype.element_ty, QUANT)
            tl.store(v_cache + dst + part * HALF, v_part, mask=k_mask)


ROPE_Q_HEADS = 8  # q heads a rope_store program rotates, its token's k and v in one more (0: one program a token)


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor,
               k_scale: float = 1.0, v_scale: float = 1.0, qk_norm=None, q_heads: int | None = None) -> torch.Tensor:
    """q [T, Hq, D], k, v [T, Hkv, D] (row-strided views of qkv are fine); cos, sin [T, 1, D] ->
    rotated q [T, Hq, D] (contiguous); k is rotated in place; k and v stored at (pages[t], rows[t]),
    page < 0 skipped (an FP8 pool: quantized by ``k_scale``/``v_scale``). ``qk_norm``: (q weight,
    k weight, eps) of a per-head RMSNorm applied to q and k before the rotation (Qwen3). ``q_heads``
    (a power of two; default ``ROPE_Q_HEADS``): q heads a program takes, beside one program for the
    token's k and v, so that a decode token's work is spread over a few programs; 0: one program."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    q_heads = ROPE_Q_HEADS if q_heads is None else q_heads
    split = 0 < q_heads < num_heads
    block_qh = q_heads if split else triton.next_power_of_2(num_heads)
    _rope_store_kernel[(num_tokens, 1 + triton.cdiv(num_heads, block_qh) if split else 1)](
        q, k, v, q_out, cos, sin, k_cache, v_cache, pages, rows, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), 1.0 / k_scale,
        1.0 / v_scale, *(qk_norm if qk_norm is not None else (q, q, 0.0)), NUM_Q_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_QH=block_qh,
        BLOCK_KH=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=triton.next_power_of_2(half),
        QUANT=is_quantized(k_cache.dtype), HAS_NORM=qk_norm is not None, SPLIT_Q=int(split), num_warps=4, **pdl_kw())
    return q_out


@triton.jit
def silu_times_up(gate, mask, up_offset):
    """silu(gate) * up from a [gate | up] row: the gate values at the pointers ``gate``, each up value
    ``up_offset`` further, rounded as ``silu_mul`` rounds (also the GEMVs that read gate-up rows)."""
    return silu_mul_values(tl.load(gate, mask=mask, other=0.0), tl.load(gate + up_offset, mask=mask, other=0.0))


@triton.jit
def silu_mul_values(g, u):
    """silu(g) * u of gate and up values in the model dtype, rounded as torch rounds ``F.silu(g) * u``."""
    g32 = g.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype)  # F.silu rounds to the dtype before the product
    return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


@triton.jit
def _silu_mul_tile(gate_up, row, i, INTER: tl.constexpr):
    mask = i < INTER
    return silu_times_up(gate_up + row * 2 * INTER + i, mask, INTER), mask


@triton.jit
def _silu_mul_kernel(gate_up, out, INTER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """``silu(gate) * up`` of BLOCK columns of a row."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h, mask = _silu_mul_tile(gate_up, row, i, INTER)
    tl.store(out + row * INTER + i, h, mask=mask)


@triton.jit
def _silu_mul_quant_kernel(gate_up, out, q, s, INTER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """``silu(gate) * up`` of a whole row, also quantized per token: in registers when BLOCK covers
    the row, else in two passes of BLOCK columns (the second recomputes each tile)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    if BLOCK >= INTER:
        h, mask = _silu_mul_tile(gate_up, row, i, INTER)
        tl.store(out + row * INTER + i, h, mask=mask)
        quantize_row(h, q + row * INTER, s, row, i, mask)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, INTER, BLOCK):
            h, mask = _silu_mul_tile(gate_up, row, start + i, INTER)
            tl.store(out + row * INTER + start + i, h, mask=mask)
            amax = tl.maximum(amax, tl.abs(h.to(tl.float32)))
        scale = e4m3_scale(tl.max(amax, 0))
        for start in range(0, INTER, BLOCK):
            h, mask = _silu_mul_tile(gate_up, row, start + i, INTER)
            tl.store(q + row * INTER + start + i, e4m3_quantize(h.to(tl.float32), scale, q.dtype.element_ty),
                     mask=mask)
        tl.store(s + row, scale)


# columns a program holds at once with ``quant``, and its warps: the fastest of bench/fused_quant.py's sweep at 32
# and 64 rows of 14,336 on an H100 (6.1 us against 9.5-10 for silu_mul + per_token_quant; bench/RESULTS.md)
SILU_QUANT_BLOCK = 16384
SILU_QUANT_WARPS = 32


def silu_mul(gate_up: torch.Tensor, quant: bool = False, block: int | None = None, num_warps: int | None = None):
    """gate_up [T, 2 * I] contiguous -> silu(gate) * up [T, I]; ``quant``: also quantized per token
    (one program a row, ``block`` columns at once) -> ``fp8.TokenQuantized``."""
    num_rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty(num_rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    q, s = _quant_outputs(gate_up, inter, quant)
    if num_rows and quant:
        block = min(block or SILU_QUANT_BLOCK, triton.next_power_of_2(inter))
        _silu_mul_quant_kernel[(num_rows,)](gate_up, out, q, s, INTER=inter, BLOCK=block,
                                            num_warps=num_warps or min(SILU_QUANT_WARPS, max(4, block // 512)),
                                            **pdl_kw())
    elif num_rows:
        _silu_mul_kernel[(num_rows, triton.cdiv(inter, 1024))](gate_up, out, INTER=inter, BLOCK=1024, num_warps=4,
                                                               **pdl_kw())
    return TokenQuantized(out, q, s) if quant else out


@triton.jit
def _cos_sin_kernel(positions, inv_freq, cos, sin, num_tokens, factor, HALF: tl.constexpr, DUP: tl.constexpr,
                    SCALED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr = 0):
    """cos/sin[t, j] = cos/sin(positions[t] * inv_freq[j]) (* factor), rounded to cos's dtype; DUP: the
    row is the HALF values twice (``rope.cos_sin``'s ``cat((freqs, freqs))``)."""
    pdl_enter(PDL)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    mask = (t < num_tokens)[:, None] & (j < HALF)[None, :]
    pos = tl.load(positions + t, mask=t < num_tokens, other=0).to(tl.float32)
    freqs = pos[:, None] * tl.load(inv_freq + j, mask=j < HALF, other=0.0)[None, :]
    c, s = tl.cos(freqs), tl.sin(freqs)
    if SCALED:
        c, s = c * factor, s * factor
    ty = cos.dtype.element_ty
    at = t[:, None] * (2 * HALF if DUP else HALF) + j[None, :]
    tl.store(cos + at, c.to(ty), mask=mask)
    tl.store(sin + at, s.to(ty), mask=mask)
    if DUP:
        tl.store(cos + at + HALF, c.to(ty), mask=mask)
        tl.store(sin + at + HALF, s.to(ty), mask=mask)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, factor: float = 1.0,
            dup: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (integers), inv_freq [D/2] fp32 -> cos, sin [T, 1, D] (``dup``: each row's D/2
    values twice, as ``rope.cos_sin``) or [T, 1, D/2] (``mla.LatentRope.cos_sin``), times ``factor``,
    in ``dtype``; one launch. fp32 as torch computes it (the position cast, its product with
    inv_freq, cos/sin, the factor), then one rounding."""
    if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 or positions.dim() != 1:
        raise ValueError(f"cos_sin: positions {tuple(positions.shape)} and an fp32 inv_freq [D/2], got "
                         f"{tuple(inv_freq.shape)} {inv_freq.dtype}")
    num_tokens, half = positions.shape[0], inv_freq.shape[0]
    width = 2 * half if dup else half
    cos = torch.empty(num_tokens, 1, width, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if num_tokens:
        block_t = min(16, triton.next_power_of_2(num_tokens))
        _cos_sin_kernel[(triton.cdiv(num_tokens, block_t),)](
            positions, inv_freq, cos, sin, num_tokens, factor, HALF=half, DUP=dup, SCALED=factor != 1.0,
            BLOCK_T=block_t, BLOCK_HALF=triton.next_power_of_2(half), num_warps=4, **pdl_kw())
    return cos, sin
