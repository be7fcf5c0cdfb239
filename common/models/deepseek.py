"""DeepSeek-V2/V3 decoder: multi-head latent attention over the latent cache, and MoE layers.

One class serves both (``DeepseekV2ForCausalLM`` and ``DeepseekV3ForCausalLM`` are it); the
switches are ``ModelConfig.deepseek`` (``deepseek_config.py``). Attention is ``common/layers/mla.py``
(the expanded form for prefill and long chunks, the absorbed form for decode, verify and short
extends; ``mla.attends_expanded`` chooses per step), the cache ``common/cache/mla_cache.py``
(``make_kv_cache``). The MLP of layer i is dense (``intermediate_size``) for the first
``first_k_dense_replace`` layers, else routed experts plus ``n_shared_experts`` shared ones:

    V2: softmax scores; top-k over all experts ("greedy") or within the ``topk_group`` groups with
        the best single expert ("group_limited_greedy"); normalised when ``norm_topk_prob`` (and
        top-k > 1, as DeepSeek's reference code; transformers 5 ignores the flag for V2, and
        every released V2 sets it false), else times ``routed_scaling_factor``.
    V3: sigmoid scores; the choice adds ``e_score_correction_bias`` and keeps the ``topk_group``
        groups with the best two-expert sums ("noaux_tc"); weights are the unbiased scores,
        normalised when ``norm_topk_prob``, then times ``routed_scaling_factor``.

Routed experts are stacked, ``w13`` [E, 2I, H] (gate rows, then up rows) and ``w2`` [E, H, I], and
run through the backend's ``fused_moe`` (``common/layers/moe.py``'s layout: ``moe.fused_moe_ref`` on
torch, ``common/kernels/triton_moe.py`` on triton) with DeepSeek's own routing above; the shared
experts are stacked after them as ``n_shared_experts`` more experts that every token chooses with
weight 1 (``MoeBlock``), so one block is the router and the experts' launches, shared ones included.
The router makes no host sync (no ``.item()``, ``nonzero`` or boolean
indexing: groups are masked with ``masked_fill``), so on the triton backend a decode step runs on
the device only and is captured in a CUDA graph (``common/engine/cuda_graph.py``), as Llama's.
Attention on either backend (``--attention-backend``, ``auto`` picks triton on CUDA).

Tensor parallelism (``TpShard``): attention heads split as ``common/layers/mla.py`` says (the latent
replicated, so every rank's ``LatentCache`` holds all of it), every expert's intermediate dim and
the shared experts' split as Qwen3-MoE's (``rank_experts``: every rank holds every expert), the
dense layers' MLP as Llama's; one all_reduce per attention and per MLP/MoE block. Only rank 0
computes logits.
"""

from __future__ import annotations

import logging
import re

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.common.cache.mla_cache import LatentCache
from kvferry.common.errors import ConfigError, ModelLoadError
from kvferry.common.layers.attn_backend import make_backend
from kvferry.common.layers.moe import append_shared
from kvferry.common.layers.mla import LatentRope, MlaAttention, _param
from kvferry.common.layers.tp_layers import Slice, TensorSlot, TpShard, rank_experts
from kvferry.common.plan.tp import HeadRange
from kvferry.common.models.config import ModelConfig
from kvferry.common.models.deepseek_config import DeepseekSpec
from kvferry.common.models.llama import SeqChunk, TokenFeed, check_chunks, final_norm

logger = logging.getLogger(__name__)
_SHARED = re.compile(r"(model\.layers\.\d+\.mlp\.shared_experts\.)(gate_proj|up_proj|down_proj)\.weight")


