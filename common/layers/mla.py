"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache, absorbed form.

Per token: ``kv_a_proj_with_mqa`` gives ``[c (kv_lora_rank) | k_pe (qk_rope_head_dim)]``; ``c``
goes through ``kv_a_layernorm``, ``k_pe`` is roped, and the row ``[c | k_pe]`` is all the cache
keeps (``common/cache/mla_cache.py``). ``kv_b_proj`` [H * (nope + v), L] holds, per head, W_UK
[nope, L] (k_nope = W_UK c) and W_UV [v, L] (value = W_UV c). Attention never expands them::

    q_latent = q_nope @ W_UK                        # [T, H, L]: q_nope . k_nope == q_latent . c
    score    = (q_latent . c + q_pe . k_pe) * scale  # one MQA over rows [c | k_pe]
    out      = (probs @ c) @ W_UV^T                  # [T, H, v]

so every phase (prefill, chunked extend, verify, decode) is one MQA over the latent rows with key
width ``L + R`` and value width ``L``, run by the backend's ``mla_attend`` (the torch paged
attention, ``attention.py``, or the Triton kernels, ``common/kernels/triton_mla.py``). The
expanded form (k = [W_UK c | k_pe], v = W_UV c per head, what transformers computes) gives the same
numbers up to rounding (``tests/unit/test_deepseek.py``).

