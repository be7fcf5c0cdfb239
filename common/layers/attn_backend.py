"""Attention backends: how a forward stores its new K/V and attends over the paged pool.

``torch`` (``attention.py``) runs everywhere and is the reference; ``triton``
(``common/kernels/triton_attention.py``) reads pages in place on CUDA. ``--attention-backend auto``
picks triton on a CUDA device when Triton imports, else torch. Both expose one interface::

    token_ids, plan = backend.plan(chunks, page_size, device)   # host -> device, once per forward
    backend.store(k_cache, v_cache, k, v, plan, k_scale, v_scale)           # per layer
    out = backend.attend(q, k, v, k_cache, v_cache, plan, window, scale, k_scale, v_scale)

``k_scale``/``v_scale`` (default 1.0) are the layer's FP8 scales (``KvCache.k_scales``): an FP8
pool stores K/V quantized and every read dequantizes (``common/kernels/kv_quant.py``); a pool of
the model dtype ignores them.

The elementwise steps around attention go through the backend too (``add_norm``, ``rope_store``
with Qwen3's q/k norm, ``silu_mul``, ``linear``): the torch compositions on the torch path, fused
kernels (``common/kernels/triton_fused.py``) on the triton path. So do a sparse MoE block's router
(``select_experts``) and experts (``fused_moe``: ``common/layers/moe.py``'s references on torch,
``common/kernels/triton_moe.py`` on triton).
``linear`` of an FP8 weight (``common/layers/fp8.py``) goes to ``fp8_linear`` on both (kernel by
device); ``add_norm``/``silu_mul`` take ``feeds``, the weight their output feeds (triton: quantized in
the same launch for a W8A8 per-row linear). MLA's steps (``mla_rows``, ``mla_absorb_q_rows``,
``mla_attend``...) come from ``common/layers/mla_ops.py``. ``cos_sin`` makes a step's rope rows once for
every layer (``rope.cos_sin``; one launch on triton).

A plan has ``positions`` [T], ``last_index`` [B], ``query_lens`` and ``starts`` (host lists: new and
cached tokens per chunk; ``starts`` is None in a CUDA graph's static plan, whose values change
between replays); the rest is the backend's own. ``TritonPlan`` travels to the device as one int64
copy and can also be built from static buffers (CUDA graphs, ``common/engine/cuda_graph.py``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import numpy as np
import torch

from kvferry.common.layers import attention, moe, rope
from kvferry.common.layers.mla_ops import TorchMlaOps, TritonMlaOps
from kvferry.common.kernels.h2d import to_device
from kvferry.common.kernels.quant_rows import SplitParts
from kvferry.common.layers.fp8 import Fp8Weight, TokenQuantized, fp8_linear, route, takes_token_quant
from kvferry.common.layers.norm import rms_norm
from kvferry.common.layers.prefill_attention import sdpa_prefill

ATTENTION_BACKENDS = ("auto", "torch", "triton")
# A prefill batch with a chunk longer than this attends with flash attention (``prefill_attention``): every
# chunk over its whole context, a chunk with no cached prefix over its new K/V as they are (no page
# read), one after a prefix (a prefix-cache hit, a later chunk of a chunked prompt) over its context
# gathered from the pool, causal lower-right. In 16 bits on CUDA the batch is one varlen flash call;
# otherwise one SDPA call per chunk. The paged extend kernel stays for short chunks (verify, small
# extends). Measured on an H100 (bench/extend.py, 8B preset, 14 extends of 576 tokens over 2,560 /
# 7,168 cached): one varlen call 244 / 324 ms, per-chunk SDPA 267 / 367 (a 576-token chunk is 160
# programs a call for 132 SMs), the extend kernel 237 / 335; see bench/RESULTS.md "Where an extend's
# time goes". A batch of prompts from scratch only keeps SDPA per prompt (0.78 of the matmul peak at
# 8k, "engine"): there the varlen call measured 5-14 % slower (two runs, two machines), not settled.
DENSE_PREFILL_MIN_TOKENS = 256


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend ``name`` means on ``device``; raises ValueError for triton off CUDA."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend is {name!r}, expected one of {ATTENTION_BACKENDS}")
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if name == "triton" and (device.type != "cuda" or not has_triton):
        raise ValueError(f"--attention-backend triton needs a CUDA device with Triton installed, got {device}; "
                         "use --attention-backend torch (or auto)")
    return name


def make_backend(name: str, device: torch.device, num_kv_heads: int):
    name = resolve_backend(name, device)
    return TritonBackend(device, num_kv_heads) if name == "triton" else TorchBackend()


def quantized_into_w8a8_gemv(h, w, bias) -> bool:
    """Whether rows ``h`` come quantized per token (``TokenQuantized``) into the W8A8 GEMV of an FP8
    weight ``w`` with per-row scales and no bias: the kernels that fuse work into that GEMV take them."""
    return (isinstance(h, TokenQuantized) and bias is None and isinstance(w, Fp8Weight) and w.block is None
            and route(h.rows, w, h.shape[0]) == "gemv_w8a8")


def qkv_then_rope(attn, h, weight, bias, heads, cos_sin, k_cache, v_cache, plan, k_scale, v_scale, qk_norm):
    """``attn.linear`` of the fused q/k/v weight, its split into heads, then ``attn.rope_store``."""
    num_q, num_kv, head_dim = heads
    qkv = attn.linear(h, weight, bias)
    q, k, v = qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    num_tokens = qkv.shape[0]
    q = q.view(num_tokens, num_q, head_dim)  # [T, Hq (this rank's), D]
    k = k.view(num_tokens, num_kv, head_dim)  # [T, Hkv (this rank's), D]
    v = v.view(num_tokens, num_kv, head_dim)
    return attn.rope_store(q, k, v, cos_sin, k_cache, v_cache, plan, k_scale, v_scale, qk_norm), k, v


class TorchBackend(TorchMlaOps):
    name = "torch"

    def plan(self, chunks, page_size: int, device: torch.device):
        plan = attention.build_plan([len(c.token_ids) for c in chunks], [c.start_pos for c in chunks],
                                    [c.page_ids for c in chunks], page_size, device)
        token_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64).to(device)
        return token_ids, plan

    @staticmethod
    def store(k_cache, v_cache, k, v, plan, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        attention.write_kv(k_cache, v_cache, k, v, plan, k_scale, v_scale)

    def rope_store(self, q, k, v, cos_sin, k_cache, v_cache, plan, k_scale: float = 1.0,
                   v_scale: float = 1.0, qk_norm=None) -> torch.Tensor:
        """Rotates q and k (RMS-normalised per head first by ``qk_norm`` = (wq, wk, eps)), stores k, v."""
        cos, sin = cos_sin
        if qk_norm is not None:
            q, k = rms_norm(q, qk_norm[0], qk_norm[2]), rms_norm(k, qk_norm[1], qk_norm[2])
        self.store(k_cache, v_cache, rope.apply_rotary(k, cos, sin), v, plan, k_scale, v_scale)
        return rope.apply_rotary(q, cos, sin)

    def qkv_rope_store(self, h, weight, bias, heads, cos_sin, k_cache, v_cache, plan, k_scale: float = 1.0,
                       v_scale: float = 1.0, qk_norm=None):
        """The q/k/v projection of ``h`` (``heads``: Hq, Hkv, D), then ``rope_store``: (q rotated, k, v) [T, H, D]."""
        return qkv_then_rope(self, h, weight, bias, heads, cos_sin, k_cache, v_cache, plan, k_scale, v_scale, qk_norm)

    @staticmethod
    def add_norm(x, delta, weight, eps, feeds=None):  # feeds: see TritonBackend.add_norm
        delta = delta.total() if isinstance(delta, SplitParts) else delta
        x = x if delta is None else x + delta
        return x, rms_norm(x, weight, eps)

    @staticmethod
    def silu_mul(gate_up, feeds=None) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def mlp_act(self, h, gate_up_weight, gate_up_bias, down_weight):
        """silu(gate) * up of the gate-up projection of ``h``, the down projection's input."""
        return self.silu_mul(self.linear(h, gate_up_weight, gate_up_bias), feeds=down_weight)

    @staticmethod
    def linear(x, weight, bias=None, to_add_norm: bool = False) -> torch.Tensor:
        """x @ weight.T + bias (an fp32 weight, a router's, takes x in fp32). ``to_add_norm``: the
        output goes to ``add_norm`` as its delta alone (triton: it may come as ``SplitParts``)."""
        if isinstance(weight, Fp8Weight):
            return fp8_linear(x, weight, bias)
        return torch.nn.functional.linear(x.to(weight.dtype) if weight.dtype == torch.float32 else x, weight, bias)

    @staticmethod
    def attend(q, k, v, k_cache, v_cache, plan, window, scale, k_scale: float = 1.0,
               v_scale: float = 1.0, feeds=None) -> torch.Tensor:
        return attention.paged_attention(q, k_cache, v_cache, plan, window, scale, k_scale, v_scale)

    @staticmethod
    def fused_moe(x, w13, w2, topk_weights, topk_ids, extra=None, to_add_norm: bool = False) -> torch.Tensor:
        """+ extra: the shared experts'. ``to_add_norm``: the output goes to ``add_norm`` as its delta alone
        (triton: it may come as ``SplitParts``, the slots unsummed)."""
        return moe.fused_moe_ref(x, w13, w2, topk_weights, topk_ids, extra)

    select_experts = staticmethod(moe.select_experts)

    @classmethod
    def router_topk(cls, h, gate_weight, top_k: int, renormalize: bool, scale=1.0, eps=0.0, out_dtype=None, shared=0):
        """``select_experts`` of the router's logits ``linear(h, gate_weight)``."""
        return cls.select_experts(cls.linear(h, gate_weight), top_k, renormalize, scale, eps, out_dtype, shared)
    cos_sin = staticmethod(rope.cos_sin)


