"""Tensor-parallel sharding of the Llama weights: which rows and columns of each Hugging Face tensor
one rank holds, and where they land in the fused weights.

Megatron-style, over ``tp_size`` ranks::

    qkv_proj, gate_up_proj   column-parallel: rank r holds the rows of its attention heads, its KV
                             heads and its block of the intermediate size (sliced at load time)
    o_proj, down_proj        row-parallel: rank r holds the matching columns; each rank's partial
                             product is summed by one all_reduce over the TP group (the bias is
                             added by rank 0 only, so it is counted once)
    embed_tokens, lm_head,   replicated: every rank holds them whole (the simplest choice; the
    norms                    vocabulary is not split, and only rank 0 computes logits)

Attention heads are split in equal blocks; KV heads follow ``kvferry.common.plan.tp.rank_heads`` (blocks,
or one head replicated on ``tp_size / num_kv_heads`` consecutive ranks), so rank r's query heads
always read KV heads it holds. ``TpShard.single(config)`` is the whole model (TP 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvferry.common.errors import ConfigError, GeometryMismatchError
from kvferry.common.models.config import ModelConfig
from kvferry.common.plan.tp import HeadRange, rank_heads


def valid_tp_sizes(c: ModelConfig) -> list[int]:
    """The TP sizes a model can be sharded over: they divide the attention heads and the intermediate
    size, and divide or are divided by the KV heads (``kvferry.common.plan.tp.check_tp``)."""
    return [t for t in range(1, c.num_attention_heads + 1)
            if not c.num_attention_heads % t and not c.intermediate_size % t
            and not (c.num_key_value_heads % t and t % c.num_key_value_heads)]


def tp_refusal(c: ModelConfig, tp_size: int) -> str:
    """Why ``tp_size`` does not fit: the first rule it breaks, with the model's numbers."""
    if c.num_attention_heads % tp_size:
        return f"{c.num_attention_heads} attention heads do not divide by {tp_size}"
    if c.intermediate_size % tp_size:
        return f"intermediate size {c.intermediate_size} does not divide by {tp_size}"
    return f"{c.num_key_value_heads} KV heads and {tp_size} ranks: neither divides the other"


class TpConfigError(ConfigError, ValueError):
    """A tensor-parallel setting this model or engine cannot run (names the option and the fix)."""


@dataclass(frozen=True, slots=True)
class TpShard:
    """The part of every sharded weight that rank ``tp_rank`` of ``tp_size`` holds."""

    tp_size: int
    tp_rank: int
    head_dim: int
    q_heads: HeadRange  # attention heads
    kv_heads: HeadRange  # KV heads (the heads of this rank's KV pool)
    inter: HeadRange  # rows [start, stop) of gate_proj and up_proj, columns of down_proj

    @classmethod
    def single(cls, config: ModelConfig) -> "TpShard":
        return cls.of(config, 1, 0)

    @classmethod
    def of(cls, config: ModelConfig, tp_size: int, tp_rank: int) -> "TpShard":
        """Raises TpConfigError when the heads or the intermediate size do not divide by ``tp_size``."""
        c = config
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise TpConfigError(f"--tp-size {tp_size} with rank {tp_rank}: need tp_size >= 1 and 0 <= rank < tp_size")
        if c.deepseek is not None and tp_size > 1:
            raise TpConfigError(f"--tp-size {tp_size}: {c.architecture} ({c.source}) runs at --tp-size 1 only "
                                "(MLA and MoE sharding are not implemented); use --tp-size 1")
        if tp_size not in valid_tp_sizes(c):
            raise TpConfigError(f"--tp-size {tp_size}: {tp_refusal(c, tp_size)}; valid sizes for {c.source}: "
                                f"{', '.join(map(str, valid_tp_sizes(c)))}")
        try:
            kv_heads = rank_heads(c.num_key_value_heads, tp_size, tp_rank, side=f"--tp-size {tp_size}")
        except GeometryMismatchError as exc:
            raise TpConfigError(str(exc)) from exc
        num_q, inter = c.num_attention_heads // tp_size, c.intermediate_size // tp_size
        return cls(tp_size, tp_rank, c.head_dim, HeadRange(tp_rank * num_q, num_q), kv_heads,
                   HeadRange(tp_rank * inter, inter))

    @property
    def is_sharded(self) -> bool:
        return self.tp_size > 1

    @property
    def q_size(self) -> int:
        return self.q_heads.count * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads.count * self.head_dim

    @property
    def adds_row_bias(self) -> bool:
        """Whether this rank adds the bias of a row-parallel layer (rank 0 only: summed once)."""
        return self.tp_rank == 0


