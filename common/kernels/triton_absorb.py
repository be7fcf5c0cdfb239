"""MLA's absorbed projections in Triton: the two per-head matmuls around the latent attention.

The absorbed form (``common/layers/mla.py``) multiplies each head's query and output by its slice
of kv_b_proj (W_UK [H, nope, L], W_UV [H, v, L]: views, no copy)::

    q[t, h]   = [q_nope[t, h] @ W_UK[h] | q_pe[t, h]]     # [L + R]: the query the latent attention takes
    out[t, h] = o[t, h] @ W_UV[h].T                         # [v], heads side by side: o_proj's input

In torch that is an ``einsum`` (a batched GEMM, after a copy of the strided q_nope), a ``cat`` with
q_pe, and a second ``einsum`` whose [H, T, v] result is copied again into o_proj's [T, H * v]: about
five launches a layer. Here each is one launch, a program per (token block, head, column block) on
``tl.dot``, writing straight into the layout the next step reads. Each matmul accumulates in fp32 and
rounds once to the activations' dtype, as the GEMM does.

The torch references are ``mla.absorb_q_ref`` and ``mla.absorb_v_ref`` (``tests/gpu/test_triton_mla.py``;
TRITON_INTERPRET=1 runs the same tests on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvferry.common.kernels.pdl import enter as pdl_enter, kw as pdl_kw
from kvferry.common.kernels.triton_attention import _precision
from kvferry.common.kernels.triton_mla import _latent_row, _rope_pair


@triton.jit
def _absorb_q_tile(q_nope, w, q_pe, out, cos, sin, num_tokens, t_block, h, l_block, stride_nt, stride_nh, stride_wh,
                   stride_wd, stride_pt, stride_ph, stride_ot, stride_oh, NOPE: tl.constexpr, LATENT: tl.constexpr,
                   ROPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                   BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr):
    """out[t, h, l] = q_nope[t, h] . w[h, :, l] for BLOCK_L columns l; column block 0 also writes
    q_pe[t, h] at out[t, h, LATENT:], rotated by the token's cos/sin [T, 1, R/2] first when ROTATE (as
    ``triton_mla.latent_rows`` rotates it, once rounded), else as it is."""
    t = (t_block * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = t < num_tokens
    d = tl.arange(0, BLOCK_D)
    cols = l_block * BLOCK_L + tl.arange(0, BLOCK_L)
    x = tl.load(q_nope + t[:, None] * stride_nt + h * stride_nh + d[None, :],
                mask=t_ok[:, None] & (d[None, :] < NOPE), other=0.0)
    wt = tl.load(w + h * stride_wh + d[:, None] * stride_wd + cols[None, :],
                 mask=(d[:, None] < NOPE) & (cols[None, :] < LATENT), other=0.0)
    acc = tl.dot(x, wt, input_precision=PRECISION)  # [BLOCK_T, BLOCK_L] fp32
    dst = out + t[:, None] * stride_ot + h * stride_oh
    ty = out.dtype.element_ty
    tl.store(dst + cols[None, :], acc.to(ty), mask=t_ok[:, None] & (cols[None, :] < LATENT))
    if l_block == 0:
        src = q_pe + t[:, None] * stride_pt + h * stride_ph
        if ROTATE:
            j = tl.arange(0, BLOCK_R // 2)[None, :]
            mask = t_ok[:, None] & (j < ROPE // 2)
            c = tl.load(cos + t[:, None] * (ROPE // 2) + j, mask=mask, other=0.0).to(tl.float32)
            s = tl.load(sin + t[:, None] * (ROPE // 2) + j, mask=mask, other=0.0).to(tl.float32)
            q1, q2 = _rope_pair(src, c, s, j, mask, ROPE // 2, INTERLEAVED)
            tl.store(dst + LATENT + j, q1.to(ty), mask=mask)
            tl.store(dst + LATENT + ROPE // 2 + j, q2.to(ty), mask=mask)
        else:
            r = tl.arange(0, BLOCK_R)
            r_mask = t_ok[:, None] & (r[None, :] < ROPE)
            tl.store(dst + LATENT + r[None, :], tl.load(src + r[None, :], mask=r_mask, other=0.0).to(ty), mask=r_mask)


@triton.jit
def _absorb_q_kernel(q_nope, w, q_pe, out, num_tokens, stride_nt, stride_nh, stride_wh, stride_wd, stride_pt,
                     stride_ph, stride_ot, stride_oh, NOPE: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                     PRECISION: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    _absorb_q_tile(q_nope, w, q_pe, out, out, out, num_tokens, tl.program_id(0), tl.program_id(1).to(tl.int64),
                   tl.program_id(2), stride_nt, stride_nh, stride_wh, stride_wd, stride_pt, stride_ph, stride_ot,
                   stride_oh, NOPE, LATENT, ROPE, BLOCK_T, BLOCK_D, BLOCK_L, BLOCK_R, PRECISION, False, False)


@triton.jit
def _absorb_q_rows_kernel(q_nope, w, q_pe, out, kv_a, cos, sin, norm, cache, pages, slots, eps, num_tokens,
                          num_heads, l_blocks, stride_nt, stride_nh, stride_wh, stride_wd, stride_pt, stride_ph,
                          stride_ot, stride_oh, stride_kv, stride_cp, stride_cr, NOPE: tl.constexpr,
                          LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_LATENT: tl.constexpr,
                          PRECISION: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr = 0):
    """One grid, two kinds of program: the first (token block, head, column block) ones as
    ``_absorb_q_kernel`` with q_pe rotated; then one a token, its latent cache row made and stored
    (``triton_mla._latent_row``)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    num_absorb = tl.cdiv(num_tokens, BLOCK_T) * num_heads * l_blocks
    if pid < num_absorb:
        per_block = num_heads * l_blocks
        _absorb_q_tile(q_nope, w, q_pe, out, cos, sin, num_tokens, pid // per_block,
                       ((pid % per_block) // l_blocks).to(tl.int64), pid % l_blocks, stride_nt, stride_nh, stride_wh,
                       stride_wd, stride_pt, stride_ph, stride_ot, stride_oh, NOPE, LATENT, ROPE, BLOCK_T, BLOCK_D,
                       BLOCK_L, BLOCK_R, PRECISION, True, INTERLEAVED)
    else:
        _latent_row(kv_a, cos, sin, norm, kv_a, cache, pages, slots, eps, (pid - num_absorb).to(tl.int64), stride_kv,
                    0, stride_cp, stride_cr, LATENT, ROPE // 2, BLOCK_LATENT, BLOCK_R // 2, INTERLEAVED, True, False)


@triton.jit
def _absorb_v_kernel(o, w, out, num_tokens, stride_ot, stride_oh, stride_wh, stride_wv, stride_yt,
                     LATENT: tl.constexpr, V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                     BLOCK_L: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = 0):
    """out[t, h * V + v] = o[t, h] . w[h, v] (both L long) for BLOCK_V values v."""
    pdl_enter(PDL)
    t_block, h, v_block = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    t = (t_block * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = t < num_tokens
    v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < V
    lat = tl.arange(0, BLOCK_L)
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for l0 in range(0, LATENT, BLOCK_L):
        ls = l0 + lat
        x = tl.load(o + t[:, None] * stride_ot + h * stride_oh + ls[None, :],
                    mask=t_ok[:, None] & (ls[None, :] < LATENT), other=0.0)
        wt = tl.load(w + h * stride_wh + v[None, :] * stride_wv + ls[:, None],
                     mask=(ls[:, None] < LATENT) & v_ok[None, :], other=0.0)  # [BLOCK_L, BLOCK_V]
        acc += tl.dot(x, wt, input_precision=PRECISION)
    tl.store(out + t[:, None] * stride_yt + h * V + v[None, :], acc.to(out.dtype.element_ty),
             mask=t_ok[:, None] & v_ok[None, :])


def _token_block(num_tokens: int) -> int:
    return min(64, max(16, triton.next_power_of_2(max(1, num_tokens))))  # tl.dot's rows: at least 16


def _latent_block(latent: int) -> int:
    return min(128, max(16, triton.next_power_of_2(latent)))  # latent columns a program (a dot step) takes


def _check_heads(name: str, x: torch.Tensor, w: torch.Tensor, inner: int) -> None:
    if x.dim() != 3 or w.dim() != 3 or x.shape[1] != w.shape[0] or x.shape[2] != inner:
        raise ValueError(f"{name}: activations {tuple(x.shape)} and weight {tuple(w.shape)} disagree (want [T, H, "
                         f"{inner}] against [H, ., .] with the same H)")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"{name}: last strides must be 1, got {x.stride()} and {w.stride()}")


def _absorbed_query(name: str, q_nope: torch.Tensor, w_uk: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """The checks of q_nope/W_UK/q_pe, then the query [T, H, L + R] to write."""
    _check_heads(name, q_nope, w_uk, w_uk.shape[1])
    if q_pe.stride(-1) != 1 or q_pe.shape[:2] != q_nope.shape[:2]:
        raise ValueError(f"{name}: q_pe {tuple(q_pe.shape)} (strides {q_pe.stride()}) for q_nope "
                         f"{tuple(q_nope.shape)}")
    return torch.empty(*q_nope.shape[:2], w_uk.shape[2] + q_pe.shape[2], dtype=q_nope.dtype, device=q_nope.device)


def absorb_q(q_nope: torch.Tensor, w_uk: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, nope], W_UK [H, nope, L], q_pe [T, H, R] (strided views are fine) -> [T, H, L + R]
    in q_nope's dtype: each head's nope query times its W_UK, then its q_pe."""
    out = _absorbed_query("absorb_q", q_nope, w_uk, q_pe)
    (num_tokens, num_heads, nope), latent, rope_dim = q_nope.shape, w_uk.shape[2], q_pe.shape[2]
    if num_tokens == 0:
        return out
    block_t, block_l = _token_block(num_tokens), _latent_block(latent)
    _absorb_q_kernel[(triton.cdiv(num_tokens, block_t), num_heads, triton.cdiv(latent, block_l))](
        q_nope, w_uk, q_pe, out, num_tokens, q_nope.stride(0), q_nope.stride(1), w_uk.stride(0), w_uk.stride(1),
        q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1), NOPE=nope, LATENT=latent, ROPE=rope_dim,
        BLOCK_T=block_t, BLOCK_D=max(16, triton.next_power_of_2(nope)), BLOCK_L=block_l,
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)), PRECISION=_precision(q_nope.dtype), num_warps=4,
        **pdl_kw())
    return out


def absorb_v(o: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o [T, H, L] (the latent attention's output), W_UV [H, v, L] -> [T, H * v] in o's dtype: each
    head's output times its W_UV, heads side by side (o_proj's input)."""
    _check_heads("absorb_v", o, w_uv, w_uv.shape[2])
    num_tokens, num_heads, latent = o.shape
    v_dim = w_uv.shape[1]
    out = torch.empty(num_tokens, num_heads * v_dim, dtype=o.dtype, device=o.device)
    if num_tokens == 0:
        return out
    block_t, block_v = _token_block(num_tokens), 32 if num_tokens <= 16 else 64
    block_v = min(block_v, max(16, triton.next_power_of_2(v_dim)))
    _absorb_v_kernel[(triton.cdiv(num_tokens, block_t), num_heads, triton.cdiv(v_dim, block_v))](
        o, w_uv, out, num_tokens, o.stride(0), o.stride(1), w_uv.stride(0), w_uv.stride(1), out.stride(0),
        LATENT=latent, V=v_dim, BLOCK_T=block_t, BLOCK_V=block_v,
        BLOCK_L=_latent_block(latent), PRECISION=_precision(o.dtype), num_warps=4,
        **pdl_kw())
    return out


def absorb_q_rows(q_nope: torch.Tensor, w_uk: torch.Tensor, q_pe: torch.Tensor, kv_a: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, norm: torch.Tensor, eps: float, interleaved: bool,
                  cache: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``triton_mla.latent_rows`` (its rows stored into ``cache``, not returned) and ``absorb_q`` of its
    rotated q_pe, in one launch: q_nope [T, H, nope], W_UK [H, nope, L], q_pe [T, H, R] as projected
    (not yet rotated), kv_a [T, L + R], cos/sin [T, 1, R/2] -> the absorbed query [T, H, L + R].
    The two share no input but the projection's output, so one grid runs both."""
    out = _absorbed_query("absorb_q_rows", q_nope, w_uk, q_pe)
    (num_tokens, num_heads, nope), latent, rope_dim = q_nope.shape, w_uk.shape[2], q_pe.shape[2]
    if kv_a.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError(f"absorb_q_rows: kv_a strides {kv_a.stride()}, cache strides {cache.stride()}: last "
                         "strides must be 1")
    if kv_a.shape != (num_tokens, latent + rope_dim) or cache.shape[-1] != latent + rope_dim:
        raise ValueError(f"absorb_q_rows: kv_a {tuple(kv_a.shape)} and cache rows {cache.shape[-1]} wide, want "
                         f"[{num_tokens}, {latent + rope_dim}] ({latent} + {rope_dim})")
    if num_tokens == 0:
        return out
    block_t, block_l = _token_block(num_tokens), _latent_block(latent)
    l_blocks = triton.cdiv(latent, block_l)
    grid = (triton.cdiv(num_tokens, block_t) * num_heads * l_blocks + num_tokens,)
    _absorb_q_rows_kernel[grid](
        q_nope, w_uk, q_pe, out, kv_a, cos, sin, norm, cache, pages, slots, eps, num_tokens, num_heads, l_blocks,
        q_nope.stride(0), q_nope.stride(1), w_uk.stride(0), w_uk.stride(1), q_pe.stride(0), q_pe.stride(1),
        out.stride(0), out.stride(1), kv_a.stride(0), cache.stride(0), cache.stride(1), NOPE=nope, LATENT=latent,
        ROPE=rope_dim, BLOCK_T=block_t, BLOCK_D=max(16, triton.next_power_of_2(nope)), BLOCK_L=block_l,
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)), BLOCK_LATENT=triton.next_power_of_2(latent),
        PRECISION=_precision(q_nope.dtype), INTERLEAVED=interleaved, num_warps=4, **pdl_kw())
    return out
