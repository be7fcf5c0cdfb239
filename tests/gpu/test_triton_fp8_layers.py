"""The FP8 decode step's fused launches, each against the launches it replaces, through the model's
layers (eager, per-channel FP8, the Triton backend): o_proj's input quantized by the decode attention,
the gate-up with its silu and quant, the q/k/v with its rope and K/V store, and the split-K parts
added by the next norm. Each takes the place of the other launches in every layer, and the logits
are those of the unfused path bit for bit.

On CPU the kernels run under Triton's interpreter (float16 for bfloat16, which it lacks)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvferry.common.engine.factory import build_runner
from kvferry.common.models.llama import SeqChunk

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda:0"
HALF = torch.float16 if DEVICE == "cpu" else torch.bfloat16


def _fp8_decode_step(tmp_path, monkeypatch, num_seqs: int, seed: int):
    """The tiny model as per-channel FP8 with the Triton backend (eager, no graphs) and a decode step of
    ``num_seqs`` sequences at random positions over random pages: (the runner's target slot, the step's
    chunks). On CPU the kernels run under the interpreter: the slot's backend is swapped for Triton's and
    CPU rows take the GPU's FP8 routes (``fp8.KERNELS_ON_CPU``)."""
    from kvferry.common.layers import fp8
    from kvferry.common.layers.attn_backend import TritonBackend
    from kvferry.common.models.tiny import make_tiny_model

    target, _ = make_tiny_model(tmp_path / "fp8", seed=0, quantize="fp8-channel")
    slot = build_runner(target, device=DEVICE, dtype=str(HALF).removeprefix("torch."), max_total_tokens=4096,
                        disable_cuda_graph=True).target
    if DEVICE == "cpu":
        monkeypatch.setattr(fp8, "KERNELS_ON_CPU", True)
        slot.model.attn = TritonBackend(torch.device("cpu"), slot.model.shard.kv_heads.count)
    assert slot.model.attn.name == "triton"
    rng = random.Random(seed)
    pages = rng.sample(range(slot.kv.num_pages), num_seqs * 4)
    return slot, [SeqChunk([rng.randrange(5, 512)], rng.randrange(1, 4 * slot.kv.page_size), pages[4 * i:4 * i + 4])
                  for i in range(num_seqs)]


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit on the GPU; under the interpreter within one rounding of the tensor's dtype."""
    if DEVICE == "cpu":
        tol = torch.finfo(got.dtype).eps
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))
    else:
        assert torch.equal(got, want)


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

    slot, step = _fp8_decode_step(tmp_path, monkeypatch, 40, seed=5)
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

    slot, step = _fp8_decode_step(tmp_path, monkeypatch, 40, seed=7)
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
    runs ``rope_store``; the logits and the pool's K/V equal the unfused path's bit for bit (within a
    rounding under the interpreter: its dots go to numpy, whose sums depend on the tile's width, and the
    fused kernel's column tiles are half-head pairs)."""
    from kvferry.common.kernels import triton_fused, triton_gemv, triton_qkv

    slot, step = _fp8_decode_step(tmp_path, monkeypatch, 40, seed=11)
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
    for got, want in zip([logits[True], *pools[True]], [logits[False], *pools[False]]):
        _same(got, want)


def test_fp8_split_k_parts_added_in_the_next_norm(tmp_path, monkeypatch):
    """Per-channel FP8, a decode step of 24 sequences with every W8A8 GEMV split in 2 parts: o_proj's and
    down's parts are added by the next add_norm's launch (``sum_in_norm``), so no layer runs ``sum_parts``
    for them; the logits equal those of the separate sum launch bit for bit."""
    from kvferry.common.kernels import triton_gemv

    slot, step = _fp8_decode_step(tmp_path, monkeypatch, 24, seed=5)
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
