"""Tensor-parallel sharding of the Llama weights: which rows and columns of each Hugging Face tensor
one rank holds, and where they land in the fused weights.

Megatron-style, over ``tp_size`` ranks::

    qkv_proj, gate_up_proj   column-parallel: rank r holds the rows of its attention heads, its KV
                             heads and its block of the intermediate size (sliced at load time)
    o_proj, down_proj        row-parallel: rank r holds the matching columns; each rank's partial
                             product is summed by one all_reduce over the TP group (the bias is
                             added by rank 0 only, so it is counted once)
    embed_tokens, lm_head,   replicated: every rank holds them whole (the simplest choice; the
    norms, MoE router        vocabulary is not split, and only rank 0 computes logits)
    MLA (DeepSeek)           q_proj / q_b_proj and kv_b_proj rows of this rank's heads, o_proj
                             their columns (row-parallel); q_a / kv_a projections and norms
                             replicated, so every rank computes the same latent and its pool holds
                             all of it (``kv_heads`` is the one latent "head" on every rank)
    MoE experts              each expert's intermediate dimension split like the dense MLP's (w13
                             rows, w2 columns: ``moe_inter``), one all_reduce per MoE block; every
                             rank holds every expert (``rank_experts``, where expert parallelism goes)

Attention heads are split in equal blocks; KV heads follow ``kvferry.common.plan.tp.rank_heads`` (blocks,
or one head replicated on ``tp_size / num_kv_heads`` consecutive ranks), so rank r's query heads
always read KV heads it holds. ``TpShard.single(config)`` is the whole model (TP 1).

FP8 weights (``common/layers/fp8.py``) are sliced the same way, their scales with them
(``ScaleSlot``): per-row scales follow the rows, block scales follow rows and 128-column groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvferry.common.errors import ConfigError, GeometryMismatchError, ModelLoadError
from kvferry.common.layers.fp8 import FP8_DTYPE, Fp8Weight
from kvferry.common.models.config import ModelConfig
from kvferry.common.plan.tp import HeadRange, rank_heads


def experts_inter(c: ModelConfig) -> int | None:
    """Every routed expert's intermediate size (Qwen3-MoE's or DeepSeek's), None for a dense model."""
    if c.moe is not None:
        return c.moe.moe_intermediate_size
    return c.deepseek.moe_intermediate_size if c.deepseek is not None else None


def valid_tp_sizes(c: ModelConfig) -> list[int]:
    """The TP sizes a model can be sharded over: those ``tp_refusal`` has nothing against."""
    return [t for t in range(1, c.num_attention_heads + 1) if tp_refusal(c, t) is None]


def tp_refusal(c: ModelConfig, tp_size: int) -> str | None:
    """Why ``tp_size`` does not fit (the first rule it breaks, with the model's numbers), or None.

    ``tp_size`` must divide the attention heads, the intermediate size and the experts'
    intermediate size (DeepSeek's shared experts are experts of that size too), and
    divide or be divided by the KV heads (``kvferry.common.plan.tp.check_tp``). DeepSeek's latent
    is one head every rank holds whole, so its KV heads set no rule."""
    if c.num_attention_heads % tp_size:
        return f"{c.num_attention_heads} attention heads do not divide by {tp_size}"
    if c.intermediate_size % tp_size:
        return f"intermediate size {c.intermediate_size} does not divide by {tp_size}"
    moe_inter = experts_inter(c)
    if moe_inter is not None and moe_inter % tp_size:
        return f"MoE intermediate size {moe_inter} does not divide by {tp_size}"
    if c.deepseek is None and c.num_key_value_heads % tp_size and tp_size % c.num_key_value_heads:
        return f"{c.num_key_value_heads} KV heads and {tp_size} ranks: neither divides the other"
    return None


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
    moe_inter: HeadRange | None = None  # the same for every routed expert (Qwen3-MoE, DeepSeek; None: dense)

    @classmethod
    def single(cls, config: ModelConfig) -> "TpShard":
        return cls.of(config, 1, 0)

    @classmethod
    def of(cls, config: ModelConfig, tp_size: int, tp_rank: int) -> "TpShard":
        """Raises TpConfigError when the heads or the intermediate size do not divide by ``tp_size``."""
        c = config
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise TpConfigError(f"--tp-size {tp_size} with rank {tp_rank}: need tp_size >= 1 and 0 <= rank < tp_size")
        refusal = tp_refusal(c, tp_size)
        if refusal is not None:
            raise TpConfigError(f"--tp-size {tp_size}: {refusal}; valid sizes for {c.architecture} ({c.source}): "
                                f"{', '.join(map(str, valid_tp_sizes(c)))}")
        num_kv_heads = 1 if c.deepseek is not None else c.num_key_value_heads  # MLA: one latent, replicated
        try:
            kv_heads = rank_heads(num_kv_heads, tp_size, tp_rank, side=f"--tp-size {tp_size}")
        except GeometryMismatchError as exc:
            raise TpConfigError(str(exc)) from exc
        moe_inter = experts_inter(c)
        return cls(tp_size, tp_rank, c.head_dim, _block(c.num_attention_heads, tp_size, tp_rank), kv_heads,
                   _block(c.intermediate_size, tp_size, tp_rank),
                   _block(moe_inter, tp_size, tp_rank) if moe_inter is not None else None)

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


