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


def _overlapped_greedy(runner, steps: int = 6) -> list[tuple[str, int, float]]:
    """Overlapped greedy steps over three sequences; from step 3 on, the batch is two of them in
    reverse order (the feed gathers rows from the step before). Returns every (request, token, logprob)."""
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(f"g{i}", [7 + i] * (18 + 5 * i), params) for i in range(3)]
    for s in seqs:
        runner.admit(s)
    out = []
    try:
        runner.prefill(seqs)
        prev, batch = None, seqs
        for step in range(steps):
            if step == 3:
                batch = seqs[::-2]
            launched = runner.launch_decode(batch, prev)
            for s, pairs in zip(prev.seqs if prev else [], prev.result() if prev else []):
                s.output_ids.append(pairs[0][0])
                out.append((s.request_id, *pairs[0]))
            prev = launched
        out.extend((s.request_id, *pairs[0]) for s, pairs in zip(prev.seqs, prev.result()))
    finally:
        for s in seqs:
            runner.release(s)
    return out


def test_greedy_picked_in_the_graph_equals_sampling_its_logits(runner):
    """An all-greedy step picks in the decode graph's greedy head (no sampling op launched by the
    runner): the same tokens and logprobs, bit for bit, as sampling the graph's logits."""
    in_graph = _overlapped_greedy(runner)
    runner.greedy_in_graph = False
    try:
        sampled = _overlapped_greedy(runner)
    finally:
        del runner.greedy_in_graph  # the class default again
    assert len(in_graph) == 15 and in_graph == sampled
