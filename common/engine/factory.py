"""Builds model slots and runners from checkpoint folders (shared by daemons, engine and benches)."""

from __future__ import annotations

from common.engine.cuda_graph import StepGraphs
from common.engine.runner import ModelRunner, ModelSlot
from common.errors import ConfigError
from common.model.config import ModelConfig
from common.model.kv_cache import KvCache, PageAllocator
from common.model.loader import load_model


def build_slot(model_dir: str, *, model_name: str, device: str, dtype: str | None, page_size: int,
               num_pages: int, kv_layout: str = "page-major", attention_backend: str = "auto",
               cuda_graph_max_bs: int = 0, verify_tokens: int = 0) -> ModelSlot:
    """A loaded model with its KV pool; on CUDA with the triton backend and ``cuda_graph_max_bs`` > 0,
    decode graphs (and verify graphs of ``verify_tokens`` tokens per sequence, when > 1) are captured
    here (start-up, before the daemon reports READY)."""
    model = load_model(model_dir, dtype=dtype, device=device)
    try:
        model.set_attention_backend(attention_backend)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    kv = KvCache(model.config, num_pages, page_size, model.dtype, device, model_name=model_name, layout=kv_layout)
    slot = ModelSlot(model, kv, PageAllocator(num_pages))
    if cuda_graph_max_bs > 0 and kv.device.type == "cuda" and model.attn.name == "triton":
        max_context = min(model.config.max_position_embeddings, num_pages * page_size)
        pool = None
        for q in [1] + ([verify_tokens] if verify_tokens > 1 else []):
            graphs = StepGraphs(model, kv, max_batch_size=cuda_graph_max_bs, max_context_tokens=max_context,
                                tokens_per_seq=q, pool=pool)
            graphs.capture()
            slot.graphs.append(graphs)
            pool = graphs.pool
    return slot


def build_runner(target_dir: str, draft_dir: str | None = None, *, device: str = "cpu", dtype: str | None = None,
                 page_size: int = 16, max_total_tokens: int = 65536, spec_k: int = 4,
                 draft_device: str | None = None, kv_layout: str = "page-major", attention_backend: str = "auto",
                 cuda_graph_max_bs: int = 128, disable_cuda_graph: bool = False) -> ModelRunner:
    """Target (and draft) with their KV pools, both in ``kv_layout``; ``draft_device`` defaults to
    ``device``. ``attention_backend`` and the CUDA graph settings apply to both models."""
    num_pages = max_total_tokens // page_size
    engine = {"kv_layout": kv_layout, "attention_backend": attention_backend,
              "cuda_graph_max_bs": 0 if disable_cuda_graph else cuda_graph_max_bs}
    target = build_slot(target_dir, model_name="target", device=device, dtype=dtype, page_size=page_size,
                        num_pages=num_pages, verify_tokens=spec_k + 1 if draft_dir else 0, **engine)
    draft = None
    if draft_dir:
        draft_cfg, target_cfg = ModelConfig.from_dir(draft_dir), target.model.config
        if draft_cfg.vocab_size != target_cfg.vocab_size:
            raise ConfigError(f"draft model {draft_dir} has vocab_size {draft_cfg.vocab_size}, target has "
                              f"{target_cfg.vocab_size}; speculative decoding needs one vocabulary")
        if (draft_device or device) == "cpu":  # a DRAM draft beside a CUDA target runs the torch path
            engine["attention_backend"] = "auto"
        draft = build_slot(draft_dir, model_name="draft", device=draft_device or device, dtype=dtype,
                           page_size=page_size, num_pages=num_pages, **engine)
    return ModelRunner(target, draft, spec_k=spec_k)