def _block(full: int, tp_size: int, tp_rank: int) -> HeadRange:
    """Rank ``tp_rank``'s block when ``full`` elements split in ``tp_size`` equal blocks (``full``
    divides by ``tp_size``: ``tp_refusal``)."""
    part = full // tp_size
    return HeadRange(tp_rank * part, part)


def rank_experts(num_experts: int, shard: TpShard) -> HeadRange:
    """The experts rank ``shard.tp_rank`` holds: all of them at every TP size (each split along its
    intermediate dimension). The one place that decides it, so that expert parallelism (a block of
    experts per rank) changes this function and the weights it sizes, not the callers."""
    return HeadRange(0, num_experts)


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

    def problem(self, tensor: torch.Tensor) -> str | None:
        """Why the checkpoint ``tensor`` cannot fill this slot (None: it can)."""
        if tuple(tensor.shape) != self.checkpoint_shape():
            return f"has shape {tuple(tensor.shape)}, config.json implies {self.checkpoint_shape()}"
        if (tensor.dtype == FP8_DTYPE) != (self.target.dtype == FP8_DTYPE):
            return (f"has dtype {tensor.dtype} where config.json's quantization_config implies {self.target.dtype} "
                    "(an FP8 tensor needs its module quantized, and a quantized module an FP8 tensor)")
        return None

    def fill(self, tensor: torch.Tensor) -> None:
        self.target.narrow(0, self.row_start, self.num_rows).copy_(self.take(tensor))


