"""Builds model slots and runners from checkpoint folders (shared by daemons, engine and benches)."""

from __future__ import annotations

from common.engine.runner import ModelRunner, ModelSlot
from common.errors import ConfigError
from common.model.config import ModelConfig
from common.model.kv_cache import KvCache, PageAllocator
from common.model.loader import load_model


def build_slot(model_dir: str, *, model_name: str, device: str, dtype: str | None, page_size: int,
               num_pages: int, kv_layout: str = "page-major") -> ModelSlot:
    model = load_model(model_dir, dtype=dtype, device=device)
    kv = KvCache(model.config, num_pages, page_size, model.dtype, device, model_name=model_name, layout=kv_layout)
    return ModelSlot(model, kv, PageAllocator(num_pages))


def build_runner(target_dir: str, draft_dir: str | None = None, *, device: str = "cpu", dtype: str | None = None,
                 page_size: int = 16, max_total_tokens: int = 65536, spec_k: int = 4,
                 draft_device: str | None = None, kv_layout: str = "page-major") -> ModelRunner:
    """Target (and draft) with their KV pools, both in ``kv_layout``; ``draft_device`` defaults to
    ``device``."""
    num_pages = max_total_tokens // page_size
    target = build_slot(target_dir, model_name="target", device=device, dtype=dtype, page_size=page_size,
                        num_pages=num_pages, kv_layout=kv_layout)
    draft = None
    if draft_dir:
        draft_cfg, target_cfg = ModelConfig.from_dir(draft_dir), target.model.config
        if draft_cfg.vocab_size != target_cfg.vocab_size:
            raise ConfigError(f"draft model {draft_dir} has vocab_size {draft_cfg.vocab_size}, target has "
                              f"{target_cfg.vocab_size}; speculative decoding needs one vocabulary")
        draft = build_slot(draft_dir, model_name="draft", device=draft_device or device, dtype=dtype,
                           page_size=page_size, num_pages=num_pages, kv_layout=kv_layout)
    return ModelRunner(target, draft, spec_k=spec_k)
