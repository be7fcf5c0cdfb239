"""Sparse MoE block (Qwen3-MoE): router, top-k expert selection, and the experts' SwiGLU MLPs.

One block, over the T packed tokens of a forward::

    router_logits = h @ gate_weight.T                                  # [T, E]
    topk_weights, topk_ids = backend.select_experts(router_logits, k, renorm)  # [T, k] each (select_experts)
    out = backend.fused_moe(h, w13, w2, topk_weights, topk_ids)        # [T, H]

Expert weights are stacked: ``w13`` [E, 2 * I, H] holds each expert's gate_proj rows then its
up_proj rows, ``w2`` [E, H, I] its down_proj. Under tensor parallelism every rank holds every
expert (``tp_layers.rank_experts``) with its block of the intermediate size I (``shard.moe_inter``),
so ``out`` is a partial sum that the decoder layer adds over the ranks with one all_reduce, as it
does for the dense MLP's down projection. The router is replicated.

``fused_moe_ref`` is the torch path (CPU, and the reference of ``common/kernels/triton_moe.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.common.models.config import ModelConfig
from kvferry.common.layers.tp_layers import Slice, TensorSlot, TpShard, rank_experts


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, scale: float = 1.0,
                   eps: float = 0.0, out_dtype: torch.dtype | None = None,
                   shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] in ``out_dtype`` (default the logits'), topk_ids
    [T, k] int64): softmax in fp32, the k most probable experts, their probabilities divided by
    (their sum + ``eps``) when ``renormalize``, times ``scale`` (as transformers'
    ``Qwen3MoeTopKRouter`` with the defaults; DeepSeek-V2's greedy router with its own). ``shared``:
    then that many always-chosen experts, ``append_shared``'s. The reference of ``triton_moe.softmax_topk``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    if scale != 1.0:
        weights = weights * scale
    return append_shared(weights.to(out_dtype or router_logits.dtype), ids, router_logits.shape[1], shared)


def append_shared(weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                  shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k] routed weights and ids -> [T, k + shared]: DeepSeek's shared experts as experts
    ``num_experts .. num_experts + shared - 1`` of the stacked weights, chosen by every token with
    weight 1 (``deepseek.MoeBlock`` keeps them there: they run in the same launches as the routed)."""
    if not shared:
        return weights, ids
    tail = torch.arange(num_experts, num_experts + shared, device=ids.device).expand(ids.shape[0], shared)
    return torch.cat((weights, weights.new_ones(ids.shape[0], shared)), 1), torch.cat((ids, tail), 1)


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (order [T * k], counts [E]): the token slots (``t * k + j``) grouped by
    expert in ascending expert order, stable within an expert, and the number of slots per expert.
    ``order[sum(counts[:e]):sum(counts[:e + 1])]`` are expert e's slots."""
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights and topk_ids [T, k] -> [T, H] in x's dtype:
    ``sum_j topk_weights[t, j] * down(silu(gate(x[t])) * up(x[t]))`` of expert ``topk_ids[t, j]``.

    Token slots are sorted by expert, then one gate-up and one down matmul per expert that has a
    slot (at most E of them); each expert's matmuls round to x's dtype as an ``nn.Linear`` does, and
    the weighted sum accumulates in fp32, experts in ascending order. ``extra`` [T, H] (DeepSeek's
    shared experts) is added to the rounded sum, as torch adds two tensors of x's dtype."""
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    order, counts = sort_by_expert(topk_ids, num_experts)
    flat_weights = topk_weights.flatten()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        slots = order[start:start + count]
        start += count
        tokens = slots // top_k
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, y.float() * flat_weights[slots, None].float())
    return out.to(x.dtype) if extra is None else out.to(x.dtype) + extra


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: the loader overwrites every element.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class SparseMoe(nn.Module):
    """The sparse MLP of decoder layer ``layer``: router weights [E, H] (replicated) and the experts
    rank ``shard`` holds, stacked (``w13``, ``w2``). ``forward`` returns this rank's partial sum."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device,
                 shard: TpShard) -> None:
        super().__init__()
        if config.moe is None or shard.moe_inter is None:
            raise ValueError(f"{config.source}: layer {layer} is sparse but the config has no MoE fields")
        self.config, self.layer, self.shard = config, layer, shard
        moe, hidden, inter = config.moe, config.hidden_size, shard.moe_inter.count
        self.experts = rank_experts(moe.num_experts, shard)
        self.gate_weight = _param((moe.num_experts, hidden), dtype, device)
        self.w13 = _param((self.experts.count, 2 * inter, hidden), dtype, device)  # [E, 2I, H]: gate; up
        self.w2 = _param((self.experts.count, hidden, inter), dtype, device)  # [E, H, I]

    def forward(self, h: torch.Tensor, backend, to_add_norm: bool = False) -> torch.Tensor:
        """h [T, H] (post-attention norm) -> [T, H], this rank's part of the block's output
        (``to_add_norm``: for the next residual add_norm only, which may take it unsummed)."""
        moe = self.config.moe
        topk_weights, topk_ids = backend.router_topk(h, self.gate_weight, moe.num_experts_per_tok, moe.norm_topk_prob)
        # topk_ids index w13/w2 directly: this rank holds every expert (rank_experts)
        return backend.fused_moe(h, self.w13, self.w2, topk_weights, topk_ids, to_add_norm=to_add_norm)

    def hf_tensor_map(self) -> dict[str, TensorSlot]:
        """The Hub's and transformers 5 ``save_pretrained``'s names: one gate/up/down per expert."""
        c, p = self.config, f"model.layers.{self.layer}.mlp."
        full, part = c.moe.moe_intermediate_size, self.shard.moe_inter
        rows, cols = Slice(0, part.start, part.count, full), Slice(1, part.start, part.count, full)
        out = {p + "gate.weight": TensorSlot(self.gate_weight, 0, c.moe.num_experts)}
        for local, expert in enumerate(range(self.experts.start, self.experts.stop)):
            e = f"{p}experts.{expert}."
            out[e + "gate_proj.weight"] = TensorSlot(self.w13[local], 0, part.count, rows)
            out[e + "up_proj.weight"] = TensorSlot(self.w13[local], part.count, part.count, rows)
            out[e + "down_proj.weight"] = TensorSlot(self.w2[local], 0, c.hidden_size, cols)
        return out
