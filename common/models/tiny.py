"""The embedded default model: seeded, download-free Llama checkpoints (``kvferry make-tiny-model DIR``).

``make_tiny_model(out_dir, seed)`` writes two real Hugging Face checkpoint folders:

- ``out_dir/target``: a Llama whose layers past the first ``draft_layers`` have small output
  projections (``o_proj``, ``down_proj`` scaled by ``late_scale``), so they nudge the residual
  stream rather than rewrite it;
- ``out_dir/draft``: the target's first ``draft_layers`` layers with the same embedding, final norm
  and lm_head. It predicts the target's greedy token most of the time, so speculative decoding
  shows real acceptance.

Both carry a byte-level BPE tokenizer trained here on ``tiny_corpus.CORPUS``, a Llama-3-style chat
template and a generation config. The same seed gives the same bytes.

``presets`` also holds "llama-3.1-8b": the real 8B shapes (32 layers, 8 KV heads, head_dim 128,
llama3 RoPE) with random weights, for transfer and throughput work. Its vocabulary stays the tiny
tokenizer's (512), so its embedding and lm_head are far smaller than the real model's. "tiny-kv8"
has 8 attention and 8 KV heads in four layers, for tensor parallelism that splits the KV heads.
"tiny-vocab-66k" pads the vocabulary past 65,536 (as Llama-3's and Qwen's are) in a 16-wide, two-layer
model: its last 512 lm_head rows dominate the logits, so every position's most likely tokens have
ids that msgpack spends 5 bytes on (the size of a frame that carries them); the tokenizer stays the
tiny one's, and those ids decode to nothing. "tiny-moe" is a four-layer Qwen3-MoE (8 experts, top-2,
layer 1 dense); "qwen3-30b-a3b" has Qwen3-30B-A3B's shapes (128 experts, top-8) in 8 layers
(``tiny_moe.py``).

DeepSeek presets (``tiny_deepseek.py``): "deepseek-v3-tiny" (q_lora, sigmoid router with
``noaux_tc`` groups, yarn rope) and "deepseek-v2-tiny" (no q_lora as V2-Lite, softmax router with
``group_limited_greedy``, two shared experts as V2-Lite), three layers of which the first is dense,
8 routed experts, top-2, one shared (V3) or two (V2); "deepseek-v2-lite" has DeepSeek-V2-Lite's layer
shapes (hidden 2048, 16 heads, latent 512 + rope 64, 64 routed + 2 shared experts of 1,408, top-6,
yarn x40) in four layers, bfloat16.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvferry.common.models import tiny_deepseek, tiny_fp8, tiny_moe
from kvferry.common.models.tiny_corpus import CORPUS
from kvferry.common.models.tiny_deepseek import DeepseekShape

logger = logging.getLogger(__name__)

BOS, EOS, START_HEADER, END_HEADER, EOT = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
)
SPECIAL_TOKENS = [BOS, EOS, START_HEADER, END_HEADER, EOT]
VOCAB_SIZE = 512
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Shapes and init scales of a generated checkpoint pair."""

    hidden_size: int = 128
    num_layers: int = 10
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    draft_layers: int = 2
    late_scale: float = 0.04  # multiplies o_proj/down_proj of layers >= draft_layers
    logit_scale: float = 4.0  # std of the logits of a unit-RMS hidden state
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    max_shard_bytes: int = 2 << 30
    vocab_size: int = VOCAB_SIZE  # above the tokenizer's: padding rows (zero in lm_head), then top_rows
    top_rows: int = 0  # the last rows of a padded vocabulary: lm_head rows scaled by top_rows_scale
    top_rows_scale: float = 3.0
    num_experts: int = 0  # > 0: a Qwen3-MoE checkpoint (q/k norm; sparse layers of SwiGLU experts)
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    mlp_only_layers: tuple[int, ...] = ()  # MoE: the layers that keep a dense MLP of intermediate_size
    deepseek: DeepseekShape | None = None  # a DeepSeek-V2/V3 checkpoint (MLA + MoE; head_dim unused)


