"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B) over a paged KV cache.

Qwen3's decoder (GQA attention with q/k RMSNorm, from ``llama.py``) whose MLP is a sparse MoE block
(``common/layers/moe.py``: router softmax, top-k experts, SwiGLU experts stacked as w13/w2) on the
layers ``MoeConfig.sparse_layers`` marks, and a dense MLP of ``intermediate_size`` on the others
(``mlp_only_layers``, ``decoder_sparse_step``). The KV geometry is Qwen3's, so the cache, the plan
and the PD transfer are unchanged. Under TP each expert's intermediate dimension is split like the
dense MLP's and the block's output is summed by one all_reduce.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kvferry.common.errors import ModelLoadError
from kvferry.common.layers.moe import SparseMoe
from kvferry.common.layers.tp_layers import TensorSlot, attention_tensor_map
from kvferry.common.models.llama import DecoderLayer, LlamaForCausalLM


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose MLP is ``SparseMoe``: attention, norms and residuals as ``DecoderLayer``."""

    def _init_mlp(self, dtype: torch.dtype, device: torch.device) -> None:
        self.moe = SparseMoe(self.config, self.layer, dtype, device, self.shard)

    def _mlp_input_weight(self):
        return None  # the router reads it too

    def _mlp(self, h: torch.Tensor, attn) -> torch.Tensor:
        if self.reduce is None:  # TP 1: the slots may come unsummed, for the next add_norm (as _row_parallel)
            return self.moe(h, attn, to_add_norm=True)
        return self.reduce(self.moe(h, attn))

    def hf_tensor_map(self) -> dict[str, TensorSlot]:
        return {**attention_tensor_map(self, self.config, self.shard), **self.moe.hf_tensor_map()}


# transformers 5's in-memory layout, which save_pretrained(save_original_format=False) writes
_FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)")


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` (embedding, paged forward, TP, logits on rank 0) with MoE layers."""

    def unfuse(self, name: str, read) -> dict[str, torch.Tensor]:
        """``...mlp.experts.gate_up_proj`` [E, 2I, H] and ``...mlp.experts.down_proj`` [E, H, I] as
        the Hub's per-expert ``gate_proj``/``up_proj``/``down_proj`` (views, no copy)."""
        match = _FUSED_EXPERTS.fullmatch(name)
        if match is None:
            return {}
        prefix, kind = match.groups()
        tensor = read()
        if tensor.dim() != 3 or (kind == "gate_up_proj" and tensor.shape[1] % 2):
            inner = ("2 * moe_intermediate_size, hidden_size" if kind == "gate_up_proj"
                     else "hidden_size, moe_intermediate_size")
            expected = f"[num_experts, {inner}]"
            raise ModelLoadError(f"{self.config.source}: tensor '{name}' has shape {tuple(tensor.shape)}, "
                                 f"expected {expected}")
        if kind == "down_proj":
            return {f"{prefix}{e}.down_proj.weight": tensor[e] for e in range(tensor.shape[0])}
        gate, up = tensor.chunk(2, dim=1)
        return {**{f"{prefix}{e}.gate_proj.weight": gate[e] for e in range(tensor.shape[0])},
                **{f"{prefix}{e}.up_proj.weight": up[e] for e in range(tensor.shape[0])}}

    def _make_layer(self, layer: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        if self.config.moe is None:
            raise ValueError(f"{self.config.source}: {self.config.architecture} needs the MoE fields of config.json")
        is_sparse = self.config.moe.sparse_layers[layer]
        return (MoeDecoderLayer if is_sparse else DecoderLayer)(self.config, layer, dtype, device, self.shard)
