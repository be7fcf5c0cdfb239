"""Llama-family model over a paged KV cache, its loader, tokenizer and the embedded tiny checkpoint."""

from common.model.config import ModelConfig, RopeScaling
from common.model.kv_cache import KvCache, PageAllocator, PageOwnershipError
from common.model.llama import LlamaForCausalLM, SeqChunk
from common.model.loader import load_model
from common.model.tiny import make_tiny_model, presets
from common.model.tokenizer import Tokenizer

__all__ = [
    "KvCache",
    "LlamaForCausalLM",
    "ModelConfig",
    "PageAllocator",
    "PageOwnershipError",
    "RopeScaling",
    "SeqChunk",
    "Tokenizer",
    "load_model",
    "make_tiny_model",
    "presets",
]