@dataclass(frozen=True)
class ScaleSlot:
    """Where the scale of an FP8 checkpoint weight lands: rows [row_start, row_start + num_rows) of
    ``target.scale``, for the weight slice ``source`` of a [full_out, full_in] checkpoint weight.

    Accepted checkpoint shapes: [] or [1] (per tensor: repeated over the part's rows), [full_out, 1]
    or [full_out] (per channel), and for a block weight [ceil(full_out/B), ceil(full_in/B)] (each
    block row repeated for its weight rows; a TP slice along ``in`` must start on a block boundary,
    refused at construction with the sizes)."""

    name: str
    target: Fp8Weight
    row_start: int
    num_rows: int
    source: Slice | None
    full_out: int
    full_in: int

    def __post_init__(self) -> None:
        s, block = self.source, self.target.block
        if block is None or s is None or s.dim != 1:
            return
        if s.start % block or (s.length % block and s.start + s.length != s.full):
            raise ModelLoadError(
                f"{self.name}: this rank's columns [{s.start}, {s.start + s.length}) of {s.full} do not align to the "
                f"{block}-column FP8 blocks; choose a --tp-size whose per-rank size of this dim is a multiple of "
                f"{block}")

    def _shapes(self) -> list[tuple[int, ...]]:
        block = self.target.block
        if block is not None:
            return [(-(-self.full_out // block), -(-self.full_in // block))]
        return [(), (1,), (self.full_out, 1), (self.full_out,)]

    def problem(self, tensor: torch.Tensor) -> str | None:
        if tuple(tensor.shape) not in self._shapes():
            return f"has shape {tuple(tensor.shape)}; an FP8 scale of this weight has one of {self._shapes()}"
        return None

    def fill(self, tensor: torch.Tensor) -> None:
        rows = self.target.scale.narrow(0, self.row_start, self.num_rows)
        s, block = self.source, self.target.block
        first = s.start if s is not None and s.dim == 0 else 0  # first checkpoint row of this part
        if block is None:
            values = tensor.float().reshape(-1)
            rows.copy_(values.expand(self.num_rows) if values.numel() == 1 else values[first:first + self.num_rows])
            return
        block_rows = torch.arange(first, first + self.num_rows) // block
        cols = slice(None)
        if s is not None and s.dim == 1:  # this rank's 128-column groups (aligned: __post_init__)
            cols = slice(s.start // block, -(-(s.start + s.length) // block))
        rows.copy_(tensor.float()[block_rows][:, cols])


def linear_slots(module: str, target, row_start: int, num_rows: int, source: Slice | None,
                 scale_suffix: str) -> dict[str, TensorSlot | ScaleSlot]:
    """The slots of one Hugging Face linear ``module`` landing in ``target`` (a plain weight, or an
    ``Fp8Weight`` with its scale, named ``module.scale_suffix`` in the checkpoint)."""
    if not isinstance(target, Fp8Weight):
        return {module + ".weight": TensorSlot(target, row_start, num_rows, source)}
    slot = TensorSlot(target.weight, row_start, num_rows, source)
    full_out, full_in = slot.checkpoint_shape()
    scale = ScaleSlot(f"{module}.{scale_suffix}", target, row_start, num_rows, source, full_out, full_in)
    return {module + ".weight": slot, f"{module}.{scale_suffix}": scale}


def head_slice(dim: int, heads: HeadRange, num_heads: int, head_dim: int) -> Slice:
    return Slice(dim, heads.start * head_dim, heads.count * head_dim, num_heads * head_dim)


def layer_tensor_map(layer, config: ModelConfig, shard: TpShard) -> dict[str, TensorSlot | ScaleSlot]:
    """Hugging Face tensor name -> destination for one ``DecoderLayer`` holding ``shard``."""
    return {**attention_tensor_map(layer, config, shard), **mlp_tensor_map(layer, config, shard)}


def _scale_suffix(config: ModelConfig) -> str:
    return config.quantization.scale_suffix if config.quantization is not None else ""


def mlp_tensor_map(layer, config: ModelConfig, shard: TpShard) -> dict[str, TensorSlot | ScaleSlot]:
    """The dense MLP's tensors of one ``DecoderLayer`` (gate/up column-parallel, down row-parallel;
    FP8 weights with their scales)."""
    c, p = config, f"model.layers.{layer.layer}.mlp."
    inter = shard.inter.count
    s_inter = Slice(0, shard.inter.start, inter, c.intermediate_size)
    s_down = Slice(1, shard.inter.start, inter, c.intermediate_size)
    out: dict[str, TensorSlot | ScaleSlot] = {}
    for module, target, row_start, num_rows, source in (
            ("gate_proj", layer.gate_up_weight, 0, inter, s_inter), ("up_proj", layer.gate_up_weight, inter, inter, s_inter),
            ("down_proj", layer.down_weight, 0, c.hidden_size, s_down)):
        out.update(linear_slots(p + module, target, row_start, num_rows, source, _scale_suffix(c)))
    if layer.gate_up_bias is not None:
        out[p + "gate_proj.bias"] = TensorSlot(layer.gate_up_bias, 0, inter, s_inter)
        out[p + "up_proj.bias"] = TensorSlot(layer.gate_up_bias, inter, inter, s_inter)
        out[p + "down_proj.bias"] = TensorSlot(layer.down_bias, 0, c.hidden_size)
    return out


def attention_tensor_map(layer, config: ModelConfig, shard: TpShard) -> dict[str, TensorSlot | ScaleSlot]:
    """The attention's and the two norms' tensors of one ``DecoderLayer`` (FP8 weights with their scales)."""
    c, p, d = config, f"model.layers.{layer.layer}.", shard.head_dim
    q, kv = shard.q_size, shard.kv_size
    sq = head_slice(0, shard.q_heads, c.num_attention_heads, d)
    skv = head_slice(0, shard.kv_heads, c.num_key_value_heads, d)
    s_o = head_slice(1, shard.q_heads, c.num_attention_heads, d)
    linears = [("self_attn.q_proj", layer.qkv_weight, 0, q, sq), ("self_attn.k_proj", layer.qkv_weight, q, kv, skv),
               ("self_attn.v_proj", layer.qkv_weight, q + kv, kv, skv),
               ("self_attn.o_proj", layer.o_weight, 0, c.hidden_size, s_o)]
    out: dict[str, TensorSlot | ScaleSlot] = {
        p + "input_layernorm.weight": TensorSlot(layer.input_norm, 0, c.hidden_size),
        p + "post_attention_layernorm.weight": TensorSlot(layer.post_norm, 0, c.hidden_size),
    }
    for module, target, row_start, num_rows, source in linears:
        out.update(linear_slots(p + module, target, row_start, num_rows, source, _scale_suffix(c)))
    if layer.qkv_bias is not None:
        out[p + "self_attn.q_proj.bias"] = TensorSlot(layer.qkv_bias, 0, q, sq)
        out[p + "self_attn.k_proj.bias"] = TensorSlot(layer.qkv_bias, q, kv, skv)
        out[p + "self_attn.v_proj.bias"] = TensorSlot(layer.qkv_bias, q + kv, kv, skv)
    if layer.o_bias is not None:
        out[p + "self_attn.o_proj.bias"] = TensorSlot(layer.o_bias, 0, c.hidden_size)
    if layer.q_norm is not None:
        out[p + "self_attn.q_norm.weight"] = TensorSlot(layer.q_norm, 0, c.head_dim)
        out[p + "self_attn.k_norm.weight"] = TensorSlot(layer.k_norm, 0, c.head_dim)
    return out
