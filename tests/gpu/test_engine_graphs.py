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


def _fp8_decode_step(tmp_path, num_seqs: int, seed: int):
    """The tiny model as per-channel FP8 on the GPU (eager, no graphs) and a decode step of ``num_seqs``
    sequences at random positions over random pages: (the runner's target slot, the step's chunks)."""
    from kvferry.common.models.tiny import make_tiny_model

    target, _ = make_tiny_model(tmp_path / "fp8", seed=0, quantize="fp8-channel")
    slot = build_runner(target, device="cuda:0", dtype="bfloat16", max_total_tokens=4096,
                        disable_cuda_graph=True).target
    rng = random.Random(seed)
    pages = rng.sample(range(slot.kv.num_pages), num_seqs * 4)
    return slot, [SeqChunk([rng.randrange(5, 512)], rng.randrange(1, 4 * slot.kv.page_size), pages[4 * i:4 * i + 4])
                  for i in range(num_seqs)]


def _count_calls(monkeypatch, calls: list, functions) -> None:
    """Each (module, name) in ``functions`` appends its name to ``calls`` when called, then runs."""
    for module, name in functions:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))


def test_fp8_o_proj_input_quantized_by_the_decode_attention(tmp_path, monkeypatch):
    """Per-channel FP8, a decode step of 40 sequences at one split: o_proj takes its input quantized
    per token by the decode attention's own launch (``triton_attention.QUANT_OUT``), so no layer runs
    the separate quant; the logits equal those of the separate quant bit for bit."""
    from kvferry.common.kernels import triton_attention, triton_fp8_gemm

    slot, step = _fp8_decode_step(tmp_path, 40, seed=5)
    monkeypatch.setattr(triton_attention, "num_decode_splits", lambda *args, **kwargs: 1)
    calls = []
    _count_calls(monkeypatch, calls, [(triton_fp8_gemm, "per_token_quant")])
    logits = {}
    for fused in (True, False):
        monkeypatch.setattr(triton_attention, "QUANT_OUT", fused)
        calls.clear()
        logits[fused] = slot.model.forward(step, slot.kv).clone()
        assert len(calls) == (0 if fused else slot.model.config.num_hidden_layers), (fused, calls)
    assert torch.equal(logits[True], logits[False])


def test_fp8_gate_up_with_its_silu_and_quant_in_two_launches(tmp_path, monkeypatch):
    """Per-channel FP8, a decode step of 40 sequences: every layer's gate-up runs with its silu and
    per-token quant (``triton_mlp``; the tiny gate-up would split K, so both sides here run K whole)
    and no layer runs ``silu_mul``; the logits equal the unfused MLP's bit for bit."""
    from kvferry.common.kernels import triton_fused, triton_gemv, triton_mlp

    slot, step = _fp8_decode_step(tmp_path, 40, seed=7)
    rules = triton_gemv.fp8_config
    monkeypatch.setattr(triton_gemv, "fp8_config", lambda *a, **kw: rules(*a, **kw)._replace(split_k=1))
    monkeypatch.setattr(triton_mlp, "takes", lambda rows, width, k: 2 <= rows <= 64)
    calls = []
    _count_calls(monkeypatch, calls, [(triton_mlp, "gate_up_silu_quant"), (triton_fused, "silu_mul")])
    logits = {}
    num_layers = slot.model.config.num_hidden_layers
    for fused in (True, False):
        slot.model.attn.fuse_gate_up = fused
        calls.clear()
        logits[fused] = slot.model.forward(step, slot.kv).clone()
        assert calls == ["gate_up_silu_quant" if fused else "silu_mul"] * num_layers, (fused, calls)
    assert torch.equal(logits[True], logits[False])


def test_fp8_qkv_with_its_rope_and_kv_store_in_one_launch(tmp_path, monkeypatch):
    """Per-channel FP8, a decode step of 40 sequences: every layer's q/k/v projection runs with its rope and
    K/V store (``triton_qkv``; the tiny weight would split K, so both sides here run K whole) and no layer
    runs ``rope_store``; the logits and the pool's K/V equal the unfused path's bit for bit."""
    from kvferry.common.kernels import triton_fused, triton_gemv, triton_qkv

    slot, step = _fp8_decode_step(tmp_path, 40, seed=11)
    rules = triton_gemv.fp8_config
    whole = lambda *a, **kw: rules(*a, **kw)._replace(split_k=1)  # noqa: E731
    for module in (triton_gemv, triton_qkv):
        monkeypatch.setattr(module, "fp8_config", whole)
    calls = []
    _count_calls(monkeypatch, calls, [(triton_qkv, "qkv_rope_store"), (triton_fused, "rope_store")])
    logits, pools = {}, {}
    num_layers = slot.model.config.num_hidden_layers
    for fused in (True, False):
        slot.model.attn.fuse_qkv_rope = fused
        calls.clear()
        logits[fused] = slot.model.forward(step, slot.kv).clone()
        pools[fused] = [t.clone() for t in (*slot.kv.k, *slot.kv.v)]
        assert calls == ["qkv_rope_store" if fused else "rope_store"] * num_layers, (fused, calls)
    assert torch.equal(logits[True], logits[False])
    assert all(torch.equal(a, b) for a, b in zip(pools[True], pools[False]))


def test_fp8_split_k_parts_added_in_the_next_norm(tmp_path, monkeypatch):
    """Per-channel FP8, a decode step of 24 sequences with every W8A8 GEMV split in 2 parts: o_proj's and
    down's parts are added by the next add_norm's launch (``sum_in_norm``), so no layer runs ``sum_parts``
    for them; the logits equal those of the separate sum launch bit for bit."""
    from kvferry.common.kernels import triton_gemv

    slot, step = _fp8_decode_step(tmp_path, 24, seed=5)
    rules = triton_gemv.fp8_config
    # 2 parts of 64 columns: the tiny weights are 128-256 columns deep
    monkeypatch.setattr(triton_gemv, "fp8_config", lambda *a, **kw: rules(*a, **kw)._replace(split_k=2, block_k=64))
    calls = []
    _count_calls(monkeypatch, calls, [(triton_gemv, "sum_parts")])
    logits, launches = {}, {}
    for in_norm in (True, False):
        slot.model.attn.sum_in_norm = in_norm
        calls.clear()
        logits[in_norm] = slot.model.forward(step, slot.kv).clone()
        launches[in_norm] = len(calls)
    num_layers = slot.model.config.num_hidden_layers
    assert launches[False] - launches[True] == 2 * num_layers, launches
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
