"""The model class of each served architecture, keyed by ``config.json``'s ``architectures``.

A new architecture is one file in this package and one entry here; ``config.py``'s
``SUPPORTED_ARCHITECTURES`` names its family, which decides biases and q/k norm. The Llama family is
the Llama forward (``llama.py``); Qwen3-MoE is that forward with sparse MoE layers (``qwen3_moe.py``);
DeepSeek-V2/V3 (MLA + MoE, its own latent KV pool) is ``deepseek.py``. Each class builds the KV pool
it reads with the classmethod ``make_kv_cache`` (``common/engine/factory.py``).
"""

from __future__ import annotations

from torch import nn

from kvferry.common.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvferry.common.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from kvferry.common.models.llama import LlamaForCausalLM
from kvferry.common.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}
assert set(MODELS) == set(SUPPORTED_ARCHITECTURES), "registry.py and config.py name different architectures"


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The class that serves ``config.architecture`` (already checked against ``SUPPORTED_ARCHITECTURES``
    when the config was parsed)."""
    return MODELS[config.architecture]