presets: dict[str, TinySpec] = {
    "tiny": TinySpec(),
    # 8 KV heads (no GQA), four layers: tensor parallelism splitting KV heads in blocks at TP 2 and 4
    "tiny-kv8": TinySpec(num_layers=4, num_heads=8, num_kv_heads=8, head_dim=16),
    # token ids past 65,535 at the top of every position's logits (prompt logprobs frames at their size)
    "tiny-vocab-66k": TinySpec(hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                               intermediate_size=32, draft_layers=1, max_position_embeddings=8192,
                               vocab_size=(1 << 16) + 512, top_rows=512),
    "llama-3.1-8b": TinySpec(
        hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
        rope_theta=500000.0, max_position_embeddings=131072, dtype="bfloat16",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    # Qwen3-MoE for the CPU suite: 8 experts, top-2, layer 1 dense (mlp_only_layers)
    "tiny-moe": TinySpec(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                         late_scale=0.3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                         mlp_only_layers=(1,)),
    # Qwen3-30B-A3B's shapes (128 experts, top-8) in 8 of its 48 layers, for the GPU
    "qwen3-30b-a3b": TinySpec(
        hidden_size=2048, num_layers=8, num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144,
        rope_theta=1000000.0, max_position_embeddings=40960, dtype="bfloat16", num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768,
    ),
    **tiny_deepseek.presets(TinySpec),
}


# Bumped whenever the default tiny checkpoint changes, so that cached copies are rewritten.
# 2: ten target layers (a two-layer draft costs about a fifth of a target step, closer to real pairs).
TINY_FORMAT = 2
STAMP_FILE = "kvferry-tiny.json"


def ensure_tiny_model(out_dir: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """The default tiny pair in ``out_dir``, written when missing or made by an older format.
    Safe to call from several processes at once (a file lock serializes the writers)."""
    import fcntl

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    want = {"format": TINY_FORMAT, "seed": seed}
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = out_dir / STAMP_FILE
        current = json.loads(stamp.read_text()) if stamp.is_file() else None
        if current != want or not (out_dir / "draft" / "model.safetensors").is_file():
            make_tiny_model(out_dir, seed=seed)
            stamp.write_text(json.dumps(want))
    return out_dir / "target", out_dir / "draft"


def make_tiny_model(out_dir: str | Path, seed: int = 0, preset: str | TinySpec = "tiny",
                    quantize: str | None = None) -> tuple[Path, Path]:
    """Write ``out_dir/target`` and ``out_dir/draft``; returns both paths. ``quantize``
    ("fp8-channel", "fp8-block"; ``tiny_fp8.py``) writes the same weights' FP8 checkpoints."""
    spec = presets[preset] if isinstance(preset, str) else preset
    tiny_fp8.check_quantize(quantize)
    if not 0 < spec.draft_layers <= spec.num_layers:
        raise ValueError(f"draft_layers is {spec.draft_layers}, expected 1..num_layers={spec.num_layers}")
    if spec.vocab_size < VOCAB_SIZE + spec.top_rows:
        raise ValueError(f"vocab_size is {spec.vocab_size}, expected >= the tokenizer's {VOCAB_SIZE} + top_rows "
                         f"{spec.top_rows}")
    tokenizer = train_tokenizer()
    if tokenizer.get_vocab_size() != VOCAB_SIZE:  # the corpus is fixed, so this is a code bug
        raise RuntimeError(f"tokenizer training gave {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    target_dir, draft_dir = Path(out_dir) / "target", Path(out_dir) / "draft"
    for folder, num_layers in ((target_dir, spec.num_layers), (draft_dir, spec.draft_layers)):
        folder.mkdir(parents=True, exist_ok=True)
        _write_side_files(folder, spec, num_layers, tokenizer, quantize)
    dtype_bytes = getattr(torch, spec.dtype).itemsize
    target_specs = _tensor_specs(spec, spec.num_layers)
    tensors = _generate(spec, target_specs, seed, _padded(_lm_head_row_scale(tokenizer), spec))
    if quantize is not None:
        tensors = tiny_fp8.quantize_stream(target_specs, tensors, quantize)
        target_specs = tiny_fp8.quantized_specs(target_specs, quantize)
    draft_specs = [(name, shape) for name, shape in target_specs if _in_draft(name, spec.draft_layers)]
    sizes = {name: math.prod(shape) * tiny_fp8.element_bytes(name, dtype_bytes, quantize)
             for name, shape in target_specs}
    # The draft's tensors are the target's (same names): keep them while the target streams out.
    kept: dict[str, torch.Tensor] = dict.fromkeys(name for name, _ in draft_specs)
    _write_shards(target_dir, target_specs, tensors, spec.max_shard_bytes, sizes, kept)
    draft_tensors = iter([kept[name] for name, _ in draft_specs])
    _write_shards(draft_dir, draft_specs, draft_tensors, spec.max_shard_bytes, sizes)
    logger.info("wrote tiny model seed=%d target=%s draft=%s", seed, target_dir, draft_dir)
    return target_dir, draft_dir


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on the built-in corpus; BOS added by the post-processor (like Llama 3)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.strip().splitlines(), trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def _in_draft(name: str, draft_layers: int) -> bool:
    return not name.startswith("model.layers.") or int(name.split(".")[2]) < draft_layers


def _write_side_files(folder: Path, spec: TinySpec, num_layers: int, tokenizer: Tokenizer,
                      quantize: str | None) -> None:
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    vocab_size = max(tokenizer.get_vocab_size(), spec.vocab_size)
    config = _config_json(spec, num_layers, vocab_size, ids[BOS], [ids[EOS], ids[EOT]])
    if quantize is not None:
        config["quantization_config"] = tiny_fp8.quantization_config(quantize)
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json", {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[EOT]]})
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
    })
    (folder / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n")


def _config_json(spec: TinySpec, num_layers: int, vocab_size: int, bos: int, eos: list[int]) -> dict:
    # The fields and names transformers 5 writes for a LlamaConfig (a Qwen3MoeConfig with experts).
    rope = {"rope_theta": spec.rope_theta, "rope_type": "default", **(spec.rope_scaling or {})}
    out = _llama_config_json(spec, num_layers, vocab_size, bos, eos, rope) | tiny_moe.config_fields(spec, num_layers)
    if spec.deepseek is not None:
        out.update(tiny_deepseek.config_fields(spec.deepseek, spec.num_heads))
    return out


def _llama_config_json(spec: TinySpec, num_layers: int, vocab_size: int, bos: int, eos: list[int],
                       rope: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "dtype": spec.dtype,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "mlp_bias": False,
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": spec.num_kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "rope_parameters": rope,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _tensor_specs(spec: TinySpec, num_layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of every tensor, in the order they are generated and written."""
    h, inter = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    out = [("model.embed_tokens.weight", (spec.vocab_size, h))]
    for i in range(num_layers):
        if spec.deepseek is not None:
            out += tiny_deepseek.layer_tensors(spec.deepseek, i, h, inter, spec.num_heads)
            continue
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        if spec.num_experts:
            out += [(p + f"self_attn.{n}_norm.weight", (spec.head_dim,)) for n in ("q", "k")]
        if spec.num_experts and i not in spec.mlp_only_layers:
            out += tiny_moe.expert_specs(spec, p)
        else:
            out += [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                    (p + "mlp.down_proj.weight", (h, inter))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (spec.vocab_size, h))]


def _init_std(spec: TinySpec, name: str, shape: tuple[int, ...]) -> float | None:
    """Std of a normal init, or None for norm weights (ones)."""
    if name.endswith("norm.weight"):
        return None
    if name == "model.embed_tokens.weight":
        return 1.0
    if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: small, so scores still decide
        return 0.1
    if name == "lm_head.weight":
        return spec.logit_scale / math.sqrt(spec.hidden_size)
    std = 1.0 / math.sqrt(shape[1])  # unit-variance outputs for unit-RMS inputs
    layer = int(name.split(".")[2])
    if layer >= spec.draft_layers and name.endswith(("o_proj.weight", "down_proj.weight")):
        std *= spec.late_scale
    return std


def _lm_head_row_scale(tokenizer: Tokenizer) -> torch.Tensor:
    """[vocab] 1.0 for tokens that decode to printable ASCII (and EOS/EOT), 0.02 for the rest.

    A near-zero lm_head row gives a near-zero logit, far below the top logits (std ``logit_scale``),
    so generated text is readable word fragments instead of stray UTF-8 bytes and BOS.
    """
    scale = torch.full((tokenizer.get_vocab_size(),), 0.02)
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if (text.isascii() and text.isprintable() and text) or text in (EOS, EOT):
            scale[token_id] = 1.0
    return scale


def _padded(scale: torch.Tensor, spec: TinySpec) -> torch.Tensor:
    """[spec.vocab_size] ``scale`` (the tokenizer's rows), then zeros, then ``top_rows`` of ``top_rows_scale``."""
    out = torch.zeros(spec.vocab_size)
    out[:len(scale)] = scale
    if spec.top_rows:
        out[-spec.top_rows:] = spec.top_rows_scale
    return out


def _generate(
    spec: TinySpec, specs: list[tuple[str, tuple[int, ...]]], seed: int, lm_head_row_scale: torch.Tensor
) -> Iterator[torch.Tensor]:
    """One tensor at a time from one seeded CPU generator, so an 8B checkpoint never sits in memory."""
    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    for name, shape in specs:
        std = _init_std(spec, name, shape)
        if std is None:
            yield torch.ones(shape, dtype=dtype)
            continue
        tensor = torch.randn(shape, generator=generator) * std
        if name == "lm_head.weight":
            tensor *= lm_head_row_scale[:, None]
        yield tensor.to(dtype)


def _write_shards(
    folder: Path,
    specs: list[tuple[str, tuple[int, ...]]],
    tensors: Iterator[torch.Tensor],
    max_shard_bytes: int,
    sizes: dict[str, int],
    kept: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write ``model.safetensors``, or numbered shards plus an index past ``max_shard_bytes``.

    ``tensors`` is consumed lazily, one shard at a time; names already in ``kept`` get their tensor.
    ``sizes`` holds each tensor's bytes.
    """
    groups: list[list[str]] = [[]]
    group_bytes = 0
    for name, _ in specs:
        num_bytes = sizes[name]
        if groups[-1] and group_bytes + num_bytes > max_shard_bytes:
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += num_bytes
    for stale in folder.glob("model*.safetensors*"):  # an earlier run may have sharded differently
        stale.unlink()
    weight_map = {}
    for index, group in enumerate(groups, start=1):
        file_name = "model.safetensors" if len(groups) == 1 else f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        shard = {name: next(tensors) for name in group}
        for name, tensor in shard.items():
            weight_map[name] = file_name
            if kept is not None and name in kept:
                kept[name] = tensor
        save_file(shard, str(folder / file_name), metadata={"format": "pt"})
    if len(groups) > 1:
        total = sum(sizes[name] for name, _ in specs)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(folder / "model.safetensors.index.json", index)
