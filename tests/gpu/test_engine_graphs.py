"""The engine on CUDA with the Triton backend and CUDA graphs gives the torch path's tokens.

float32, greedy, the tiny pair: torch eager, triton eager and triton with graphs must agree token
for token (batches of 1..9, so that graph buckets run with padding rows), with and without
speculative decoding, in both KV layouts, and over an FP8 KV pool; FP8 checkpoints give eager's
tokens in graphs; a graph replay's logits equal the eager forward's.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvferry.common.engine.colocated import ColocatedEngine
from kvferry.common.engine.factory import build_runner
from kvferry.common.models.llama import SeqChunk
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.text.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu

ENGINES = {
    "torch": {"attention_backend": "torch"},
    "triton": {"attention_backend": "triton", "disable_cuda_graph": True},
    "graphs": {"attention_backend": "triton", "cuda_graph_max_bs": 8},
}


def _prompts(num: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 512) for _ in range(rng.choice([1, 3, 16, 17, 40, 300]))] for _ in range(num)]


def _generate(target, draft, kv_layout: str, options: dict, prompts) -> list[list[int]]:
    runner = build_runner(target, draft, device="cuda:0", dtype="float32", max_total_tokens=16384,
                          kv_layout=kv_layout, **options)
    engine = ColocatedEngine(runner, Tokenizer.from_dir(target), max_running=9)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    return [r.output_ids for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("kv_layout", ["page-major", "layer-major"])
def test_backends_and_graphs_agree(tiny_models, kv_layout):
    target, draft = tiny_models
    prompts = _prompts(9)
    outs = {name: _generate(target, None, kv_layout, opts, prompts) for name, opts in ENGINES.items()}
    assert outs["triton"] == outs["torch"]
    assert outs["graphs"] == outs["torch"]
    assert _generate(target, draft, kv_layout, ENGINES["graphs"], prompts) == outs["torch"]


def test_fp8_kv_backends_and_graphs_agree(tiny_models):
    """--kv-cache-dtype fp8_e4m3: the Triton stores quantize as torch does and every read (the dense
    prefill of the 300-token prompts included) dequantizes alike, eagerly, in graphs and in verify."""
    target, draft = tiny_models
    prompts = _prompts(9)
    fp8 = {"kv_cache_dtype": "fp8_e4m3"}
    want = _generate(target, None, "page-major", {**ENGINES["torch"], **fp8}, prompts)
    for name in ("triton", "graphs"):
        assert _generate(target, None, "page-major", {**ENGINES[name], **fp8}, prompts) == want, name
    assert _generate(target, draft, "page-major", {**ENGINES["graphs"], **fp8}, prompts) == want


@pytest.mark.parametrize("quantize", ["fp8-channel", "fp8-block"])
def test_fp8_weights_graphs_agree(tmp_path, quantize):
    """FP8 checkpoints: decode steps run the weight-only GEMV (triton_gemv.fp8_gemv, <= 16 rows) and
    prefills the W8A8 GEMMs; graphs (buckets of 1..8 rows, padding included) give eager's tokens."""
    from kvferry.common.models.tiny import make_tiny_model

    target, _ = make_tiny_model(tmp_path / quantize, seed=0, quantize=quantize)
    prompts = _prompts(9)
    want = _generate(target, None, "page-major", ENGINES["triton"], prompts)
    assert _generate(target, None, "page-major", ENGINES["graphs"], prompts) == want
    assert all(len(out) == 10 for out in want)


@pytest.mark.parametrize("num_tokens", [40, 100])
def test_fp8_quant_fused_into_the_norms_and_silu(tmp_path, monkeypatch, num_tokens):
    """bf16, per-channel FP8: past 16 rows the qkv, gate-up and down linears take their input
    quantized by the norm or silu kernel that made it (``fp8.TokenQuantized``), so only o_proj runs
    the separate per-token quant; the logits equal those of the separate quant bit for bit (the same
    e4m3 values, then the same GEMM: the GEMV's FP8 dot at 40 rows, ``_scaled_mm`` at 100)."""
    from kvferry.common.kernels import triton_fp8_gemm
    from kvferry.common.layers import fp8
    from kvferry.common.models.tiny import make_tiny_model

    target, _ = make_tiny_model(tmp_path / "fp8", seed=0, quantize="fp8-channel")
    runner = build_runner(target, device="cuda:0", dtype="bfloat16", max_total_tokens=4096, disable_cuda_graph=True)
    slot = runner.target
    calls = []
    separate = triton_fp8_gemm.per_token_quant
    monkeypatch.setattr(triton_fp8_gemm, "per_token_quant", lambda x: calls.append(x.shape) or separate(x))
    prompt = [random.Random(3).randrange(5, 512) for _ in range(num_tokens)]
    pages = list(range(-(-num_tokens // slot.kv.page_size)))
    logits = {}
    for fused in (True, False):
        monkeypatch.setattr(fp8, "FUSE_TOKEN_QUANT", fused)
        calls.clear()
        logits[fused] = slot.model.forward([SeqChunk(prompt, 0, pages)], slot.kv).clone()
        num_layers = slot.model.config.num_hidden_layers
        assert len(calls) == num_layers * (1 if fused else 4), (fused, calls)
    assert torch.equal(logits[True], logits[False])


def test_graph_replay_equals_eager_forward(tiny_models):
    target, _ = tiny_models
    runner = build_runner(target, device="cuda:0", dtype="float32", max_total_tokens=4096, cuda_graph_max_bs=4)
    slot = runner.target
    assert [g.sizes for g in slot.graphs] == [[1, 2, 4]]
    rng = random.Random(1)
    prompts = _prompts(3, seed=2)
    tables = [rng.sample(range(slot.kv.num_pages), 30) for _ in prompts]
    slot.model.forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], slot.kv)
    step = [SeqChunk([9], len(p), t) for p, t in zip(prompts, tables)]
    replayed = slot.forward(step).clone()  # 3 sequences in the bucket of 4
    eager = slot.model.forward(step, slot.kv)  # rewrites the same K/V rows
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=0)


def test_verify_graph_equals_eager_forward(tiny_models):
    target, draft = tiny_models
    runner = build_runner(target, draft, device="cuda:0", dtype="float32", max_total_tokens=4096,
                          cuda_graph_max_bs=4, spec_k=3)
    slot = runner.target
    assert [g.tokens_per_seq for g in slot.graphs] == [1, 4]
    rng = random.Random(4)
    prompts = _prompts(3, seed=6)
    tables = [rng.sample(range(slot.kv.num_pages), 30) for _ in prompts]
    slot.model.forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], slot.kv)
    step = [SeqChunk([9, 10, 11, 12], len(p), t) for p, t in zip(prompts, tables)]
    replayed = [r.clone() for r in slot.forward(step, all_logits=True)]
    eager = slot.model.forward(step, slot.kv, all_logits=True)
    for got, want in zip(replayed, eager):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