@dataclass(frozen=True, slots=True)
class Slice:
    """Elements ``[start, start + length)`` along ``dim`` of a Hugging Face tensor of ``full`` elements
    along that dim: the part one rank loads."""

    dim: int
    start: int
    length: int
    full: int


@dataclass(frozen=True)
class TensorSlot:
    """Where a Hugging Face tensor lands: rows [row_start, row_start + num_rows) of ``target``, taking
    ``source`` of the checkpoint tensor (None: all of it)."""

    target: torch.Tensor
    row_start: int
    num_rows: int
    source: Slice | None = None

    def checkpoint_shape(self) -> tuple[int, ...]:
        """The shape the checkpoint tensor must have (before slicing)."""
        shape = [self.num_rows, *self.target.shape[1:]]
        if self.source is not None:
            shape[self.source.dim] = self.source.full
        return tuple(shape)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor."""
        if self.source is None:
            return tensor
        return tensor.narrow(self.source.dim, self.source.start, self.source.length)


def _heads(dim: int, heads: HeadRange, num_heads: int, head_dim: int) -> Slice:
    return Slice(dim, heads.start * head_dim, heads.count * head_dim, num_heads * head_dim)


def layer_tensor_map(layer, config: ModelConfig, shard: TpShard) -> dict[str, TensorSlot]:
    """Hugging Face tensor name -> destination for one ``DecoderLayer`` holding ``shard``."""
    c, p, d = config, f"model.layers.{layer.layer}.", shard.head_dim
    q, kv, inter = shard.q_size, shard.kv_size, shard.inter.count
    sq = _heads(0, shard.q_heads, c.num_attention_heads, d)
    skv = _heads(0, shard.kv_heads, c.num_key_value_heads, d)
    s_inter = Slice(0, shard.inter.start, inter, c.intermediate_size)
    s_o = _heads(1, shard.q_heads, c.num_attention_heads, d)
    s_down = Slice(1, shard.inter.start, inter, c.intermediate_size)
    out = {
        p + "input_layernorm.weight": TensorSlot(layer.input_norm, 0, c.hidden_size),
        p + "self_attn.q_proj.weight": TensorSlot(layer.qkv_weight, 0, q, sq),
        p + "self_attn.k_proj.weight": TensorSlot(layer.qkv_weight, q, kv, skv),
        p + "self_attn.v_proj.weight": TensorSlot(layer.qkv_weight, q + kv, kv, skv),
        p + "self_attn.o_proj.weight": TensorSlot(layer.o_weight, 0, c.hidden_size, s_o),
        p + "post_attention_layernorm.weight": TensorSlot(layer.post_norm, 0, c.hidden_size),
        p + "mlp.gate_proj.weight": TensorSlot(layer.gate_up_weight, 0, inter, s_inter),
        p + "mlp.up_proj.weight": TensorSlot(layer.gate_up_weight, inter, inter, s_inter),
        p + "mlp.down_proj.weight": TensorSlot(layer.down_weight, 0, c.hidden_size, s_down),
    }
    if layer.qkv_bias is not None:
        out[p + "self_attn.q_proj.bias"] = TensorSlot(layer.qkv_bias, 0, q, sq)
        out[p + "self_attn.k_proj.bias"] = TensorSlot(layer.qkv_bias, q, kv, skv)
        out[p + "self_attn.v_proj.bias"] = TensorSlot(layer.qkv_bias, q + kv, kv, skv)
    if layer.o_bias is not None:
        out[p + "self_attn.o_proj.bias"] = TensorSlot(layer.o_bias, 0, c.hidden_size)
    if layer.q_norm is not None:
        out[p + "self_attn.q_norm.weight"] = TensorSlot(layer.q_norm, 0, c.head_dim)
        out[p + "self_attn.k_norm.weight"] = TensorSlot(layer.k_norm, 0, c.head_dim)
    if layer.gate_up_bias is not None:
        out[p + "mlp.gate_proj.bias"] = TensorSlot(layer.gate_up_bias, 0, inter, s_inter)
        out[p + "mlp.up_proj.bias"] = TensorSlot(layer.gate_up_bias, inter, inter, s_inter)
        out[p + "mlp.down_proj.bias"] = TensorSlot(layer.down_bias, 0, c.hidden_size)
    return out
