"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache: absorbed and expanded forms.

Per token: ``kv_a_proj_with_mqa`` gives ``[c (kv_lora_rank) | k_pe (qk_rope_head_dim)]``; ``c``
goes through ``kv_a_layernorm``, ``k_pe`` is roped, and the row ``[c | k_pe]`` is all the cache
keeps (``common/cache/mla_cache.py``). ``kv_b_proj`` [H * (nope + v), L] holds, per head, W_UK
[nope, L] (k_nope = W_UK c) and W_UV [v, L] (value = W_UV c). The same numbers (up to rounding)
come out of two forms, and each step takes the cheaper one (``attends_expanded``):

absorbed (decode, spec-dec verify, short extends over a long prefix)::

    q_latent = q_nope @ W_UK                        # [T, H, L]: q_nope . k_nope == q_latent . c
    score    = (q_latent . c + q_pe . k_pe) * scale  # one MQA over rows [c | k_pe]
    out      = (probs @ c) @ W_UV^T                  # [T, H, v]

One MQA over the latent rows with key width ``L + R`` and value width ``L``, run by the backend's
``mla_attend`` (the torch paged attention, ``attention.py``, or the Triton kernels,
``common/kernels/triton_mla.py``); the two per-head products by W_UK and W_UV are the backend's
``mla_absorb_q``/``mla_absorb_v`` (``einsum`` on torch, ``absorb_q_ref``/``absorb_v_ref``; one
launch each on triton, ``common/kernels/triton_absorb.py``). The step's new rows are made and stored
through ``mla_absorb_q_rows``: ``mla_rows`` then ``mla_absorb_q`` (on triton in one launch with
``fuse_mla_rows``, off by default: two measured faster). Nothing is expanded, so a step reads
L + R elements per cached token: right when few queries share a long context (decode reads the
context once per token).
It is the only form a CUDA graph's static plan takes (its lengths live on the device).

expanded (prefill, chunked prefill: many new tokens per sequence), what transformers computes::

    rows     = [cached prefix rows (mla_prefix) | the new rows]      # per sequence
    k        = [W_UK c | k_pe broadcast over heads], v = W_UV c     # [kv_len, H, nope + R], [kv_len, H, v]
    out      = causal SDPA([q_nope | q_pe], k, v) * scale           # queries at offset prefix

Attention then costs (nope + R) + v = 320 multiply-adds per (query, key, head) at DeepSeek's
shapes instead of (L + R) + L = 1088, for one GEMM of the context through kv_b_proj; with many
queries per key that wins by ~3x. SDPA's flash kernel takes it on CUDA: flash wants one head dim
for q, k and v, so v is zero-padded to nope + R and the output sliced; a chunk after a cached
prefix uses ``causal_lower_right`` (flash's own bottom-right causal; SDPA's ``is_causal`` is
top-left aligned). A prompt with no prefix attends to its new rows as computed, no gather.

