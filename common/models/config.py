"""Model configuration parsed from a Hugging Face ``config.json`` (transformers 4 and 5 field names).

Accepted: the Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3), Qwen3-MoE (``MoeConfig``:
its sparse blocks; its attention is Qwen3's) and DeepSeek-V2/V3 (whose MLA and MoE settings
``deepseek_config.py`` reads into ``ModelConfig.deepseek``); the dense Llama family with plain or
FP8 weights (``quantization_config``, parsed by ``quant_config.py``). Everything the
forward pass, the KV layout and the fingerprint need is read here, once; nothing else opens
``config.json``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvferry.common.errors import ModelLoadError
from kvferry.common.models.deepseek_config import DeepseekSpec, parse_deepseek
from kvferry.common.models.quant_config import Fp8Scheme, parse_quantization

logger = logging.getLogger(__name__)

# architecture -> short family name; the family decides biases and q/k norm.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
DEEPSEEK_FAMILIES = ("deepseek_v2", "deepseek_v3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``rope_type`` is "linear" (positions / factor), "llama3" (Llama 3.1)
    or "yarn" (DeepSeek only; the fields from ``beta_fast`` on, None for the other types)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MoE blocks of a Qwen3-MoE checkpoint: router softmax over ``num_experts``, the top
    ``num_experts_per_tok`` experts (their weights renormalised to sum 1 when ``norm_topk_prob``), each
    a SwiGLU MLP of ``moe_intermediate_size``. ``sparse_layers[i]`` says whether layer i is sparse; the
    others are dense MLPs of ``ModelConfig.intermediate_size``."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]


@dataclass(frozen=True)
class ModelConfig:
    """The fields of one checkpoint that the model code reads. Built by ``from_dir``/``from_dict``.

    ``sliding_windows`` holds one entry per layer: None for full attention, else the window in
    tokens (a query at position p sees keys at positions > p - window).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    has_qkv_bias: bool
    has_o_bias: bool
    has_mlp_bias: bool
    has_qk_norm: bool
    has_tied_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    sliding_windows: tuple[int | None, ...]
    source: str = "<dict>"
    moe: MoeConfig | None = None  # None: every layer is a dense MLP
    quantization: Fp8Scheme | None = None  # FP8 weights (``quant_config.py``); None: plain dtype weights
    deepseek: DeepseekSpec | None = None  # MLA + MoE settings of a DeepSeek-V2/V3 checkpoint

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: file not found; --model must name a Hugging Face checkpoint folder")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<dict>") -> "ModelConfig":
        return _parse(_Fields(raw, source))

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def fingerprint(self) -> str:
        """16 hex digits over what fixes the KV layout and the numerics; both daemons compare it."""
        # None-valued fields (yarn's, on other types) are left out: older fingerprints stay as they were.
        rope = None if self.rope_scaling is None else {
            k: v for k, v in vars(self.rope_scaling).items() if v is not None}
        key = {
            "architecture": self.architecture,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope,
            "sliding_windows": list(self.sliding_windows),
        }
        if self.moe is not None:  # dense fingerprints stay as they were
            key["moe"] = dataclasses.asdict(self.moe)
        if self.quantization is not None:  # unquantized checkpoints keep the fingerprint they had
            key["quantization"] = self.quantization.fingerprint_key()
        if self.deepseek is not None:
            key["deepseek"] = vars(self.deepseek)
        blob = json.dumps(key, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class _Fields:
    """Typed access to config.json entries; every failure names the file and the field."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def error(self, field: str, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: field '{field}' {problem}")

    def get(self, field: str, kind: type, default: Any = ..., within: str = "") -> Any:
        """``within`` names a nested table ("rope_parameters") to read from instead of the top level."""
        table = (self.raw.get(within) or {}) if within else self.raw
        label = f"{within}.{field}" if within else field
        value = table.get(field)
        if value is None:
            if default is ...:
                raise self.error(label, "is missing")
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.error(label, f"has type {type(value).__name__}, expected {kind.__name__}")
        return value

    def positive(self, field: str, default: Any = ...) -> int:
        value = self.get(field, int, default)
        if value <= 0:
            raise self.error(field, f"is {value}, expected > 0")
        return value


def _parse(f: _Fields) -> ModelConfig:
    architecture = _architecture(f)
    family = SUPPORTED_ARCHITECTURES[architecture]
    hidden = f.positive("hidden_size")
    heads = f.positive("num_attention_heads")
    kv_heads = f.positive("num_key_value_heads", heads)
    if heads % kv_heads:
        raise f.error("num_key_value_heads", f"is {kv_heads}, which does not divide num_attention_heads={heads}")
    deepseek = parse_deepseek(f, architecture) if family in DEEPSEEK_FAMILIES else None
    # DeepSeek's head_dim is its rotary part (transformers writes it so; older files lack it).
    head_dim = deepseek.qk_rope_head_dim if deepseek is not None else f.positive("head_dim", hidden // heads)
    if head_dim % 2:
        raise f.error("head_dim", f"is {head_dim}, expected an even number (rotary pairs)")
    num_layers = f.positive("num_hidden_layers")
    attention_bias = f.get("attention_bias", bool, False)
    theta, scaling = _rope(f)
    if scaling is not None and scaling.rope_type == "yarn" and deepseek is None:
        raise f.error("rope_parameters.rope_type", f"is 'yarn', which this model code supports for DeepSeek only, "
                      f"not {architecture}")
    return ModelConfig(
        architecture=architecture,
        vocab_size=f.positive("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.positive("intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.get("rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=f.positive("max_position_embeddings", 4096),
        # Qwen2 always biases q/k/v and never o; Llama/Qwen3 bias all four when attention_bias is set.
        has_qkv_bias=family == "qwen2" or attention_bias,
        has_o_bias=family != "qwen2" and attention_bias,
        has_mlp_bias=family == "llama" and f.get("mlp_bias", bool, False),
        has_qk_norm=family in ("qwen3", "qwen3_moe"),
        has_tied_embeddings=f.get("tie_word_embeddings", bool, False),
        bos_token_id=f.get("bos_token_id", int, None),
        eos_token_ids=_eos_ids(f),
        torch_dtype=_dtype_name(f),
        sliding_windows=_sliding_windows(f, family, num_layers),
        source=f.source,
        moe=_moe(f, num_layers) if family == "qwen3_moe" else None,
        quantization=_quantization(f, family),
        deepseek=deepseek,
    )


def _architecture(f: _Fields) -> str:
    names = f.get("architectures", list)
    supported = [name for name in names if name in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise f.error(
            "architectures",
            f"is {names}; supported: {sorted(SUPPORTED_ARCHITECTURES)}",
        )
    return supported[0]


def _rope(f: _Fields) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes "rope_parameters" (theta inside); transformers 4 writes "rope_theta" plus
    # an optional "rope_scaling" whose type key is "rope_type" or the older "type".
    within = "rope_parameters" if f.raw.get("rope_parameters") is not None else "rope_scaling"
    params = f.get(within, dict, {})
    if any(isinstance(v, dict) for v in params.values()):
        raise f.error(within, "holds per-layer-type RoPE parameters, which this model code does not support")
    theta = f.get("rope_theta", float, None, within=within)
    if theta is None:
        theta = f.get("rope_theta", float, 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise f.error(f"{within}.rope_type", f"is {rope_type!r}; supported: {list(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise f.error(f"{within}.partial_rotary_factor", "is not 1.0; partial rotary is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn":
        return theta, _yarn(f, within)
    factor = f.get("factor", float, within=within)
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor)
    # Like transformers, a llama3 table without original_max_position_embeddings uses the model's own.
    original = f.get("original_max_position_embeddings", int, None, within=within)
    if original is None:
        original = f.positive("max_position_embeddings")
    return theta, RopeScaling(
        "llama3",
        factor,
        low_freq_factor=f.get("low_freq_factor", float, within=within),
        high_freq_factor=f.get("high_freq_factor", float, within=within),
        original_max_position_embeddings=original,
    )


def _yarn(f: _Fields, within: str) -> RopeScaling:
    # As transformers' _compute_yarn_parameters: a missing factor is max / original positions.
    max_positions = f.positive("max_position_embeddings", 4096)  # the default _parse uses
    original = f.get("original_max_position_embeddings", int, None, within=within) or max_positions
    factor = f.get("factor", float, None, within=within)
    if factor is None:
        factor = max_positions / original
    return RopeScaling(
        "yarn", factor, original_max_position_embeddings=original,
        beta_fast=f.get("beta_fast", float, 32.0, within=within),
        beta_slow=f.get("beta_slow", float, 1.0, within=within),
        mscale=f.get("mscale", float, None, within=within),
        mscale_all_dim=f.get("mscale_all_dim", float, None, within=within),
        attention_factor=f.get("attention_factor", float, None, within=within),
        truncate=f.get("truncate", bool, True, within=within),
    )


def _eos_ids(f: _Fields) -> tuple[int, ...]:
    value = f.raw.get("eos_token_id")
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise f.error("eos_token_id", f"is {value!r}, expected an int or a list of ints")
    return tuple(values)


def _dtype_name(f: _Fields) -> str:
    # transformers 5 writes "dtype", transformers 4 "torch_dtype".
    name = f.raw.get("dtype") or f.raw.get("torch_dtype") or "float32"
    if name not in ("float32", "float16", "bfloat16"):
        raise f.error("dtype", f"is {name!r}; supported: float32, float16, bfloat16")
    return name


def _moe(f: _Fields, num_layers: int) -> MoeConfig:
    # transformers 5 writes "num_local_experts"; the Hub's Qwen3-MoE checkpoints "num_experts".
    num_experts = f.positive("num_experts" if f.raw.get("num_experts") is not None else "num_local_experts")
    top_k = f.positive("num_experts_per_tok")
    if top_k > num_experts:
        raise f.error("num_experts_per_tok", f"is {top_k}, more than num_experts={num_experts}")
    step = f.positive("decoder_sparse_step", 1)
    dense = f.get("mlp_only_layers", list, [])
    bad = [i for i in dense if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers]
    if bad:
        raise f.error("mlp_only_layers", f"holds {bad}, expected layer indices 0..{num_layers - 1}")
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=f.positive("moe_intermediate_size"),
        norm_topk_prob=f.get("norm_topk_prob", bool, False),
        # as transformers' Qwen3MoeDecoderLayer decides it
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
    )


def _sliding_windows(f: _Fields, family: str, num_layers: int) -> tuple[int | None, ...]:
    if family == "qwen3_moe":  # one window for every layer, when use_sliding_window is set
        window = f.get("sliding_window", int, None) if f.raw.get("use_sliding_window") else None
        if f.raw.get("use_sliding_window") and window is None:
            raise f.error("sliding_window", "is missing while use_sliding_window is true")
        return (window,) * num_layers
    if family == "mistral":
        window = f.get("sliding_window", int, None)
        return (window,) * num_layers
    if family not in ("qwen2", "qwen3"):
        return (None,) * num_layers
    layer_types = f.raw.get("layer_types")
    if layer_types is None:
        if f.raw.get("use_sliding_window"):
            raise f.error("layer_types", "is missing while use_sliding_window is true; cannot tell which layers slide")
        return (None,) * num_layers
    if len(layer_types) != num_layers:
        raise f.error("layer_types", f"has {len(layer_types)} entries, expected num_hidden_layers={num_layers}")
    window = f.get("sliding_window", int, None)
    if "sliding_attention" in layer_types and window is None:
        raise f.error("sliding_window", "is missing while layer_types names sliding_attention layers")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _quantization(f, family: str) -> Fp8Scheme | None:
    """The checkpoint's FP8 scheme, if any. A sparse MoE checkpoint in FP8 is refused by name: its
    experts' weights are plain stacked tensors today (``common/layers/moe.py``)."""
    scheme = parse_quantization(f.raw.get("quantization_config"), f.source)
    if scheme is not None and family == "qwen3_moe":
        raise ModelLoadError(f"{f.source}: quantization_config {scheme.quant_method!r} on a {family} checkpoint: "
                             f"FP8 weights load for dense models only; serve the bf16 checkpoint of this MoE model")
    return scheme
