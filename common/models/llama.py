"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

One ``forward`` serves every phase: prefill (``start_pos`` 0), chunked prefill and spec-dec verify
(several new tokens after a cached prefix) and batched decode (one new token per chunk). Linear
layers run over all packed tokens at once; attention reads each chunk's pages (``common/layers/attention.py``).
Weights are plain tensors filled by ``loader.load_model`` (or, for an FP8 checkpoint, ``Fp8Weight``s
of ``common/layers/fp8.py``, which ``attn.linear`` recognises): q/k/v and gate/up are stored fused,
and ``hf_tensor_map`` says where each Hugging Face tensor lands.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.common.layers import rope
from kvferry.common.layers.attn_backend import make_backend
from kvferry.common.layers.fp8 import TokenQuantized, linear_weight
from kvferry.common.models.config import ModelConfig
from kvferry.common.cache.kv_cache import KvCache
from kvferry.common.layers.tp_layers import ScaleSlot, TensorSlot, TpShard, layer_tensor_map

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


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: the loader overwrites every element, and an 8B model should not be filled twice.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device,
                 shard: TpShard | None = None) -> None:
        super().__init__()
        c = config
        self.layer = layer
        self.config = config
        self.shard = shard = shard or TpShard.single(config)
        self.reduce = None  # TP > 1: the all_reduce of the TP group, summing row-parallel outputs
        self.window = c.sliding_windows[layer]
        q, kv = shard.q_size, shard.kv_size  # this rank's part (all at TP 1)
        weight = self._linear_weight
        self.input_norm = _param((c.hidden_size,), dtype, device)
        self.qkv_weight = weight([f"self_attn.{m}_proj" for m in "qkv"], q + 2 * kv, c.hidden_size, dtype, device)
        self.qkv_bias = _param((q + 2 * kv,), dtype, device) if c.has_qkv_bias else None
        self.o_weight = weight(["self_attn.o_proj"], c.hidden_size, q, dtype, device)
        self.o_bias = _param((c.hidden_size,), dtype, device) if c.has_o_bias else None
        self.q_norm = _param((c.head_dim,), dtype, device) if c.has_qk_norm else None
        self.k_norm = _param((c.head_dim,), dtype, device) if c.has_qk_norm else None
        self.post_norm = _param((c.hidden_size,), dtype, device)
        self._init_mlp(dtype, device)

    def _linear_weight(self, modules: list[str], out_features: int, in_features: int, dtype: torch.dtype,
                       device: torch.device):
        """The weight of the (fused) linear of ``modules`` of this layer: FP8 with its scales where the
        checkpoint quantizes them (``common/layers/fp8.py``), else a plain tensor."""
        names = [f"model.layers.{self.layer}.{m}" for m in modules]
        return linear_weight(names, self.config.quantization, out_features, in_features, dtype, device)

    def _init_mlp(self, dtype: torch.dtype, device: torch.device) -> None:
        """The dense SwiGLU MLP's weights (a subclass with another MLP overrides this, ``_mlp`` and
        ``hf_tensor_map``)."""
        c, inter = self.config, self.shard.inter.count
        self.gate_up_weight = self._linear_weight(["mlp.gate_proj", "mlp.up_proj"], 2 * inter, c.hidden_size,
                                                  dtype, device)
        self.gate_up_bias = _param((2 * inter,), dtype, device) if c.has_mlp_bias else None
        self.down_weight = self._linear_weight(["mlp.down_proj"], c.hidden_size, inter, dtype, device)
        self.down_bias = _param((c.hidden_size,), dtype, device) if c.has_mlp_bias else None

    def hf_tensor_map(self) -> dict[str, TensorSlot | ScaleSlot]:
        return layer_tensor_map(self, self.config, self.shard)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cos_sin, kv: KvCache, plan, attn):
        """Residual stream x [T, hidden] and the previous layer's output ``delta`` (None before layer
        0) -> (x + delta, this layer's output); writes this layer's K/V of the T new tokens."""
        eps = self.config.rms_norm_eps
        x, h = attn.add_norm(x, delta, self.input_norm, eps, feeds=self.qkv_weight)
        x, h = attn.add_norm(x, self._attention(h, cos_sin, kv, plan, attn), self.post_norm, eps,
                             feeds=self._mlp_input_weight())
        return x, self._mlp(h, attn)

    def _mlp_input_weight(self):
        """The weight of the one linear that reads the MLP's input (an FP8 one may take it quantized,
        ``attn_backend``); None for an MLP whose input goes elsewhere too (a router)."""
        return self.gate_up_weight

    def _mlp(self, h: torch.Tensor, attn) -> torch.Tensor:
        act = attn.mlp_act(h, self.gate_up_weight, self.gate_up_bias, self.down_weight)
        return self._row_parallel(act, self.down_weight, self.down_bias, attn)

    def _row_parallel(self, x: torch.Tensor, weight, bias, attn) -> torch.Tensor:
        """x @ weight.T + bias, for the next residual add_norm only; at TP > 1 the ranks' partial sums
        are added by one all_reduce (the bias by rank 0 only). At TP 1 no collective runs, and a split-K
        FP8 GEMV's parts may come unsummed (``attn.linear``'s ``to_add_norm``)."""
        if self.reduce is None:
            return attn.linear(x, weight, bias, to_add_norm=True)
        return self.reduce(attn.linear(x, weight, bias if self.shard.adds_row_bias else None))

    def _sum_ranks(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``partial`` (one all_reduce at TP > 1; itself at TP 1)."""
        return partial if self.reduce is None else self.reduce(partial)

    def _attention(self, h: torch.Tensor, cos_sin, kv: KvCache, plan, attn) -> torch.Tensor:
        c, shard = self.config, self.shard
        num_tokens = h.shape[0]
        qk_norm = (self.q_norm, self.k_norm, c.rms_norm_eps) if self.q_norm is not None else None  # Qwen3
        k_cache, v_cache = kv.k[self.layer], kv.v[self.layer]  # [num_pages, page_size, Hkv, D]
        k_scale, v_scale = kv.k_scales[self.layer], kv.v_scales[self.layer]  # FP8 pool's; else 1.0
        # the projection, then (q, k normalised first when qk_norm) q, k rotated; k, v stored
        q, k, v = attn.qkv_rope_store(h, self.qkv_weight, self.qkv_bias, (shard.q_heads.count, shard.kv_heads.count,
                                      c.head_dim), cos_sin, k_cache, v_cache, plan, k_scale, v_scale, qk_norm)
        out = attn.attend(q, k, v, k_cache, v_cache, plan, self.window, c.head_dim**-0.5, k_scale, v_scale,
                          feeds=self.o_weight)  # rows [T, q_size] quantized per token where o_proj takes them so
        rows = out if isinstance(out, TokenQuantized) else out.reshape(num_tokens, shard.q_size)
        return self._row_parallel(rows, self.o_weight, self.o_bias, attn)


class LlamaForCausalLM(nn.Module):
    """Decoder with embedding, layers, final norm and lm_head (tied to the embedding when configured).

    With a ``shard`` of TP > 1 the layers hold this rank's heads and intermediate block
    (``common/layers/tp_layers.py``); embedding, norms and lm_head are replicated. ``attach_tp`` gives the layers
    the TP group's all_reduce. Ranks other than 0 stop after the last layer (``run`` returns None):
    only rank 0 computes logits and samples."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 shard: TpShard | None = None) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.device = device
        self.shard = shard = shard or TpShard.single(config)
        self.embed = _param((config.vocab_size, config.hidden_size), dtype, device)
        self.layers = nn.ModuleList(self._make_layer(i, dtype, device)
                                    for i in range(config.num_hidden_layers))
        self.norm = _param((config.hidden_size,), dtype, device)
        self.lm_head = self.embed if config.has_tied_embeddings else _param(
            (config.vocab_size, config.hidden_size), dtype, device
        )
        self.inv_freq = rope.inv_frequencies(config).to(device)
        self.attn = make_backend("auto", device, shard.kv_heads.count)

    def _make_layer(self, layer: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """Decoder layer ``layer`` (an architecture with other layers overrides this)."""
        return DecoderLayer(self.config, layer, dtype, device, self.shard)

    def set_attention_backend(self, name: str) -> None:
        """``auto``, ``torch`` or ``triton`` (CUDA only); see ``common/layers/attn_backend.py``."""
        self.attn = make_backend(name, self.device, self.shard.kv_heads.count)

    def attach_tp(self, all_reduce) -> None:
        """Sum row-parallel outputs with ``all_reduce(tensor) -> tensor`` (TP > 1 only)."""
        if not self.shard.is_sharded:
            raise ValueError("attach_tp: this model is not sharded (tp_size 1 runs no collective)")
        for layer in self.layers:
            layer.reduce = all_reduce

    def hf_tensor_map(self) -> dict[str, TensorSlot | ScaleSlot]:
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

    def unfuse(self, name: str, read) -> dict[str, torch.Tensor]:
        """A checkpoint tensor that ``hf_tensor_map`` does not name, split into tensors it names
        (``read()`` loads it); {} when ``name`` is no fused tensor this model knows (none here)."""
        return {}

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
        cos_sin = self.attn.cos_sin(plan.positions, self.inv_freq, self.dtype)
        for layer in self.layers:
            x, delta = layer(x, delta, cos_sin, kv, plan, self.attn)
        if self.shard.tp_rank > 0:
            return None  # the KV is written; rank 0 alone computes logits
        h = final_norm(self.attn, x, delta, plan, self.norm, self.config.rms_norm_eps, all_logits)
        # Logits in the model dtype then fp32, as transformers does, so greedy picks agree with it.
        logits = self.attn.linear(h, self.lm_head).float()
        return list(logits.split(plan.query_lens)) if all_logits else logits

    def check(self, chunks: list[SeqChunk], kv: KvCache) -> None:
        """Raise ValueError for chunks this model and cache cannot run."""
        check_chunks(self.config, chunks, kv)

    @classmethod
    def make_kv_cache(cls, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                      device: torch.device | str, **pool_options) -> KvCache:
        """The KV pool this architecture reads: K and V per layer (``common/cache/kv_cache.py``;
        ``pool_options`` are its model_name, layout, head_start, num_kv_heads, k_scales, v_scales)."""
        return KvCache(config, num_pages, page_size, dtype, device, **pool_options)


def final_norm(attn, x: torch.Tensor, delta: torch.Tensor, plan, weight: torch.Tensor, eps: float,
               all_logits: bool) -> torch.Tensor:
    """The last residual add and the final RMSNorm (``attn.add_norm``: one launch on the Triton
    backend) of the rows whose logits are wanted: every token's with ``all_logits``, else each
    chunk's last (all of them when every chunk has one token, as in a decode step: no row gather)."""
    if not all_logits and x.shape[0] != plan.last_index.shape[0]:
        x, delta = x.index_select(0, plan.last_index), delta.index_select(0, plan.last_index)
    return attn.add_norm(x, delta, weight, eps)[1]


def check_chunks(config: ModelConfig, chunks: list[SeqChunk], kv) -> None:
    """Raise ValueError for chunks a model of ``config`` cannot run over ``kv`` (any pool with
    ``config``, ``page_size`` and ``num_pages``)."""
    if not chunks:
        raise ValueError("forward needs at least one chunk")
    if kv.config.num_hidden_layers != config.num_hidden_layers:
        raise ValueError(
            f"KV cache has {kv.config.num_hidden_layers} layers, model has {config.num_hidden_layers}"
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
        if num_tokens > config.max_position_embeddings:
            raise ValueError(f"chunk {i}: {num_tokens} tokens exceed max_position_embeddings="
                             f"{config.max_position_embeddings}")
