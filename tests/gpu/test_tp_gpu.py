"""The tensor-parallel model (``common/model/tp_layers.py``) on CUDA with the Triton kernels: the
TP 2 and TP 4 shards of the tiny checkpoints, each with a KV pool of its own KV heads, give TP 1's
greedy tokens (float32, eager). The ranks run as threads of one process on one GPU, their
all_reduce a barrier and a sum in rank order: NCCL needs one GPU per rank, so the process path
(``tests/unit/test_tp_engine.py`` on CPU) waits for a multi-GPU machine on CUDA."""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.model.kv_cache import KvCache
from common.model.llama import SeqChunk
from common.model.loader import load_model
from common.model.tiny import make_tiny_model

pytestmark = pytest.mark.gpu

PAGE_SIZE, NUM_PAGES, NUM_STEPS = 16, 128, 12
PROMPTS = [[7], [(i * 37 + 11) % 500 for i in range(45)], [(i * 13 + 5) % 500 for i in range(300)]]


class BarrierSum:
    """all_reduce of ranks that are threads: every rank gets the same sum, added in rank order."""

    def __init__(self, size: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=120)

    def of(self, rank: int):
        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = tensor
            self.barrier.wait()
            total = functools.reduce(torch.add, self.parts)  # queued on the one stream after every part
            self.barrier.wait()
            return tensor.copy_(total)
        return all_reduce


def _ranks(model_dir: str, tp_size: int):
    reduce = BarrierSum(tp_size)
    out = []
    for rank in range(tp_size):
        model = load_model(model_dir, dtype="float32", device="cuda:0", tp_size=tp_size, tp_rank=rank)
        model.set_attention_backend("triton")
        if tp_size > 1:
            model.attach_tp(reduce.of(rank))
        heads = model.shard.kv_heads
        kv = KvCache(model.config, NUM_PAGES, PAGE_SIZE, model.dtype, "cuda:0", head_start=heads.start,
                     num_kv_heads=heads.count)
        out.append((model, kv))
    return out


def _greedy(model_dir: str, tp_size: int) -> list[list[int]]:
    ranks = _ranks(model_dir, tp_size)
    pages = [list(range(i * 32, (i + 1) * 32)) for i in range(len(PROMPTS))]
    tokens = [list(p) for p in PROMPTS]
    chunks = [SeqChunk(list(p), 0, pg) for p, pg in zip(PROMPTS, pages)]
    with ThreadPoolExecutor(tp_size) as pool:
        for _ in range(NUM_STEPS):
            logits = list(pool.map(lambda mk: mk[0].forward(chunks, mk[1]), ranks))[0]
            best = logits.argmax(dim=-1).tolist()
            chunks = [SeqChunk([b], len(t), pg) for b, t, pg in zip(best, tokens, pages)]
            for t, b in zip(tokens, best):
                t.append(b)
    return [t[len(p):] for t, p in zip(tokens, PROMPTS)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_models) -> dict[str, str]:
    kv8, _ = make_tiny_model(tmp_path_factory.mktemp("kv8"), seed=1, preset="tiny-kv8")
    return {"tiny": tiny_models[0], "kv8": str(kv8)}


@pytest.mark.parametrize("name", ["tiny", "kv8"])
def test_tp_shards_on_cuda_equal_tp1(model_dirs, name):
    reference = _greedy(model_dirs[name], 1)
    for tp_size in (2, 4):
        assert _greedy(model_dirs[name], tp_size) == reference, f"tp_size={tp_size}"