def route(logits: torch.Tensor, spec: DeepseekSpec, bias: torch.Tensor | None, backend=None,
          shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] fp32 -> (weights [T, k] fp32, expert ids [T, k]), as the module docstring
    says; ``shared``: then that many always-chosen experts (``moe.append_shared``, [T, k + shared]).
    V2's greedy softmax top-k goes through ``backend.select_experts`` when a backend is given (one
    launch on the Triton backend, the shared experts' columns included; its ids in descending order
    of weight)."""
    num_tokens, num_experts = logits.shape
    is_v3 = spec.version == 3
    if backend is not None and not is_v3 and spec.topk_method == "greedy":
        normalise = spec.norm_topk_prob and spec.num_experts_per_tok > 1
        return backend.select_experts(logits, spec.num_experts_per_tok, normalise,
                                      1.0 if normalise else spec.routed_scaling_factor, 1e-20, torch.float32, shared)
    scores = logits.sigmoid() if is_v3 else logits.softmax(dim=-1, dtype=torch.float32)
    choice = scores + bias if is_v3 else scores
    if spec.topk_method != "greedy":
        grouped = choice.view(num_tokens, spec.n_group, -1)
        group_rank = grouped.topk(2, dim=-1)[0].sum(dim=-1) if is_v3 else grouped.max(dim=-1).values
        chosen = group_rank.topk(spec.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_rank).scatter_(1, chosen, 1).bool()  # [T, n_group]
        keep = keep[:, :, None].expand(-1, -1, num_experts // spec.n_group).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~keep, float("-inf") if is_v3 else 0.0)
    ids = choice.topk(spec.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = (scores if is_v3 else choice).gather(1, ids)
    normalise = spec.norm_topk_prob and (is_v3 or spec.num_experts_per_tok > 1)
    if normalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if is_v3 or not normalise:
        weights = weights * spec.routed_scaling_factor
    return append_shared(weights, ids, num_experts, shared)


def route_hidden(h: torch.Tensor, gate_weight: torch.Tensor, spec: DeepseekSpec, bias: torch.Tensor | None, backend,
                 shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` of the router's logits ``backend.linear(h, gate_weight)``; V2's greedy softmax top-k
    through ``backend.router_topk`` (logits and picks in one launch at one row on the Triton backend)."""
    if spec.version != 3 and spec.topk_method == "greedy":
        normalise = spec.norm_topk_prob and spec.num_experts_per_tok > 1
        return backend.router_topk(h, gate_weight, spec.num_experts_per_tok, normalise,
                                   1.0 if normalise else spec.routed_scaling_factor, 1e-20, torch.float32, shared)
    return route(backend.linear(h, gate_weight), spec, bias, backend, shared)


