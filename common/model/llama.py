"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

One ``forward`` serves every phase: prefill (``start_pos`` 0), chunked prefill and spec-dec verify
(several new tokens after a cached prefix) and batched decode (one new token per chunk). Linear
layers run over all packed tokens at once; attention reads each chunk's pages (``attention.py``).
Weights are plain tensors filled by ``loader.load_model``: q/k/v and gate/up are stored fused, and
``hf_tensor_map`` says where each Hugging Face tensor lands.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.model import rope
from common.model.attn_backend import make_backend
from common.model.config import ModelConfig
from common.model.kv_cache import KvCache
from common.model.norm import rms_norm

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence. ``page_ids`` must cover ``start_pos + len(token_ids)`` tokens."""

    token_ids: list[int]
    start_pos: int  # tokens of this sequence already in the KV cache
    page_ids: list[int]


@dataclass(frozen=True)
class TokenFeed:
    """Input tokens still on the device (the previous step's samples, not yet on the host): rows
    ``rows`` of a one-token-per-sequence batch take ``values`` instead of their chunk's placeholder."""

    rows: torch.Tensor    # [n] int64, on the device
    values: torch.Tensor  # [n] int64, on the device

    def apply(self, token_ids: torch.Tensor) -> torch.Tensor:
        return token_ids.index_copy(0, self.rows, self.values)


@dataclass(frozen=True)
class TensorSlot:
    """Where a Hugging Face tensor lands: rows [row_start, row_start + num_rows) of ``target``."""

    target: torch.Tensor
    row_start: int
    num_rows: int


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: the loader overwrites every element, and an 8B model should not be filled twice.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c = config
        self.layer = layer
        self.config = config
        self.window = c.sliding_windows[layer]
        self.input_norm = _param((c.hidden_size,), dtype, device)
        self.qkv_weight = _param((c.q_size + 2 * c.kv_size, c.hidden_size), dtype, device)
        self.qkv_bias = _param((c.q_size + 2 * c.kv_size,), dtype, device) if c.has_qkv_bias else None
        self.o_weight = _param((c.hidden_size, c.q_size), dtype, device)
        self.o_bias = _param((c.hidden_size,), dtype, device) if c.has_o_bias else None
        self.q_norm = _param((c.head_dim,), dtype, device) if c.has_qk_norm else None
        self.k_norm = _param((c.head_dim,), dtype, device) if c.has_qk_norm else None
        self.post_norm = _param((c.hidden_size,), dtype, device)
        self.gate_up_weight = _param((2 * c.intermediate_size, c.hidden_size), dtype, device)
        self.gate_up_bias = _param((2 * c.intermediate_size,), dtype, device) if c.has_mlp_bias else None
        self.down_weight = _param((c.hidden_size, c.intermediate_size), dtype, device)
        self.down_bias = _param((c.hidden_size,), dtype, device) if c.has_mlp_bias else None

    def hf_tensor_map(self) -> dict[str, TensorSlot]:
        c, p = self.config, f"model.layers.{self.layer}."
        q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
        out = {
            p + "input_layernorm.weight": TensorSlot(self.input_norm, 0, c.hidden_size),
            p + "self_attn.q_proj.weight": TensorSlot(self.qkv_weight, 0, q),
            p + "self_attn.k_proj.weight": TensorSlot(self.qkv_weight, q, kv),
            p + "self_attn.v_proj.weight": TensorSlot(self.qkv_weight, q + kv, kv),
            p + "self_attn.o_proj.weight": TensorSlot(self.o_weight, 0, c.hidden_size),
            p + "post_attention_layernorm.weight": TensorSlot(self.post_norm, 0, c.hidden_size),
            p + "mlp.gate_proj.weight": TensorSlot(self.gate_up_weight, 0, inter),
            p + "mlp.up_proj.weight": TensorSlot(self.gate_up_weight, inter, inter),
            p + "mlp.down_proj.weight": TensorSlot(self.down_weight, 0, c.hidden_size),
        }
        if self.qkv_bias is not None:
            out[p + "self_attn.q_proj.bias"] = TensorSlot(self.qkv_bias, 0, q)
            out[p + "self_attn.k_proj.bias"] = TensorSlot(self.qkv_bias, q, kv)
            out[p + "self_attn.v_proj.bias"] = TensorSlot(self.qkv_bias, q + kv, kv)
        if self.o_bias is not None:
            out[p + "self_attn.o_proj.bias"] = TensorSlot(self.o_bias, 0, c.hidden_size)
        if self.q_norm is not None:
            out[p + "self_attn.q_norm.weight"] = TensorSlot(self.q_norm, 0, c.head_dim)
            out[p + "self_attn.k_norm.weight"] = TensorSlot(self.k_norm, 0, c.head_dim)
        if self.gate_up_bias is not None:
            out[p + "mlp.gate_proj.bias"] = TensorSlot(self.gate_up_bias, 0, inter)
            out[p + "mlp.up_proj.bias"] = TensorSlot(self.gate_up_bias, inter, inter)
            out[p + "mlp.down_proj.bias"] = TensorSlot(self.down_bias, 0, c.hidden_size)
        return out

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cos_sin, kv: KvCache, plan, attn):
        """Residual stream x [T, hidden] and the previous layer's output ``delta`` (None before layer
        0) -> (x + delta, this layer's output); writes this layer's K/V of the T new tokens."""
        eps = self.config.rms_norm_eps
        x, h = attn.add_norm(x, delta, self.input_norm, eps)
        x, h = attn.add_norm(x, self._attention(h, cos_sin, kv, plan, attn), self.post_norm, eps)
        gate_up = attn.linear(h, self.gate_up_weight, self.gate_up_bias)
        return x, attn.linear(attn.silu_mul(gate_up), self.down_weight, self.down_bias)

    def _attention(self, h: torch.Tensor, cos_sin, kv: KvCache, plan, attn) -> torch.Tensor:
        c = self.config
        num_tokens = h.shape[0]
        qkv = attn.linear(h, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(num_tokens, c.num_attention_heads, c.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, c.num_key_value_heads, c.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, c.num_key_value_heads, c.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, c.rms_norm_eps)
            k = rms_norm(k, self.k_norm, c.rms_norm_eps)
        k_cache, v_cache = kv.k[self.layer], kv.v[self.layer]  # [num_pages, page_size, Hkv, D]
        q = attn.rope_store(q, k, v, cos_sin, k_cache, v_cache, plan)  # rotates q and k, stores k and v
        out = attn.attend(q, k, v, k_cache, v_cache, plan, self.window, c.head_dim**-0.5)
        return attn.linear(out.reshape(num_tokens, c.q_size), self.o_weight, self.o_bias)


class LlamaForCausalLM(nn.Module):
    """Decoder with embedding, layers, final norm and lm_head (tied to the embedding when configured)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.device = device
        self.embed = _param((config.vocab_size, config.hidden_size), dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device) for i in range(config.num_hidden_layers))
        self.norm = _param((config.hidden_size,), dtype, device)
        self.lm_head = self.embed if config.has_tied_embeddings else _param(
            (config.vocab_size, config.hidden_size), dtype, device
        )
        self.inv_freq = rope.inv_frequencies(config).to(device)
        self.attn = make_backend("auto", device, config.num_key_value_heads)

    def set_attention_backend(self, name: str) -> None:
        """``auto``, ``torch`` or ``triton`` (CUDA only); see ``attn_backend.py``."""
        self.attn = make_backend(name, self.device, self.config.num_key_value_heads)

    def hf_tensor_map(self) -> dict[str, TensorSlot]:
        """Hugging Face tensor name -> destination. Tied checkpoints carry no ``lm_head.weight``."""
        c = self.config
        out = {
            "model.embed_tokens.weight": TensorSlot(self.embed, 0, c.vocab_size),
            "model.norm.weight": TensorSlot(self.norm, 0, c.hidden_size),
        }
        if not c.has_tied_embeddings:
            out["lm_head.weight"] = TensorSlot(self.lm_head, 0, c.vocab_size)
        for layer in self.layers:
            out.update(layer.hf_tensor_map())
        return out

    @torch.inference_mode()
    def forward(
        self, chunks: list[SeqChunk], kv: KvCache, *, all_logits: bool = False, feed: TokenFeed | None = None
    ) -> torch.Tensor | list[torch.Tensor]:
        """Run the new tokens of ``chunks``, writing their K/V into ``kv``; ``feed`` replaces some
        input tokens with device values (one token per chunk only).

        Returns fp32 logits: [num_chunks, vocab] of each chunk's last token, or with ``all_logits``
        a list of [len(token_ids), vocab], one per chunk.
        """
        self.check(chunks, kv)
        token_ids, plan = self.attn.plan(chunks, kv.page_size, self.device)
        if feed is not None:
            token_ids = feed.apply(token_ids)
        return self.run(token_ids, plan, kv, all_logits=all_logits)

    def run(self, token_ids: torch.Tensor, plan, kv: KvCache, *, all_logits: bool = False):
        """The device part of ``forward`` (what a CUDA graph captures): token_ids [T] on the device,
        ``plan`` from ``self.attn.plan``."""
        x, delta = F.embedding(token_ids, self.embed), None  # [T, hidden]
        cos_sin = rope.cos_sin(plan.positions, self.inv_freq, self.dtype)
        for layer in self.layers:
            x, delta = layer(x, delta, cos_sin, kv, plan, self.attn)
        x = x + delta
        if not all_logits:
            x = x.index_select(0, plan.last_index)
        # Logits in the model dtype then fp32, as transformers does, so greedy picks agree with it.
        logits = self.attn.linear(rms_norm(x, self.norm, self.config.rms_norm_eps), self.lm_head).float()
        return list(logits.split(plan.query_lens)) if all_logits else logits

    def check(self, chunks: list[SeqChunk], kv: KvCache) -> None:
        """Raise ValueError for chunks this model and cache cannot run."""
        if not chunks:
            raise ValueError("forward needs at least one chunk")
        if kv.config.num_hidden_layers != self.config.num_hidden_layers:
            raise ValueError(
                f"KV cache has {kv.config.num_hidden_layers} layers, model has {self.config.num_hidden_layers}"
            )
        for i, c in enumerate(chunks):
            num_tokens = c.start_pos + len(c.token_ids)
            if not c.token_ids or c.start_pos < 0:
                raise ValueError(f"chunk {i}: needs >= 1 new token and start_pos >= 0, got {len(c.token_ids)}, "
                                 f"{c.start_pos}")
            if len(c.page_ids) * kv.page_size < num_tokens:
                raise ValueError(f"chunk {i}: {len(c.page_ids)} pages of {kv.page_size} tokens cannot hold "
                                 f"{num_tokens} tokens")
            needed = c.page_ids[: -(-num_tokens // kv.page_size)]
            if min(needed) < 0 or max(needed) >= kv.num_pages:
                raise ValueError(f"chunk {i}: page ids {min(needed)}..{max(needed)} outside the pool of "
                                 f"{kv.num_pages} pages")
            if num_tokens > self.config.max_position_embeddings:
                raise ValueError(f"chunk {i}: {num_tokens} tokens exceed max_position_embeddings="
                                 f"{self.config.max_position_embeddings}")