Under tensor parallelism (``shard``) a rank holds its block of heads: their rows of q_proj (or
q_b_proj) and kv_b_proj and their columns of o_proj, whose output is this rank's partial sum (the
decoder layer adds the ranks' with one all_reduce; o_proj's bias on rank 0 only). q_a_proj,
kv_a_proj_with_mqa and their norms are replicated: every rank computes the same latent rows and
its cache holds all of them.
"""

from __future__ import annotations

import torch
from torch import nn

from kvferry.common.layers import rope
from kvferry.common.layers.norm import rms_norm
from kvferry.common.layers.tp_layers import TensorSlot, TpShard, head_slice
from kvferry.common.models.config import ModelConfig


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: the loader overwrites every element.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class LatentRope:
    """cos/sin of the rope part, as DeepSeek lays it out: interleaved pairs (x0, x1), (x2, x3), ...
    (V2; V3 with ``rope_interleave``) or halves (i, i + R/2). The interleaved result is written
    de-interleaved (evens then odds, as transformers' V3 does): the same dot products."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq = rope.inv_frequencies(config).to(device)  # [R / 2]
        self.factor = rope.attention_factor(config)
        self.dtype = dtype
        self.is_interleaved = config.deepseek.is_rope_interleaved

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, R / 2] (broadcast over heads)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = freqs.cos() * self.factor, freqs.sin() * self.factor
        return cos.to(self.dtype)[:, None, :], sin.to(self.dtype)[:, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, R] -> rotated [T, H, R]."""
        if self.is_interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return rope.apply_rotary(x, cos, sin)


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
        if s.q_lora_rank is None:
            self.q_weight = _param((heads * s.qk_head_dim, hidden), dtype, device)
        else:
            self.q_a_weight = _param((s.q_lora_rank, hidden), dtype, device)
            self.q_a_bias = _param((s.q_lora_rank,), dtype, device) if bias else None
            self.q_a_norm = _param((s.q_lora_rank,), dtype, device)
            self.q_b_weight = _param((heads * s.qk_head_dim, s.q_lora_rank), dtype, device)
        self.kv_a_weight = _param((s.latent_width, hidden), dtype, device)
        self.kv_a_bias = _param((s.latent_width,), dtype, device) if bias else None
        self.kv_a_norm = _param((s.kv_lora_rank,), dtype, device)
        self.kv_b_weight = _param((heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank), dtype, device)
        self.o_weight = _param((hidden, heads * s.v_head_dim), dtype, device)
        self.o_bias = _param((hidden,), dtype, device) if bias else None
        self.scale = rope.yarn_softmax_scale(config, s.qk_head_dim ** -0.5)

    def hf_tensor_map(self, prefix: str) -> dict[str, TensorSlot]:
        """Hugging Face name (under ``prefix`` + "self_attn.") -> destination: this rank's heads of
        q_proj / q_b_proj and kv_b_proj (rows) and of o_proj (columns), everything else whole."""
        p, s, heads, num_heads = prefix + "self_attn.", self.spec, self.shard.q_heads, self.config.num_attention_heads
        names = {"kv_a_proj_with_mqa.weight": self.kv_a_weight, "kv_a_layernorm.weight": self.kv_a_norm}
        if s.q_lora_rank is not None:
            names.update({"q_a_proj.weight": self.q_a_weight, "q_a_layernorm.weight": self.q_a_norm})
        if s.has_attention_bias:
            names.update({"kv_a_proj_with_mqa.bias": self.kv_a_bias, "o_proj.bias": self.o_bias})
            if s.q_lora_rank is not None:
                names["q_a_proj.bias"] = self.q_a_bias
        out = {p + name: TensorSlot(tensor, 0, tensor.shape[0]) for name, tensor in names.items()}
        q_name, q_weight = ("q_proj", self.q_weight) if s.q_lora_rank is None else ("q_b_proj", self.q_b_weight)
        kv_b_dim = s.qk_nope_head_dim + s.v_head_dim
        for name, weight, source in (
                (q_name, q_weight, head_slice(0, heads, num_heads, s.qk_head_dim)),
                ("kv_b_proj", self.kv_b_weight, head_slice(0, heads, num_heads, kv_b_dim)),
                ("o_proj", self.o_weight, head_slice(1, heads, num_heads, s.v_head_dim))):
            out[f"{p}{name}.weight"] = TensorSlot(weight, 0, weight.shape[0], source)
        return out

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, L] and W_UV [H, v, L]: views of kv_b_proj."""
        s = self.spec
        kv_b = self.kv_b_weight.view(self.shard.q_heads.count, s.qk_nope_head_dim + s.v_head_dim, -1)
        return kv_b[:, :s.qk_nope_head_dim], kv_b[:, s.qk_nope_head_dim:]

    def project(self, h: torch.Tensor, rotary: LatentRope, cos_sin, attn) -> tuple[torch.Tensor, ...]:
        """h [T, hidden] -> q_nope [T, H, nope], roped q_pe [T, H, R], cache rows [T, L + R]."""
        s, eps = self.spec, self.config.rms_norm_eps
        num_tokens = h.shape[0]
        if s.q_lora_rank is None:
            q = attn.linear(h, self.q_weight)
        else:
            q_a = rms_norm(attn.linear(h, self.q_a_weight, self.q_a_bias), self.q_a_norm, eps)
            q = attn.linear(q_a, self.q_b_weight)
        q_nope, q_pe = q.view(num_tokens, -1, s.qk_head_dim).split([s.qk_nope_head_dim, s.qk_rope_head_dim], -1)
        latent, k_pe = attn.linear(h, self.kv_a_weight, self.kv_a_bias).split([s.kv_lora_rank, s.qk_rope_head_dim], -1)
        cos, sin = cos_sin
        rows = torch.cat((rms_norm(latent, self.kv_a_norm, eps), rotary.apply(k_pe[:, None], cos, sin)[:, 0]), -1)
        return q_nope, rotary.apply(q_pe, cos, sin), rows

    def forward(self, h: torch.Tensor, rotary: LatentRope, cos_sin, cache: torch.Tensor, plan, attn) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]; writes the T new rows into ``cache`` [num_pages, page_size, L + R]."""
        num_tokens = h.shape[0]
        q_nope, q_pe, rows = self.project(h, rotary, cos_sin, attn)
        attn.mla_store(cache, rows, plan)
        w_uk, w_uv = self.absorbed()
        q = torch.cat((torch.einsum("thd,hdl->thl", q_nope, w_uk), q_pe), dim=-1)  # [T, H, L + R]
        out = attn.mla_attend(q, cache, plan, self.spec.kv_lora_rank, self.scale)  # [T, H, L]
        out = torch.einsum("thl,hvl->thv", out, w_uv).reshape(num_tokens, -1)  # [T, H * v]
        return attn.linear(out, self.o_weight, self.o_bias if self.shard.adds_row_bias else None)
