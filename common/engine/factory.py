"""Builds model slots and runners from checkpoint folders (shared by daemons, engine and benches)."""

from __future__ import annotations

from kvferry.common.engine.cuda_graph import StepGraphs
from kvferry.common.engine.runner import ModelRunner, ModelSlot
from kvferry.common.engine.tp_comm import rank_device
from kvferry.common.engine.tp_group import TpGroup, TpSpec
from kvferry.common.errors import ConfigError
from kvferry.common.models.config import ModelConfig
from kvferry.common.cache.kv_cache import PageAllocator
from kvferry.common.cache.pool import KvPool
from kvferry.common.kernels.kv_quant import is_quantized, pool_dtype
from kvferry.common.models.loader import load_model, read_kv_scales
from kvferry.common.layers.tp_layers import TpConfigError, TpShard


def build_kv_cache(model, model_dir: str, kv_cache_dtype: str, num_pages: int, page_size: int, device,
                   **pool_options) -> KvPool:
    """``model``'s KV pool in ``kv_cache_dtype`` (``--kv-cache-dtype``: auto = the model dtype); an
    FP8 pool takes its per-layer scales from ``model_dir``'s checkpoint (1.0 where it has none).
    ``pool_options``: ``KvCache``'s model_name, layout, head_start, num_kv_heads (the model class's
    ``make_kv_cache`` builds it)."""
    dtype = pool_dtype(kv_cache_dtype, model.dtype)
    k_scales = v_scales = None
    if is_quantized(dtype):
        k_scales, v_scales = read_kv_scales(model_dir, model.config.num_hidden_layers)
    # The architecture picks its pool: K/V per layer (Llama family) or one latent per layer (DeepSeek MLA).
    return type(model).make_kv_cache(model.config, num_pages, page_size, dtype, device, k_scales=k_scales,
                                     v_scales=v_scales, **pool_options)


def build_slot(model_dir: str, *, model_name: str, device: str, dtype: str | None, page_size: int,
               num_pages: int, kv_layout: str = "page-major", attention_backend: str = "auto",
               cuda_graph_max_bs: int = 0, verify_tokens: int = 0, kv_cache_dtype: str = "auto") -> ModelSlot:
    """A loaded model with its KV pool; on CUDA with the triton backend and ``cuda_graph_max_bs`` > 0,
    decode graphs (and verify graphs of ``verify_tokens`` tokens per sequence, when > 1) are captured
    here (start-up, before the daemon reports READY)."""
    model = load_model(model_dir, dtype=dtype, device=device)
    try:
        model.set_attention_backend(attention_backend)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    kv = build_kv_cache(model, model_dir, kv_cache_dtype, num_pages, page_size, device, model_name=model_name,
                        layout=kv_layout)
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
                 cuda_graph_max_bs: int = 128, disable_cuda_graph: bool = False, tp_size: int = 1,
                 tp_timeout_s: float = 120.0, tp_num_threads: int = 0, tp_agent_prefix: str = "",
                 kv_cache_dtype: str = "auto") -> ModelRunner:
    """Target (and draft) with their KV pools, both in ``kv_layout`` and ``kv_cache_dtype`` (each
    pool with its own checkpoint's FP8 scales); ``draft_device`` defaults to ``device``.
    ``attention_backend`` and the CUDA graph settings apply to both models. ``tp_size``
    > 1 shards the target over that many processes (``build_tp_slot``); call ``runner.close()``.
    ``tp_agent_prefix`` (daemons): each other rank registers its KV pool with a NIXL agent of its own."""
    num_pages = max_total_tokens // page_size
    engine = {"kv_layout": kv_layout, "attention_backend": attention_backend, "kv_cache_dtype": kv_cache_dtype,
              "cuda_graph_max_bs": 0 if disable_cuda_graph else cuda_graph_max_bs}
    if tp_size > 1:
        check_tp_options(tp_size, device=device, cuda_graphs=not disable_cuda_graph and cuda_graph_max_bs > 0)
        spec = TpSpec(target_dir, tp_size, device, dtype, page_size, num_pages, kv_layout, attention_backend,
                      tp_timeout_s, tp_num_threads, tp_agent_prefix, kv_cache_dtype)
        target = build_tp_slot(spec)
    else:
        target = build_slot(target_dir, model_name="target", device=device, dtype=dtype, page_size=page_size,
                            num_pages=num_pages, verify_tokens=spec_k + 1 if draft_dir else 0, **engine)
    draft = None
    if draft_dir:  # at TP > 1 too: the draft is small and runs unsharded on rank 0, beside its shard
        draft_cfg, target_cfg = ModelConfig.from_dir(draft_dir), target.model.config
        if draft_cfg.vocab_size != target_cfg.vocab_size:
            target.close()
            raise ConfigError(f"draft model {draft_dir} has vocab_size {draft_cfg.vocab_size}, target has "
                              f"{target_cfg.vocab_size}; speculative decoding needs one vocabulary")
        if (draft_device or device) == "cpu":  # a DRAM draft beside a CUDA target runs the torch path
            engine["attention_backend"] = "auto"
        draft = build_slot(draft_dir, model_name="draft", device=draft_device or rank_device(device, 0).__str__(),
                           dtype=dtype, page_size=page_size, num_pages=num_pages, **engine)
    return ModelRunner(target, draft, spec_k=spec_k)


def check_tp_options(tp_size: int, *, device: str, cuda_graphs: bool) -> None:
    """Refuse, naming the option, what a TP > 1 engine does not run yet."""
    if cuda_graphs and rank_device(device, 0).type == "cuda":
        raise TpConfigError(f"--tp-size {tp_size} on CUDA runs eagerly (no CUDA graphs yet); pass "
                            "--disable-cuda-graph or use --tp-size 1")


def build_tp_slot(spec: TpSpec) -> ModelSlot:
    """Rank 0's slot of a TP engine: its shard and KV heads, the workers started and loaded."""
    shard = TpShard.of(ModelConfig.from_dir(spec.model_dir), spec.tp_size, 0)  # refuse before starting anything
    group = TpGroup(spec)
    comm = group.start()
    try:
        device = rank_device(spec.device, 0)
        model = load_model(spec.model_dir, dtype=spec.dtype, device=device, tp_size=spec.tp_size, tp_rank=0)
        try:
            model.set_attention_backend(spec.attention_backend)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        model.attach_tp(comm.all_reduce)
        kv = build_kv_cache(model, spec.model_dir, spec.kv_cache_dtype, spec.num_pages, spec.page_size, device,
                            model_name="target", layout=spec.kv_layout, head_start=shard.kv_heads.start,
                            num_kv_heads=shard.kv_heads.count)
        group.wait_loaded()
    except BaseException:
        group.close()
        raise
    return ModelSlot(model, kv, PageAllocator(spec.num_pages), tp=group)
