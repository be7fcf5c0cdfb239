"""Tensor-parallel ranks as threads of one process, for tests of the sharded model alone (no worker
processes): each rank loads its shard (``common/layers/tp_layers.py``) and the KV pool its model
class builds for its KV heads (``make_kv_cache``: a dense pool of them, or DeepSeek's whole latent
pool), and their all_reduce is a barrier and a sum in rank order. The process engine
(``common/engine/tp_group.py``) runs the same model code with gloo or NCCL instead."""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from kvferry.common.models.llama import SeqChunk
from kvferry.common.models.loader import load_model

PAGE_SIZE, NUM_PAGES = 16, 128
PROMPTS = [[7], [(i * 37 + 11) % 500 for i in range(45)], [(i * 13 + 5) % 500 for i in range(300)]]


class BarrierSum:
    """all_reduce of ranks that are threads: every rank gets the same sum, added in rank order
    (on CUDA the sum is queued on the one stream after every rank's part)."""

    def __init__(self, size: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=120)

    def of(self, rank: int):
        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = tensor
            self.barrier.wait()
            total = functools.reduce(torch.add, self.parts)
            self.barrier.wait()
            return tensor.copy_(total)
        return all_reduce


def _ranks(model_dir: str, tp_size: int, device: str, backend: str):
    reduce = BarrierSum(tp_size)
    out = []
    for rank in range(tp_size):
        model = load_model(model_dir, dtype="float32", device=device, tp_size=tp_size, tp_rank=rank)
        model.set_attention_backend(backend)
        if tp_size > 1:
            model.attach_tp(reduce.of(rank))
        heads = model.shard.kv_heads
        kv = type(model).make_kv_cache(model.config, NUM_PAGES, PAGE_SIZE, model.dtype, device,
                                       head_start=heads.start, num_kv_heads=heads.count)
        out.append((model, kv))
    return out


def greedy_in_threads(model_dir: str, tp_size: int, *, device: str = "cpu", backend: str = "torch",
                      num_steps: int = 12) -> list[list[int]]:
    """Greedy tokens of ``PROMPTS`` (one batched prefill, then batched decode steps) at ``tp_size``."""
    ranks = _ranks(model_dir, tp_size, device, backend)
    pages = [list(range(i * 32, (i + 1) * 32)) for i in range(len(PROMPTS))]
    tokens = [list(p) for p in PROMPTS]
    chunks = [SeqChunk(list(p), 0, pg) for p, pg in zip(PROMPTS, pages)]
    with ThreadPoolExecutor(tp_size) as pool:
        for _ in range(num_steps):
            logits = list(pool.map(lambda rank: rank[0].forward(chunks, rank[1]), ranks))[0]
            best = logits.argmax(dim=-1).tolist()
            chunks = [SeqChunk([b], len(t), pg) for b, t, pg in zip(best, tokens, pages)]
            for t, b in zip(tokens, best):
                t.append(b)
    return [t[len(p):] for t, p in zip(tokens, PROMPTS)]


def prefill_logits_in_threads(model_dir: str, tp_size: int, *, device: str = "cpu",
                              backend: str = "torch") -> list[torch.Tensor]:
    """Rank 0's logits of every token of ``PROMPTS`` (one batched prefill) at ``tp_size``."""
    ranks = _ranks(model_dir, tp_size, device, backend)
    chunks = [SeqChunk(list(p), 0, list(range(i * 32, (i + 1) * 32))) for i, p in enumerate(PROMPTS)]
    with ThreadPoolExecutor(tp_size) as pool:
        return list(pool.map(lambda rank: rank[0].forward(chunks, rank[1], all_logits=True), ranks))[0]
