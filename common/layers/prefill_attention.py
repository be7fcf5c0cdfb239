"""The attention of a prefill batch with a long chunk (``attn_backend.DENSE_PREFILL_MIN_TOKENS``) on the
triton backend: flash attention through torch (SDPA per chunk, or one varlen FlashAttention-2 call
when chunks have cached prefixes), instead of the paged extend kernel. ``plan`` is a ``TritonPlan``
with host ``starts`` (not a CUDA graph's static plan)."""

from __future__ import annotations

import torch
from torch.nn.attention.bias import causal_lower_right

from kvferry.common.kernels.kv_quant import dequantize, round_trip
from kvferry.common.layers import attention


def sdpa_prefill(q, k, v, k_cache, v_cache, plan, scale: float, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of every chunk over its context. A chunk with no cached prefix attends to its
    new rows of k, v [T, Hkv, D] (as the pool holds them: an FP8 pool's round trip); one after
    ``plan.starts[i]`` cached tokens to its whole context read back from the pool's pages (the new
    rows are stored already), query j seeing keys up to ``starts[i] + j`` (causal lower-right).
    The gather copies the context once per layer (2 x kv_len x Hkv x D elements), far less than the
    attention reads of the extend kernel, which loads each key tile once per query block and head.

    When a chunk has a cached prefix, in 16 bits on CUDA (``plan.cu_seqlens`` set), the chunks go to
    one varlen flash call over their contexts packed end to end; otherwise one SDPA call per chunk."""
    if plan.cu_seqlens is not None and _flash_varlen_ok(q):
        return _flash_varlen_prefill(q, k, v, k_cache, v_cache, plan, scale, k_scale, v_scale)
    out = torch.empty_like(q)
    page_size = k_cache.shape[1]
    offset = 0
    for i, (num, start) in enumerate(zip(plan.query_lens, plan.starts)):
        rows = slice(offset, offset + num)
        offset += num
        pages = plan.page_table[i, :-(-(start + num) // page_size)]
        keys = _context(k[rows], k_cache, pages, start, k_scale, q.dtype).transpose(0, 1)[None]
        values = _context(v[rows], v_cache, pages, start, v_scale, q.dtype).transpose(0, 1)[None]
        if start == 0:
            mask, causal = None, num > 1
        else:
            mask, causal = (causal_lower_right(num, start + num) if num > 1 else None), False
        o = torch.nn.functional.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], keys, values,
                                                             attn_mask=mask, is_causal=causal, scale=scale,
                                                             enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out


def _flash_varlen_ok(q: torch.Tensor) -> bool:
    """torch's FlashAttention-2 serves q: CUDA, 16 bits, head_dim a multiple of 8 up to 256, sm80+."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and torch.cuda.get_device_capability(q.device)[0] >= 8)


def _context(new: torch.Tensor, cache: torch.Tensor, pages: torch.Tensor, start: int, scale: float,
             dtype: torch.dtype) -> torch.Tensor:
    """One chunk's keys (or values) [start + num, Hkv, D] in ``dtype``, token-major: its new rows as
    the pool holds them when it has no prefix, else its whole context read back from its pages."""
    if start == 0:
        return round_trip(new, scale, cache.dtype)
    kv_len = start + new.shape[0]
    return dequantize(attention.gather_keys(cache, pages, 1)[0, :, :kv_len].transpose(0, 1), scale, dtype)


def _flash_varlen_prefill(q, k, v, k_cache, v_cache, plan, scale: float, k_scale: float,
                          v_scale: float) -> torch.Tensor:
    """Every chunk in one varlen FlashAttention-2 call (``aten::_flash_attention_forward``): the
    queries [T, H, D] as they are, each chunk's context packed end to end [sum kv_len, Hkv, D], GQA
    native. Causal there aligns each sequence's mask to its bottom right, so query j of a chunk after
    ``start`` cached tokens sees keys up to ``start + j``. One call fills the GPU where one SDPA call
    per chunk did not (a 576-token chunk is 5 query blocks a head)."""
    page_size = k_cache.shape[1]
    keys, values, offset = [], [], 0
    for i, (num, start) in enumerate(zip(plan.query_lens, plan.starts)):
        rows = slice(offset, offset + num)
        offset += num
        pages = plan.page_table[i, :-(-(start + num) // page_size)]
        keys.append(_context(k[rows], k_cache, pages, start, k_scale, q.dtype))
        values.append(_context(v[rows], v_cache, pages, start, v_scale, q.dtype))
    max_k = max(s + n for s, n in zip(plan.starts, plan.query_lens))
    cu_q, cu_k = plan.cu_seqlens[0], plan.cu_seqlens[1]
    return torch.ops.aten._flash_attention_forward(q.contiguous(), torch.cat(keys), torch.cat(values), cu_q, cu_k,
                                                   plan.max_query, max_k, 0.0, True, False, scale=scale)[0]