class DenseMlp(nn.Module):
    """SwiGLU with fused gate/up rows: a dense layer's MLP (``first_k_dense_replace``). Holds the block
    ``part`` of the ``full`` intermediate size (gate/up rows, down columns): ``forward`` returns this
    rank's partial sum."""

    def __init__(self, hidden: int, full: int, part: HeadRange, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.full, self.part = full, part
        self.gate_up_weight = _param((2 * part.count, hidden), dtype, device)
        self.down_weight = _param((hidden, part.count), dtype, device)

    def hf_tensor_map(self, prefix: str) -> dict[str, TensorSlot]:
        n, rows = self.part.count, Slice(0, self.part.start, self.part.count, self.full)
        return {prefix + "gate_proj.weight": TensorSlot(self.gate_up_weight, 0, n, rows),
                prefix + "up_proj.weight": TensorSlot(self.gate_up_weight, n, n, rows),
                prefix + "down_proj.weight": TensorSlot(self.down_weight, 0, self.down_weight.shape[0],
                                                        Slice(1, self.part.start, n, self.full))}

    def forward(self, h: torch.Tensor, attn) -> torch.Tensor:
        return attn.linear(attn.silu_mul(attn.linear(h, self.gate_up_weight)), self.down_weight)


class MoeBlock(nn.Module):
    """Router (fp32, as transformers keeps it; replicated) and the experts: the routed ones
    ``rank_experts`` names, then the ``n_shared_experts`` shared ones, stacked, each with this rank's
    block of its intermediate dim (``shard.moe_inter``). ``forward`` returns this rank's partial sum.

    The shared experts (one SwiGLU of ``n_shared_experts`` x ``moe_intermediate_size`` in the
    checkpoint) are kept as that many experts of ``moe_intermediate_size`` after the routed ones
    (``unfuse`` splits the checkpoint's tensors), which every token chooses with weight 1
    (``moe.append_shared``): a SwiGLU is a sum over its intermediate units, so the split changes
    nothing but the order of the sum, and they run in the routed experts' launches. ``fold_shared``
    False runs them as one dense SwiGLU of their own, as before (``bench/engine.py --shared-ab``)."""

    fold_shared = True

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, shard: TpShard) -> None:
        super().__init__()
        s, hidden, inter = config.deepseek, config.hidden_size, shard.moe_inter.count
        self.spec, self.shard = s, shard
        self.experts = rank_experts(s.n_routed_experts, shard)
        self.num_shared = s.n_shared_experts
        self.gate_weight = _param((s.n_routed_experts, hidden), torch.float32, device)
        self.score_bias = _param((s.n_routed_experts,), torch.float32, device) if s.version == 3 else None
        stacked = self.experts.count + self.num_shared
        self.w13 = _param((stacked, 2 * inter, hidden), dtype, device)  # [E + S, 2I, H]: gate; up
        self.w2 = _param((stacked, hidden, inter), dtype, device)  # [E + S, H, I]
        self._unfolded = None  # the shared experts as one dense SwiGLU (fold_shared False), made on first use

    def hf_tensor_map(self, prefix: str) -> dict[str, TensorSlot]:
        """The routed experts' names, and the shared experts' as ``unfuse`` names their parts:
        ``shared_experts.{j}.gate_proj.weight`` and so on."""
        num_experts, full, part = self.spec.n_routed_experts, self.spec.moe_intermediate_size, self.shard.moe_inter
        rows, cols = Slice(0, part.start, part.count, full), Slice(1, part.start, part.count, full)
        out = {prefix + "gate.weight": TensorSlot(self.gate_weight, 0, num_experts)}
        if self.score_bias is not None:
            out[prefix + "gate.e_score_correction_bias"] = TensorSlot(self.score_bias, 0, num_experts)
        names = [f"{prefix}experts.{e}." for e in range(self.experts.start, self.experts.stop)]
        names += [f"{prefix}shared_experts.{j}." for j in range(self.num_shared)]
        for local, p in enumerate(names):
            out[p + "gate_proj.weight"] = TensorSlot(self.w13[local], 0, part.count, rows)
            out[p + "up_proj.weight"] = TensorSlot(self.w13[local], part.count, part.count, rows)
            out[p + "down_proj.weight"] = TensorSlot(self.w2[local], 0, self.w2.shape[1], cols)
        return out

    def forward(self, h: torch.Tensor, attn, to_add_norm: bool = False) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]: each token's k experts, weighted, plus the shared experts
        (``to_add_norm``: for the next residual add_norm only, which may take the slots unsummed)."""
        fold = self.fold_shared or not self.num_shared
        # fp32 logits (the weight is fp32, as transformers keeps it): at one row on triton, V2's greedy
        # router is one launch with its picks (route_hidden)
        weights, ids = route_hidden(h, self.gate_weight, self.spec, self.score_bias, attn,
                                    self.num_shared if fold else 0)  # [T, k (+ S)] each
        # ids index w13/w2 directly: this rank holds every expert (rank_experts), the shared ones after them
        return attn.fused_moe(h, self.w13, self.w2, weights, ids, None if fold else self._shared_mlp(h, attn),
                              to_add_norm=to_add_norm)

    def _shared_mlp(self, h: torch.Tensor, attn) -> torch.Tensor:
        """The shared experts as one dense SwiGLU: their gate-up rows as they lie, each expert's
        [gate | up] pair through ``silu_mul``, then one down projection over their columns side by
        side (a copy of w2's shared experts, made once)."""
        first = self.experts.count
        if self._unfolded is None:
            self._unfolded = self.w2[first:].permute(1, 0, 2).reshape(self.w2.shape[1], -1).contiguous()
        gate_up = attn.linear(h, self.w13[first:].reshape(-1, self.w13.shape[2]))  # [T, S * 2I]
        act = attn.silu_mul(gate_up.reshape(-1, self.w13.shape[1])).reshape(h.shape[0], -1)  # [T, S * I]
        return attn.linear(act, self._unfolded)


class DeepseekLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device,
                 shard: TpShard) -> None:
        super().__init__()
        self.layer, self.eps = layer, config.rms_norm_eps
        self.reduce = None  # TP > 1: the TP group's all_reduce, summing the ranks' partial outputs
        self.input_norm = _param((config.hidden_size,), dtype, device)
        self.post_norm = _param((config.hidden_size,), dtype, device)
        self.self_attn = MlaAttention(config, layer, dtype, device, shard)
        self.mlp = (MoeBlock(config, dtype, device, shard) if config.deepseek.is_moe_layer(layer)
                    else DenseMlp(config.hidden_size, config.intermediate_size, shard.inter, dtype, device))

    def hf_tensor_map(self) -> dict[str, TensorSlot]:
        p, hidden = f"model.layers.{self.layer}.", self.input_norm.shape[0]
        out = {p + "input_layernorm.weight": TensorSlot(self.input_norm, 0, hidden),
               p + "post_attention_layernorm.weight": TensorSlot(self.post_norm, 0, hidden)}
        out.update(self.self_attn.hf_tensor_map(p))
        out.update(self.mlp.hf_tensor_map(p + "mlp."))
        return out

    def forward(self, x, delta, rotary: LatentRope, cos_sin, kv: LatentCache, plan, attn):
        """As the Llama layer: (x + delta, this layer's output); writes this layer's latent rows."""
        x, h = attn.add_norm(x, delta, self.input_norm, self.eps)
        out = self._sum_ranks(self.self_attn(h, rotary, cos_sin, kv.latent[self.layer], plan, attn))
        x, h = attn.add_norm(x, out, self.post_norm, self.eps)
        if self.reduce is None and isinstance(self.mlp, MoeBlock):  # TP 1: the slots may come unsummed
            return x, self.mlp(h, attn, to_add_norm=True)
        return x, self._sum_ranks(self.mlp(h, attn))

    def _sum_ranks(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``partial`` (one all_reduce at TP > 1; itself at TP 1)."""
        return partial if self.reduce is None else self.reduce(partial)


class DeepseekForCausalLM(nn.Module):
    """Embedding, DeepSeek layers, final norm and lm_head; ``forward`` as ``LlamaForCausalLM``'s."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 shard: TpShard | None = None) -> None:
        """``shard``: this rank's heads and intermediate blocks (None: the whole model, TP 1)."""
        super().__init__()
        if config.deepseek is None:
            raise ValueError(f"{config.source}: {config.architecture} is not a DeepSeek-V2/V3 checkpoint")
        device = torch.device(device)
        self.config, self.dtype, self.device = config, dtype, device
        self.shard = shard = shard or TpShard.single(config)
        self.embed = _param((config.vocab_size, config.hidden_size), dtype, device)
        self.layers = nn.ModuleList(DeepseekLayer(config, i, dtype, device, shard)
                                    for i in range(config.num_hidden_layers))
        self.norm = _param((config.hidden_size,), dtype, device)
        self.lm_head = self.embed if config.has_tied_embeddings else _param(
            (config.vocab_size, config.hidden_size), dtype, device)
        self.rotary = LatentRope(config, dtype, device)
        self.attn = make_backend("auto", device, LatentCache.num_kv_heads)

    @classmethod
    def make_kv_cache(cls, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                      device: torch.device | str, *, model_name: str = "target", layout: str = "page-major",
                      k_scales=None, v_scales=None, head_start: int = 0, num_kv_heads: int = 1) -> LatentCache:
        """The pool MLA reads: one latent buffer per layer (``common/cache/mla_cache.py``), the same
        whole pool on every TP rank: ``head_start``/``num_kv_heads`` are a rank's ``shard.kv_heads``,
        which for MLA is always the one latent "head" (0, 1). An FP8 latent pool is refused
        (``--kv-cache-dtype auto`` only, for now)."""
        if (head_start, num_kv_heads) != (0, 1):
            raise ValueError(f"{config.architecture}: a latent pool holds the one replicated latent head on every "
                             f"TP rank (head_start 0, num_kv_heads 1), got head_start {head_start}, num_kv_heads "
                             f"{num_kv_heads}; pass the rank's shard.kv_heads")
        if dtype == torch.float8_e4m3fn:
            raise ConfigError(f"--kv-cache-dtype fp8_e4m3: {config.architecture} keeps an MLA latent pool, which is "
                              f"stored in the model dtype only so far; use --kv-cache-dtype auto")
        return LatentCache(config, num_pages, page_size, dtype, device, model_name=model_name, layout=layout)

    def attach_tp(self, all_reduce) -> None:
        """Sum the ranks' attention and MLP outputs with ``all_reduce(tensor) -> tensor`` (TP > 1 only)."""
        if not self.shard.is_sharded:
            raise ValueError("attach_tp: this model is not sharded (tp_size 1 runs no collective)")
        for layer in self.layers:
            layer.reduce = all_reduce

    def set_attention_backend(self, name: str) -> None:
        """``auto``, ``torch`` or ``triton`` (CUDA only); the triton backend's decode splits are sized
        for the latent's one head (``LatentCache.num_kv_heads``)."""
        self.attn = make_backend(name, self.device, LatentCache.num_kv_heads)

    def hf_tensor_map(self) -> dict[str, TensorSlot]:
        """Hugging Face tensor name -> destination. Tied checkpoints carry no ``lm_head.weight``."""
        c = self.config
        out = {"model.embed_tokens.weight": TensorSlot(self.embed, 0, c.vocab_size),
               "model.norm.weight": TensorSlot(self.norm, 0, c.hidden_size)}
        if not c.has_tied_embeddings:
            out["lm_head.weight"] = TensorSlot(self.lm_head, 0, c.vocab_size)
        for layer in self.layers:
            out.update(layer.hf_tensor_map())
        return out

    def unfuse(self, name: str, read) -> dict[str, torch.Tensor]:
        """A sparse layer's shared experts (``mlp.shared_experts.{gate,up,down}_proj.weight``: one
        SwiGLU of ``n_shared_experts`` x ``moe_intermediate_size``) as that many experts, the names
        ``MoeBlock.hf_tensor_map`` gives them (views, no copy). Other tensors ``hf_tensor_map`` does
        not name: {} (the loader ignores them, as the Hub's checkpoints' rotary caches)."""
        match = _SHARED.fullmatch(name)
        s = self.config.deepseek
        if match is None or not s.n_shared_experts:
            return {}
        prefix, kind = match.groups()
        tensor = read()
        dim, width = (1 if kind == "down_proj" else 0), s.n_shared_experts * s.moe_intermediate_size
        if tensor.dim() != 2 or tensor.shape[dim] != width or tensor.shape[1 - dim] != self.config.hidden_size:
            expected = (self.config.hidden_size, width) if dim else (width, self.config.hidden_size)
            raise ModelLoadError(f"{self.config.source}: tensor '{name}' has shape {tuple(tensor.shape)}, config.json "
                                 f"implies {expected} (n_shared_experts {s.n_shared_experts} x moe_intermediate_size "
                                 f"{s.moe_intermediate_size})")
        return {f"{prefix}{j}.{kind}.weight": part for j, part in enumerate(tensor.chunk(s.n_shared_experts, dim))}

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], kv: LatentCache, *, all_logits: bool = False,
                feed: TokenFeed | None = None) -> torch.Tensor | list[torch.Tensor]:
        """New tokens of ``chunks`` -> fp32 logits ([num_chunks, vocab], or with ``all_logits`` one
        [len(token_ids), vocab] per chunk); writes their latent rows into ``kv``."""
        self.check(chunks, kv)
        token_ids, plan = self.attn.plan(chunks, kv.page_size, self.device)
        if feed is not None:
            token_ids = feed.apply(token_ids)
        return self.run(token_ids, plan, kv, all_logits=all_logits)

    def run(self, token_ids: torch.Tensor, plan, kv: LatentCache, *, all_logits: bool = False):
        x, delta = F.embedding(token_ids, self.embed), None  # [T, hidden]
        cos_sin = self.rotary.cos_sin(plan.positions, self.attn)
        for layer in self.layers:
            x, delta = layer(x, delta, self.rotary, cos_sin, kv, plan, self.attn)
        if self.shard.tp_rank > 0:
            return None  # the latent rows are written; rank 0 alone computes logits
        h = final_norm(self.attn, x, delta, plan, self.norm, self.config.rms_norm_eps, all_logits)
        logits = self.attn.linear(h, self.lm_head).float()
        return list(logits.split(plan.query_lens)) if all_logits else logits

    def check(self, chunks: list[SeqChunk], kv: LatentCache) -> None:
        """Raise ValueError for chunks this model and cache cannot run."""
        if not isinstance(kv, LatentCache):
            raise ValueError(f"{self.config.architecture} reads a LatentCache, got {type(kv).__name__}; build the "
                             "pool with make_kv_cache")
        check_chunks(self.config, chunks, kv)


DeepseekV2ForCausalLM = DeepseekV3ForCausalLM = DeepseekForCausalLM
