"""The tiny DeepSeek presets on CUDA: the Triton MLA path, eager and in CUDA graphs, gives the torch
path's tokens, and a graph replay makes no host sync.

float32, greedy: torch eager, triton eager and triton with graphs agree token for token (batches of
1..9, so graph buckets run with padding rows), with a DeepSeek draft too (verify graphs, q = k + 1),
in both latent layouts; a decode and a verify replay's logits equal the eager forward's.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvferry.common.engine.colocated import ColocatedEngine
from kvferry.common.engine.factory import build_runner
from kvferry.common.models.llama import SeqChunk
from kvferry.common.models.tiny import make_tiny_model
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.text.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu

ENGINES = {
    "torch": {"attention_backend": "torch"},
    "triton": {"attention_backend": "triton", "disable_cuda_graph": True},
    "graphs": {"attention_backend": "triton", "cuda_graph_max_bs": 8},
}


@pytest.fixture(scope="module", params=["deepseek-v2-tiny", "deepseek-v3-tiny"])
def checkpoint(request, tmp_path_factory):
    target, draft = make_tiny_model(tmp_path_factory.mktemp(request.param), seed=2, preset=request.param)
    return str(target), str(draft)


def _prompts(num: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 512) for _ in range(rng.choice([1, 3, 16, 17, 40, 300]))] for _ in range(num)]


def _generate(target, draft, kv_layout: str, options: dict, prompts) -> list[list[int]]:
    runner = build_runner(target, draft, device="cuda:0", dtype="float32", max_total_tokens=16384,
                          kv_layout=kv_layout, spec_k=3, **options)
    engine = ColocatedEngine(runner, Tokenizer.from_dir(target), max_running=9)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    return [r.output_ids for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("kv_layout", ["page-major", "layer-major"])
def test_backends_and_graphs_agree(checkpoint, kv_layout):
    target, draft = checkpoint
    prompts = _prompts(9)
    outs = {name: _generate(target, None, kv_layout, opts, prompts) for name, opts in ENGINES.items()}
    assert outs["triton"] == outs["torch"]
    assert outs["graphs"] == outs["torch"]
    assert _generate(target, draft, kv_layout, ENGINES["graphs"], prompts) == outs["torch"]


def _prefilled(runner, seed: int):
    slot = runner.target
    rng = random.Random(seed)
    prompts = _prompts(3, seed=seed)
    tables = [rng.sample(range(slot.kv.num_pages), 30) for _ in prompts]
    slot.model.forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], slot.kv)
    return slot, prompts, tables


def test_graph_replays_equal_eager_forwards(checkpoint):
    target, draft = checkpoint
    runner = build_runner(target, draft, device="cuda:0", dtype="float32", max_total_tokens=4096,
                          cuda_graph_max_bs=4, spec_k=3)
    slot, prompts, tables = _prefilled(runner, 1)
    assert slot.model.attn.name == "triton" and [g.tokens_per_seq for g in slot.graphs] == [1, 4]
    step = [SeqChunk([9], len(p), t) for p, t in zip(prompts, tables)]
    replayed = slot.forward(step).clone()  # 3 sequences in the bucket of 4
    torch.testing.assert_close(replayed, slot.model.forward(step, slot.kv), atol=1e-4, rtol=0)
    verify = [SeqChunk([9, 10, 11, 12], len(p), t) for p, t in zip(prompts, tables)]
    replayed = [r.clone() for r in slot.forward(verify, all_logits=True)]
    for got, want in zip(replayed, slot.model.forward(verify, slot.kv, all_logits=True)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_graph_decode_step_makes_no_host_sync(checkpoint):
    target, _ = checkpoint
    runner = build_runner(target, device="cuda:0", dtype="float32", max_total_tokens=4096, cuda_graph_max_bs=4)
    slot, prompts, tables = _prefilled(runner, 3)
    for step in range(3):
        decode = [SeqChunk([7], len(p) + step, t) for p, t in zip(prompts, tables)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # raises at any synchronizing call
        try:
            logits = slot.forward(decode)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert logits.shape == (len(prompts), slot.model.config.vocab_size)
        assert bool(torch.isfinite(logits).all())