@dataclass(frozen=True)
class TritonPlan:
    """Device index tensors of one forward (int64; views of one buffer unless built for a graph)."""

    positions: torch.Tensor  # [T]
    write_pages: torch.Tensor  # [T] page of each new token (-1: padding, not stored)
    write_rows: torch.Tensor  # [T]
    last_index: torch.Tensor  # [B] packed index of each chunk's last token
    kv_lens: torch.Tensor  # [B] prefix + new tokens (0: padding row)
    q_starts: torch.Tensor  # [B]
    q_lens: torch.Tensor  # [B]
    prefix_lens: torch.Tensor  # [B]
    page_table: torch.Tensor  # [B, max_pages]
    query_lens: list[int]
    max_query: int
    num_splits: int  # decode split-K
    is_long_prefill: bool = False  # a chunk is long (DENSE_PREFILL_MIN_TOKENS): flash attention, ``_sdpa_prefill``
    starts: list[int] | None = None  # cached tokens before each chunk (host); None in a graph's static plan
    cu_seqlens: torch.Tensor | None = None  # [2, B + 1] int32 query and context offsets (a long prefill with a prefix, CUDA)


def packed_rows(num_tokens: int, batch: int) -> tuple[int, int]:
    """Row lengths of a packed plan's per-token and per-chunk sections: the counts rounded up to even.

    Every row of the packed int64 buffer then starts 16-byte aligned. Triton specializes a pointer
    argument on 16-byte alignment, so with rows packed back to back an odd token or chunk count
    shifted every row after it by 8 bytes and compiled a second variant of each kernel that reads
    them, in the middle of serving: a batch of another parity stalled its step by the compile. (The
    first prefix-hit wave after the multiturn warm-up stalled ~0.6 s once per process before this,
    and no more since: bench/RESULTS.md "The turn-2 stall found".)"""
    return num_tokens + (num_tokens & 1), batch + (batch & 1)


