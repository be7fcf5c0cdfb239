"""Programmatic dependent launch on the GPU: a decode step's graph replay gives the same logits, bit
for bit, with every Triton kernel launched with PDL (in either order) as without.

PDL changes when a kernel's programs start, never what they compute: each one waits for the kernel
before it (``pdl.enter``) before touching memory. A kernel that read its input early would show
here as logits that differ from the plain launch's. The presets cover the step's kernel families:
the dense Llama path (norms, rope + store, split-K attention, bf16 GEMV at one row), FP8 per
channel past 16 rows (the fused per-token quant, the W8A8 GEMV and its split sums), Qwen3-MoE (the
router, moe_gemv at a few slots, the slot sort and grouped GEMMs past 32) and DeepSeek (the MLA
rows, latent attention, shared experts).
"""

from __future__ import annotations

import random

import pytest
import torch

from kvferry.common.engine.factory import build_runner
from kvferry.common.kernels import pdl
from kvferry.common.models.llama import SeqChunk
from kvferry.common.models.tiny import make_tiny_model

pytestmark = pytest.mark.gpu

CASES = [("tiny", None, [1, 3]), ("tiny", "fp8-channel", [1, 40]), ("tiny-moe", None, [1, 20]),
         ("deepseek-v2-tiny", None, [1, 20])]


def _logits(target: str, batches: list[int]) -> list[torch.Tensor]:
    """Each batch's decode-step logits from a graph replay, after the same prefills, in a fresh
    engine (graphs captured with the current PDL setting)."""
    runner = build_runner(target, device="cuda:0", dtype="bfloat16", max_total_tokens=32768, cuda_graph_max_bs=64)
    slot = runner.target
    assert slot.graphs, "the decode step must run from a CUDA graph"
    rng = random.Random(7)
    out = []
    for batch in batches:
        prompts = [[rng.randrange(5, 512) for _ in range(rng.choice([3, 17, 70]))] for _ in range(batch)]
        pages = rng.sample(range(slot.kv.num_pages), 8 * batch)  # no page shared by two sequences
        tables = [pages[8 * i:8 * (i + 1)] for i in range(batch)]
        slot.model.forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], slot.kv)
        step = [SeqChunk([rng.randrange(5, 512)], len(p), t) for p, t in zip(prompts, tables)]
        out.append(slot.forward(step).clone())
        out.append(slot.forward([SeqChunk([9], len(p) + 1, t) for p, t in zip(prompts, tables)]).clone())
    return out


@pytest.mark.parametrize("preset,quantize,batches", CASES, ids=[f"{p}-{q or 'bf16'}" for p, q, _ in CASES])
def test_pdl_replay_equals_plain_launches(tmp_path, preset, quantize, batches):
    if not pdl.available():
        pytest.skip("PDL needs an sm_90+ GPU and Triton's launch_pdl")
    target, _ = make_tiny_model(tmp_path / preset, seed=3, preset=preset, quantize=quantize)
    try:
        pdl.set_enabled(False)
        plain = _logits(str(target), batches)
        for early in (True, False):  # order 2 (the default: the GEMV's weight prefetch too), then order 1
            assert pdl.set_enabled(True, early=early)
            for i, (got, want) in enumerate(zip(_logits(str(target), batches), plain)):
                assert torch.isfinite(want).all()
                assert torch.equal(got, want), (f"order {pdl.mode()}, step {i}: max diff "
                                                f"{(got.float() - want.float()).abs().max().item()}")
    finally:
        pdl.set_enabled(None)