Under tensor parallelism (``shard``) a rank holds its block of heads: their rows of q_proj (or
q_b_proj) and kv_b_proj and their columns of o_proj, whose output is this rank's partial sum (the
decoder layer adds the ranks' with one all_reduce; o_proj's bias on rank 0 only). q_a_proj,
kv_a_proj_with_mqa and their norms are replicated: every rank computes the same latent rows and
its cache holds all of them; the expanded form expands them through its own heads' kv_b_proj rows.
Both forms are checked against each other in ``tests/unit/test_mla_forms.py`` (fp32, CPU) and
``tests/gpu/test_mla_prefill_gpu.py`` (bf16, DeepSeek-V2-Lite's shapes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from kvferry.common.layers import rope
from kvferry.common.layers.norm import rms_norm
from kvferry.common.layers.tp_layers import TensorSlot, TpShard, head_slice
from kvferry.common.models.config import ModelConfig
from kvferry.common.models.deepseek_config import DeepseekSpec

MLA_FORMS = ("auto", "absorbed", "expanded")
# A step whose chunks all have at most this many new tokens stays absorbed whatever the estimate:
# decode (1) and spec-dec verify (k + 1) steps, as the torch backend's padded path bounds them.
ABSORBED_MAX_QUERY_TOKENS = 16


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: the loader overwrites every element.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def attends_expanded(query_lens: list[int], starts: list[int] | None, spec: DeepseekSpec) -> bool:
    """Whether a step of chunks with ``query_lens[i]`` new tokens after ``starts[i]`` cached ones
    attends in the expanded form: never for decode / verify-sized steps (every chunk at most
    ``ABSORBED_MAX_QUERY_TOKENS``) or without host starts (a CUDA graph's plan); else when its
    multiply-adds per head are no more than the absorbed form's. Per (query, key) pair the absorbed
    form spends 2L + R, the expanded nope + R + v; per new token the absorbed form also pays
    q_nope @ W_UK and out @ W_UV^T ((nope + v) L), the expanded per context row the kv_b_proj
    expansion ((nope + v) L). So a prompt, or a long chunk, goes expanded; a short extend over a
    long cached prefix (a prefix-cache hit; ~170 new tokens is the break-even at DeepSeek's shapes)
    stays absorbed. An estimate of work, not of time: both kernels skip masked tiles alike."""
    if starts is None or max(query_lens) <= ABSORBED_MAX_QUERY_TOKENS:
        return False
    latent, rope_dim, nope, v = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim, spec.v_head_dim
    pairs = sum(n * start + n * (n + 1) // 2 for n, start in zip(query_lens, starts))  # causal (query, key)
    context = sum(n + start for n, start in zip(query_lens, starts))
    absorbed = pairs * (2 * latent + rope_dim) + sum(query_lens) * (nope + v) * latent
    expanded = pairs * (nope + rope_dim + v) + context * (nope + v) * latent
    return expanded <= absorbed


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    """One sequence's expanded attention: q [n, H, Dqk] at positions prefix.., k [prefix + n, H, Dqk],
    v [prefix + n, H, Dv] (unit last strides) -> [n, H, Dv]; query i sees keys up to prefix + i.

    Flash (CUDA, 16-bit) needs Dv == Dqk: v is zero-padded to Dqk (the extra output columns are 0
    and dropped), which costs (Dqk - Dv) / (Dqk + Dv) more attention work but keeps the fastest
    kernel; without flash SDPA takes the unequal widths as they are."""
    num_new, kv_len, head_dim = q.shape[0], k.shape[0], v.shape[-1]
    if k.shape[0] != v.shape[0] or kv_len != prefix + num_new or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"MLA expanded attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} with a "
                         f"prefix of {prefix}: k and v need prefix + {num_new} rows and k the query's width")
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and head_dim != q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - head_dim))
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, rows, D] views
    mask = causal_lower_right(num_new, kv_len) if prefix and num_new > 1 else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not prefix and num_new > 1, scale=scale)
    return out[0, :, :, :head_dim].transpose(0, 1)