def pack_chunks(chunks, page_size: int) -> tuple[np.ndarray, int]:
    """Host side of a TritonPlan: [token_ids, positions, write_pages, write_rows (T each), last_index,
    kv_lens, q_starts, q_lens, prefix_lens (B each), page_table (B * max_pages)] as one int64 array,
    each row padded to ``packed_rows``' even length (``unpack`` gives the views)."""
    query_lens = np.fromiter((len(c.token_ids) for c in chunks), np.int64, len(chunks))
    prefix = np.fromiter((c.start_pos for c in chunks), np.int64, len(chunks))
    kv_lens = prefix + query_lens
    num_pages = -(-kv_lens // page_size)
    max_pages = int(num_pages.max())
    num_tokens, batch = int(query_lens.sum()), len(chunks)
    token_row, chunk_row = packed_rows(num_tokens, batch)
    out = np.zeros(4 * token_row + 5 * chunk_row + batch * max_pages, np.int64)
    per_token, per_chunk, table = unpack(out, num_tokens, batch, max_pages)
    for i, c in enumerate(chunks):
        table[i, :num_pages[i]] = c.page_ids[:num_pages[i]]
    ends = np.cumsum(query_lens)
    starts = ends - query_lens
    if num_tokens == batch:  # one token per chunk (decode): no per-chunk ranges
        positions = prefix
        per_token[0] = [c.token_ids[0] for c in chunks]
    else:
        positions = np.concatenate([np.arange(p, p + n) for p, n in zip(prefix, query_lens)])
        per_token[0] = [t for c in chunks for t in c.token_ids]
    owner = np.repeat(np.arange(batch), query_lens)
    per_token[1] = positions
    per_token[2] = table[owner, positions // page_size]
    per_token[3] = positions % page_size
    per_chunk[0], per_chunk[1], per_chunk[2], per_chunk[3], per_chunk[4] = ends - 1, kv_lens, starts, query_lens, prefix
    return out, max_pages


def unpack(packed, num_tokens: int, batch: int, max_pages: int):
    """Views of a ``pack_chunks`` buffer (numpy or torch): per-token rows [4, T], per-chunk rows
    [5, B] and the page table [B, max_pages]."""
    token_row, chunk_row = packed_rows(num_tokens, batch)
    at = 4 * token_row + 5 * chunk_row
    per_token = packed[:4 * token_row].reshape(4, token_row)[:, :num_tokens]
    per_chunk = packed[4 * token_row:at].reshape(5, chunk_row)[:, :batch]
    return per_token, per_chunk, packed[at:at + batch * max_pages].reshape(batch, max_pages)


class TritonBackend(TritonMlaOps):
    name = "triton"

    def __init__(self, device: torch.device, num_kv_heads: int) -> None:
        from kvferry.common.kernels import (triton_absorb, triton_attention, triton_fused, triton_gemv,  # triton: only here
                                            triton_mla, triton_mlp, triton_moe, triton_qkv)

        self.kernels, self.absorb = triton_attention, triton_absorb
        # A/B switches (bench/engine.py): the absorbed projections as kernels, the step's rope cos/sin in
        # one launch; MLA's rows in absorb_q's launch off: on an H100 (trees fcecc59, c0637bc) the two
        # launches measured 1-3 % faster at batch 1 in three runs (batch 64 within noise)
        self.absorb_kernels = self.rope_kernel = True
        self.fuse_mla_rows = False
        # a one-row router's logits and picks in one launch (router_topk): off, as on an H100 (tree 5c0ffc8) it was
        # no faster at batch 1 (DeepSeek-V2-Lite 0.420 ms either way, Qwen3-30B-A3B 0.590 against 0.585 with two)
        self.fuse_router = False
        # a W8A8 gate-up with its silu and quant (triton_mlp): the 8B FP8 batch-64 step 6.944 ms against 7.124 (H100)
        self.fuse_gate_up = True
        self.sum_in_norm = True  # o_proj's and down's split-K parts added by the next add_norm (linear's to_add_norm)
        # a MoE block's slots added by the next add_norm (fused_moe's to_add_norm): slower at batch 1 on an H100 (a
        # norm's one program a row adds 8 slot rows where slot_sum spreads them; Qwen3-30B-A3B 0.571 ms against 0.563)
        self.moe_sum_in_norm = False
        self.fuse_qkv_rope = True  # a W8A8 q/k/v projection with its rope and K/V store (triton_qkv)
        self.mla, self.fused, self.gemv, self.moe, self.mlp = triton_mla, triton_fused, triton_gemv, triton_moe, triton_mlp
        self.qkv = triton_qkv
        self.num_kv_heads = num_kv_heads
        # (a CPU device only under TRITON_INTERPRET=1, in tests)
        is_cuda = device.type == "cuda"
        # one-row bf16 projections through triton_gemv.gemv: the 8B batch-1 step 4.33 ms against
        # cuBLAS's 4.95 on an H200 (bench/RESULTS.md "Decode-sized GEMMs")
        self.use_gemv = is_cuda
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if is_cuda else 4

    def num_splits(self, batch: int) -> int:
        return self.kernels.num_decode_splits(batch, self.num_kv_heads, self.num_sms)

    def plan(self, chunks, page_size: int, device: torch.device):
        host, max_pages = pack_chunks(chunks, page_size)
        packed = to_device(host, device)  # pinned and non-blocking: no wait for the step in flight
        query_lens = [len(c.token_ids) for c in chunks]
        per_token, per_chunk, table = unpack(packed, sum(query_lens), len(chunks), max_pages)
        is_long = max(query_lens) > DENSE_PREFILL_MIN_TOKENS
        cu_seqlens = None
        if is_long and device.type == "cuda" and any(c.start_pos for c in chunks):  # the varlen call's offsets
            lens = np.array([query_lens, [c.start_pos + n for c, n in zip(chunks, query_lens)]], np.int32)
            cu_seqlens = to_device(np.concatenate([np.zeros((2, 1), np.int32), lens.cumsum(1, dtype=np.int32)], 1),
                                   device)
        plan = TritonPlan(
            positions=per_token[1], write_pages=per_token[2], write_rows=per_token[3], last_index=per_chunk[0],
            kv_lens=per_chunk[1], q_starts=per_chunk[2], q_lens=per_chunk[3], prefix_lens=per_chunk[4],
            page_table=table, query_lens=query_lens, max_query=max(query_lens),
            num_splits=self.num_splits(len(chunks)),
            is_long_prefill=is_long, starts=[c.start_pos for c in chunks], cu_seqlens=cu_seqlens)
        return per_token[0], plan

    def store(self, k_cache, v_cache, k, v, plan: TritonPlan, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        self.kernels.store_kv(k_cache, v_cache, k, v, plan.write_pages, plan.write_rows, k_scale, v_scale)

    def rope_store(self, q, k, v, cos_sin, k_cache, v_cache, plan: TritonPlan, k_scale: float = 1.0,
                   v_scale: float = 1.0, qk_norm=None) -> torch.Tensor:
        cos, sin = cos_sin
        return self.fused.rope_store(q, k, v, cos, sin, k_cache, v_cache, plan.write_pages, plan.write_rows,
                                     k_scale, v_scale, qk_norm)

    def qkv_rope_store(self, h, weight, bias, heads, cos_sin, k_cache, v_cache, plan: TritonPlan,
                       k_scale: float = 1.0, v_scale: float = 1.0, qk_norm=None):
        """As TorchBackend's; a W8A8 q/k/v projection (17-64 rows quantized by the norm, per-row scales, K whole,
        no bias or q/k norm) runs with the rope and the K/V store in its launch (``triton_qkv``)."""
        w, num_q, num_kv, head_dim = weight, *heads
        if (self.fuse_qkv_rope and quantized_into_w8a8_gemv(h, w, bias) and qk_norm is None
                and self.qkv.takes(h.shape[0], *w.shape, head_dim)):
            return self.qkv.qkv_rope_store(h.q, h.scale, w.weight, w.scale, h.rows.dtype, num_q, num_kv, *cos_sin,
                                           k_cache, v_cache, plan.write_pages, plan.write_rows, k_scale, v_scale)
        return qkv_then_rope(self, h, weight, bias, heads, cos_sin, k_cache, v_cache, plan, k_scale, v_scale, qk_norm)

    def add_norm(self, x, delta, weight, eps, feeds=None):
        """In one launch; quantized too (``fp8.TokenQuantized``) if ``feeds``, the weight it feeds, takes that.
        A ``SplitParts`` delta (``linear`` with ``to_add_norm``) is added up in that launch."""
        return self.fused.add_rms_norm(x, delta, weight, eps, quant=takes_token_quant(feeds, x))

    def silu_mul(self, gate_up, feeds=None):  # quantized too as add_norm says
        return self.fused.silu_mul(gate_up, quant=takes_token_quant(feeds, gate_up))

    def mlp_act(self, h, gate_up_weight, gate_up_bias, down_weight):
        """As TorchBackend's; a W8A8 gate-up (17-64 rows quantized by the norm, per-row scales, K whole)
        whose down takes its input quantized runs with the silu and quant in two launches (``triton_mlp``)."""
        w = gate_up_weight
        if (self.fuse_gate_up and quantized_into_w8a8_gemv(h, w, gate_up_bias)
                and takes_token_quant(down_weight, h.rows) and self.mlp.takes(h.shape[0], *w.shape)):
            return self.mlp.gate_up_silu_quant(h.q, h.scale, w.weight, w.scale, h.rows.dtype)
        return self.silu_mul(self.linear(h, gate_up_weight, gate_up_bias), feeds=down_weight)

    def linear(self, x, weight, bias=None, to_add_norm: bool = False) -> torch.Tensor | SplitParts:
        # use_gemv (on CUDA): one row through triton_gemv.gemv instead of cuBLAS; bench/engine.py
        # measures the batch-1 step both ways. to_add_norm (sum_in_norm on): a split-K FP8 GEMV's
        # parts come back unsummed, for add_norm's launch to add (one launch fewer).
        if isinstance(weight, Fp8Weight):
            return fp8_linear(x, weight, bias, defer_sum=to_add_norm and self.sum_in_norm)
        x = x.rows if isinstance(x, TokenQuantized) else x
        if x.shape[0] == 1 and self.use_gemv:  # an fp32 weight: fp32 out, as TorchBackend.linear
            return self.gemv.gemv(x, weight, bias)
        return TorchBackend.linear(x, weight, bias)

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids, extra=None, to_add_norm: bool = False):
        """The extra add in the slot sum's launch; with ``to_add_norm`` (``moe_sum_in_norm`` on, no extra) the
        weighted slots come back unsummed (``SplitParts``), for add_norm's launch to add (one launch fewer; off)."""
        return self.moe.fused_moe(x, w13, w2, topk_weights, topk_ids, extra,
                                  defer_sum=to_add_norm and self.moe_sum_in_norm)

    def select_experts(self, logits, top_k: int, renormalize: bool, scale=1.0, eps=0.0, out_dtype=None, shared=0):
        """As ``moe.select_experts``, in one launch (``triton_moe.softmax_topk``)."""
        return self.moe.softmax_topk(logits, top_k, renormalize, out_dtype or logits.dtype, scale, eps, shared)

    def router_topk(self, h, gate_weight, top_k: int, renormalize: bool, scale=1.0, eps=0.0, out_dtype=None, shared=0):
        """The router's logits and picks: ``linear`` then ``select_experts``, or at one row with
        ``fuse_router`` in one launch (``triton_moe.router_topk``)."""
        if h.shape[0] == 1 and self.use_gemv and self.fuse_router and not isinstance(gate_weight, Fp8Weight):
            h = h.rows if isinstance(h, TokenQuantized) else h
            out_dtype = out_dtype or torch.promote_types(h.dtype, gate_weight.dtype)
            return self.moe.router_topk(h, gate_weight, top_k, renormalize, out_dtype, scale, eps, shared)
        return self.select_experts(self.linear(h, gate_weight), top_k, renormalize, scale, eps, out_dtype, shared)

    def cos_sin(self, positions, inv_freq, dtype, factor: float = 1.0, dup: bool = True):
        """As ``rope.cos_sin``, in one launch (``triton_fused.cos_sin``) unless ``rope_kernel`` is off."""
        return (self.fused.cos_sin if self.rope_kernel else rope.cos_sin)(positions, inv_freq, dtype, factor, dup)

    def attend(self, q, k, v, k_cache, v_cache, plan: TritonPlan, window, scale, k_scale: float = 1.0,
               v_scale: float = 1.0, feeds=None) -> torch.Tensor | TokenQuantized:
        """q, k (rotated), v: the new tokens [T, H, D]; k_cache, v_cache hold them already. ``feeds``:
        the weight that reads the output; a decode that takes it quantized per token gets its rows
        [T, H * D] as ``TokenQuantized`` (one split: from the attention's own launch)."""
        if plan.is_long_prefill and window is None and plan.starts is not None:
            return sdpa_prefill(q, k, v, k_cache, v_cache, plan, scale, k_scale, v_scale)
        if plan.max_query == 1:  # q[:, 0]: a [T, D] view standing for the rows in the route's check
            quant = feeds is not None and takes_token_quant(feeds, q[:, 0])
            return self.kernels.decode_attention(q, k_cache, v_cache, plan.page_table, plan.kv_lens, scale, window,
                                                 plan.num_splits, k_scale, v_scale, quant=quant)
        return self.kernels.extend_attention(q, k_cache, v_cache, plan.page_table, plan.q_starts, plan.q_lens,
                                             plan.prefix_lens, plan.max_query, scale, window, k_scale, v_scale)
