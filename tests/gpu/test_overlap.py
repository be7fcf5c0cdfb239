"""Overlapped decode on CUDA: the batcher's overlapped steps give the tokens of one step at a time
(graphs and eager Triton, float32), no request's pages are freed while a launched step may still
write them, and a launched step fed from the one before makes no host sync."""

from __future__ import annotations

import pytest
import torch

from kvferry.common.engine.factory import build_runner
from kvferry.common.engine.sequence import Sequence
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.text.tokenizer import Tokenizer
from tests.unit import test_batcher

pytestmark = pytest.mark.gpu

ENGINES = {"graphs": {"cuda_graph_max_bs": 8}, "eager": {"disable_cuda_graph": True}}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def runner(request, tiny_models):
    return build_runner(tiny_models[0], device="cuda:0", dtype="float32", max_total_tokens=4096,
                        attention_backend="triton", page_size=16, **ENGINES[request.param])


def test_overlapped_equals_one_step_at_a_time_on_cuda(runner, tiny_models):
    tokenizer = Tokenizer.from_dir(tiny_models[0])
    want, plain = test_batcher._generate(runner, tokenizer, overlap=False)
    got, overlapped = test_batcher._generate(runner, tokenizer, overlap=True, abort_after={"r5": 2})
    for rid in ("r0", "r1", "r2", "r3", "r4"):
        assert got[rid][0] == want[rid][0] and got[rid][2] == want[rid][2], rid
        assert got[rid][1] == pytest.approx(want[rid][1], abs=1e-3), rid
    assert got["r5"][2] == "abort"
    assert overlapped.violations == [] and plain.violations == []


def test_launch_fed_from_the_step_before_makes_no_host_sync(runner):
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(f"s{i}", [5 + i] * (20 + 9 * i), params) for i in range(4)]
    for s in seqs:
        runner.admit(s)
    try:
        runner.prefill(seqs)
        prev = runner.launch_decode(seqs)  # warm-up: allocations, pinned blocks
        torch.cuda.synchronize()
        for _ in range(3):
            torch.cuda.set_sync_debug_mode("error")
            try:
                step = runner.launch_decode(seqs, prev)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            for s, pairs in zip(seqs, prev.result()):  # the step's one sync
                s.output_ids.append(pairs[0][0])
            prev = step
        prev.result()
    finally:
        for s in seqs:
            runner.release(s)