def absorb_q_ref(q_nope: torch.Tensor, w_uk: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """The absorbed query [T, H, L + R]: q_nope [T, H, nope] times each head's W_UK [H, nope, L], then q_pe
    (the torch path, and the reference of ``triton_absorb.absorb_q``)."""
    return torch.cat((torch.einsum("thd,hdl->thl", q_nope, w_uk), q_pe), dim=-1)


def absorb_v_ref(out: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The latent attention's output [T, H, L] times each head's W_UV [H, v, L] -> [T, H * v] (the torch
    path, and the reference of ``triton_absorb.absorb_v``)."""
    return torch.einsum("thl,hvl->thv", out, w_uv).reshape(out.shape[0], -1)


def prefix_rows(cache: torch.Tensor, pages: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The first ``num_rows`` rows [num_rows, L + R] of a sequence whose pages (in order, maybe more
    than it needs) are ``pages``, from the latent cache [num_pages, page_size, L + R] (any page stride)."""
    num_pages = -(-num_rows // cache.shape[1])
    return cache.index_select(0, pages[:num_pages]).flatten(0, 1)[:num_rows]


class LatentRope:
    """cos/sin of the rope part, as DeepSeek lays it out: interleaved pairs (x0, x1), (x2, x3), ...
    (V2; V3 with ``rope_interleave``) or halves (i, i + R/2). The interleaved result is written
    de-interleaved (evens then odds, as transformers' V3 does): the same dot products."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq = rope.inv_frequencies(config).to(device)  # [R / 2]
        self.factor = rope.attention_factor(config)
        self.dtype = dtype
        self.is_interleaved = config.deepseek.is_rope_interleaved

    def cos_sin(self, positions: torch.Tensor, attn=None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, R / 2] (broadcast over heads), through ``attn.cos_sin``
        (one launch on triton) when a backend is given."""
        make = attn.cos_sin if attn is not None else rope.cos_sin
        return make(positions, self.inv_freq, self.dtype, self.factor, dup=False)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, R] -> rotated [T, H, R]."""
        if self.is_interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return rope.apply_rotary(x, cos, sin)


def latent_rows_ref(kv_a: torch.Tensor, q_pe: torch.Tensor, cos_sin, norm: torch.Tensor, eps: float,
                    rotary: LatentRope, cache: torch.Tensor | None = None, plan=None) -> tuple[torch.Tensor, ...]:
    """kv_a [T, L + R] (kv_a_proj's output), q_pe [T, H, R] -> (roped q_pe, cache rows
    [rms_norm(latent) | roped k_pe]); the rows stored into the latent cache [num_pages, page_size,
    L + R] at the plan's (page, row) when a cache is given. The torch backend's ``mla_rows`` and
    the reference of ``triton_mla.latent_rows``."""
    cos, sin = cos_sin
    latent, k_pe = kv_a.split([kv_a.shape[1] - q_pe.shape[2], q_pe.shape[2]], -1)
    rows = torch.cat((rms_norm(latent, norm, eps), rotary.apply(k_pe[:, None], cos, sin)[:, 0]), -1)
    if cache is not None:
        cache.index_put_((plan.write_pages, plan.write_rows), rows.to(cache.dtype))
    return rotary.apply(q_pe, cos, sin), rows


class MlaAttention(nn.Module):
    """One layer's MLA weights (Hugging Face names in ``hf_tensor_map``) and its forward."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device,
                 shard: TpShard | None = None) -> None:
        super().__init__()
        c, s = config, config.deepseek
        self.config, self.spec, self.layer = config, s, layer
        self.shard = shard = shard or TpShard.single(config)
        heads, hidden = shard.q_heads.count, c.hidden_size  # this rank's heads (all at TP 1)
        bias = s.has_attention_bias
        # q_proj (V2: this rank's heads) or q_a_proj (V3), then kv_a_proj_with_mqa: the two projections of h,
        # one weight, so one GEMM (one GEMV launch at a decode row); q_weight / q_a_weight and kv_a_weight are
        # views of it (in_bias likewise holds both biases)
        self.q_rows = heads * s.qk_head_dim if s.q_lora_rank is None else s.q_lora_rank
        self.in_weight = _param((self.q_rows + s.latent_width, hidden), dtype, device)
        # the bias rows of q_proj, which has none (V2), stay zero; the loader fills the others
        self.in_bias = nn.Parameter(torch.zeros(self.in_weight.shape[0], dtype=dtype, device=device),
                                    requires_grad=False) if bias else None
        if s.q_lora_rank is None:
            self.q_weight = self.in_weight[:self.q_rows]
        else:
            self.q_a_weight = self.in_weight[:self.q_rows]
            self.q_a_norm = _param((s.q_lora_rank,), dtype, device)
            self.q_b_weight = _param((heads * s.qk_head_dim, s.q_lora_rank), dtype, device)
        self.kv_a_weight = self.in_weight[self.q_rows:]
        self.kv_a_norm = _param((s.kv_lora_rank,), dtype, device)
        self.kv_b_weight = _param((heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank), dtype, device)
        self.o_weight = _param((hidden, heads * s.v_head_dim), dtype, device)
        self.o_bias = _param((hidden,), dtype, device) if bias else None
        self.scale = rope.yarn_softmax_scale(config, s.qk_head_dim ** -0.5)
        # "auto": each step as ``attends_expanded`` says; "absorbed" / "expanded" force one (tests)
        self.form = "auto"

    def hf_tensor_map(self, prefix: str) -> dict[str, TensorSlot]:
        """Hugging Face name (under ``prefix`` + "self_attn.") -> destination: this rank's heads of
        q_proj / q_b_proj and kv_b_proj (rows) and of o_proj (columns), everything else whole."""
        p, s, heads, num_heads = prefix + "self_attn.", self.spec, self.shard.q_heads, self.config.num_attention_heads
        rows, latent = self.q_rows, s.latent_width
        out = {p + "kv_a_proj_with_mqa.weight": TensorSlot(self.in_weight, rows, latent),
               p + "kv_a_layernorm.weight": TensorSlot(self.kv_a_norm, 0, s.kv_lora_rank)}
        if s.q_lora_rank is not None:
            out.update({p + "q_a_proj.weight": TensorSlot(self.in_weight, 0, rows),
                        p + "q_a_layernorm.weight": TensorSlot(self.q_a_norm, 0, rows)})
        if s.has_attention_bias:
            out.update({p + "kv_a_proj_with_mqa.bias": TensorSlot(self.in_bias, rows, latent),
                        p + "o_proj.bias": TensorSlot(self.o_bias, 0, self.o_bias.shape[0])})
            if s.q_lora_rank is not None:
                out[p + "q_a_proj.bias"] = TensorSlot(self.in_bias, 0, rows)
        kv_b_dim = s.qk_nope_head_dim + s.v_head_dim
        q_source = head_slice(0, heads, num_heads, s.qk_head_dim)
        if s.q_lora_rank is None:
            out[p + "q_proj.weight"] = TensorSlot(self.in_weight, 0, rows, q_source)
        else:
            out[p + "q_b_proj.weight"] = TensorSlot(self.q_b_weight, 0, self.q_b_weight.shape[0], q_source)
        for name, weight, source in (
                ("kv_b_proj", self.kv_b_weight, head_slice(0, heads, num_heads, kv_b_dim)),
                ("o_proj", self.o_weight, head_slice(1, heads, num_heads, s.v_head_dim))):
            out[f"{p}{name}.weight"] = TensorSlot(weight, 0, weight.shape[0], source)
        return out

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, L] and W_UV [H, v, L]: views of kv_b_proj."""
        s = self.spec
        kv_b = self.kv_b_weight.view(self.shard.q_heads.count, s.qk_nope_head_dim + s.v_head_dim, -1)
        return kv_b[:, :s.qk_nope_head_dim], kv_b[:, s.qk_nope_head_dim:]

    def project(self, h: torch.Tensor, rotary: LatentRope, cos_sin, attn, cache: torch.Tensor | None = None,
                plan=None) -> tuple[torch.Tensor, ...]:
        """h [T, hidden] -> q_nope [T, H, nope], roped q_pe [T, H, R], cache rows [T, L + R]; the rows
        also stored into ``cache`` at the plan's (page, row) when a cache is given."""
        q_nope, q_pe, kv_a = self.projections(h, attn)
        q_pe, rows = attn.mla_rows(kv_a, q_pe, cos_sin, self.kv_a_norm, self.config.rms_norm_eps, rotary, cache, plan)
        return q_nope, q_pe, rows

    def projections(self, h: torch.Tensor, attn) -> tuple[torch.Tensor, ...]:
        """h [T, hidden] -> q_nope [T, H, nope], q_pe [T, H, R] (not rotated), kv_a [T, L + R]: views of
        one GEMM's rows (V2), or q_b_proj's (V3)."""
        s, num_tokens = self.spec, h.shape[0]
        q, kv_a = attn.linear(h, self.in_weight, self.in_bias).split([self.q_rows, s.latent_width], -1)
        if s.q_lora_rank is not None:
            q = attn.linear(rms_norm(q, self.q_a_norm, self.config.rms_norm_eps), self.q_b_weight)
        q_nope, q_pe = q.view(num_tokens, -1, s.qk_head_dim).split([s.qk_nope_head_dim, s.qk_rope_head_dim], -1)
        return q_nope, q_pe, kv_a

    def uses_expanded(self, plan) -> bool:
        """Whether this step attends in the expanded form (``self.form``; "auto": ``attends_expanded``)."""
        if self.form not in MLA_FORMS:
            raise ValueError(f"MLA form is {self.form!r}, expected one of {MLA_FORMS}")
        if self.form == "auto":
            return attends_expanded(plan.query_lens, plan.starts, self.spec)
        if self.form == "expanded" and plan.starts is None:
            raise ValueError("MLA form 'expanded' needs a plan with host starts; a CUDA graph's static plan has "
                             "none (decode and verify graphs run absorbed)")
        return self.form == "expanded"

    def forward(self, h: torch.Tensor, rotary: LatentRope, cos_sin, cache: torch.Tensor, plan, attn) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]; writes the T new rows into ``cache`` [num_pages, page_size, L + R]."""
        num_tokens = h.shape[0]
        if self.uses_expanded(plan):
            q_nope, q_pe, rows = self.project(h, rotary, cos_sin, attn, cache, plan)  # rows stored
            out = self.attend_expanded(q_nope, q_pe, rows.to(cache.dtype), cache, plan, attn)
        else:
            out = self.attend_absorbed(h, rotary, cos_sin, cache, plan, attn)
        bias = self.o_bias if self.shard.adds_row_bias else None
        return attn.linear(out.reshape(num_tokens, -1), self.o_weight, bias)

    def attend_absorbed(self, h: torch.Tensor, rotary: LatentRope, cos_sin, cache: torch.Tensor, plan,
                        attn) -> torch.Tensor:
        """-> [T, H * v]: one MQA over the cached latent rows (the new ones made and stored in the
        absorbed query's launch on triton: ``mla_absorb_q_rows``), module docstring."""
        w_uk, w_uv = self.absorbed()
        q_nope, q_pe, kv_a = self.projections(h, attn)
        q = attn.mla_absorb_q_rows(q_nope, w_uk, q_pe, kv_a, cos_sin, self.kv_a_norm, self.config.rms_norm_eps,
                                   rotary, cache, plan)  # [T, H, L + R]
        out = attn.mla_attend(q, cache, plan, self.spec.kv_lora_rank, self.scale)  # [T, H, L]
        return attn.mla_absorb_v(out, w_uv)

    def attend_expanded(self, q_nope, q_pe, rows: torch.Tensor, cache: torch.Tensor, plan, attn) -> torch.Tensor:
        """-> [T, H, v]: per chunk, causal attention over its whole context (cached prefix + ``rows``,
        the new rows as the cache holds them) expanded through this rank's kv_b_proj rows."""
        s, heads = self.spec, self.shard.q_heads.count
        starts, query_lens = plan.starts, plan.query_lens
        if any(starts):  # every context, chunk after chunk; without prefixes that is just the new rows
            pieces, offset = [], 0
            for i, (start, num_new) in enumerate(zip(starts, query_lens)):
                if start:
                    pieces.append(attn.mla_prefix(cache, plan, i))
                pieces.append(rows[offset:offset + num_new])
                offset += num_new
            rows = torch.cat(pieces)
        latent, k_pe = rows.split([s.kv_lora_rank, s.qk_rope_head_dim], -1)
        kv = attn.linear(latent, self.kv_b_weight).view(-1, heads, s.qk_nope_head_dim + s.v_head_dim)
        k_nope, v = kv.split([s.qk_nope_head_dim, s.v_head_dim], -1)
        k = torch.cat((k_nope, k_pe[:, None].expand(-1, heads, -1)), -1)  # [rows, H, nope + R]
        q = torch.cat((q_nope, q_pe), -1)  # [T, H, nope + R]
        out = q.new_empty(q.shape[:-1] + (s.v_head_dim,))
        q_at = kv_at = 0
        for start, num_new in zip(starts, query_lens):
            kv_len = start + num_new
            out[q_at:q_at + num_new] = causal_attention(q[q_at:q_at + num_new], k[kv_at:kv_at + kv_len],
                                                        v[kv_at:kv_at + kv_len], start, self.scale)
            q_at, kv_at = q_at + num_new, kv_at + kv_len
        return out
