"""A decode step waits for the GPU once: its sampled tokens. The graph replay (inputs through
pinned staging) and the sampler (greedy, temperature, top-k/p, min-p, seeded rows) run under
``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronizing call."""

from __future__ import annotations

import pytest
import torch

from kvferry.common.engine.factory import build_runner
from kvferry.common.models.llama import SeqChunk
from kvferry.common.sampling.sampler import Sampler, SamplingParams, make_generator

pytestmark = pytest.mark.gpu

PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=20),
          SamplingParams(temperature=1.0, top_p=0.9, seed=3), SamplingParams(temperature=0.8, min_p=0.1, seed=4)]


def _no_sync(fn):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_sampler_makes_no_host_sync():
    logits = torch.randn(len(PARAMS), 512, device="cuda")
    generators = [make_generator(p.seed, "cuda") for p in PARAMS]
    Sampler().sample(logits, PARAMS, generators)  # warm-up: allocations, pinned blocks
    tokens, logprobs = _no_sync(lambda: Sampler().sample(logits, PARAMS, generators))
    assert tokens.shape == logprobs.shape == (len(PARAMS),)


def test_graph_decode_step_makes_no_host_sync(tiny_models):
    target, _ = tiny_models
    slot = build_runner(target, device="cuda:0", dtype="float32", max_total_tokens=4096, cuda_graph_max_bs=8).target
    chunks = [SeqChunk([5 + i] * 20, 0, list(range(10 * i, 10 * i + 10))) for i in range(len(PARAMS))]
    slot.model.forward(chunks, slot.kv)
    generators = [make_generator(p.seed, "cuda") for p in PARAMS]
    for step in range(3):
        decode = [SeqChunk([7], 20 + step, c.page_ids) for c in chunks]
        logits = _no_sync(lambda: slot.forward(decode))
        tokens, _ = _no_sync(lambda: Sampler().sample(logits, PARAMS, generators))
        assert all(0 <= t < 512 for t in tokens.tolist())  # the step's one sync
