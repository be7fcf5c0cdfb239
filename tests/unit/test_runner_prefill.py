"""ModelRunner.prefill on the tiny checkpoint: prompt logprobs for exactly the asked range, and the
target and draft pools handing out the same page ids."""

from __future__ import annotations

import math

import pytest
import torch

from common.engine.factory import build_runner
from common.engine.sequence import Sequence
from common.model.sampling import SamplingParams
from tests.cluster import tiny_model_dirs

PROMPT = [(7 * i + 3) % 400 + 5 for i in range(70)]


@pytest.fixture(scope="module")
def runner():
    torch.set_num_threads(1)
    target, draft = tiny_model_dirs()
    return build_runner(target, draft, page_size=16, max_total_tokens=4096)


def _prefill(runner, start: int | None) -> Sequence:
    seq = Sequence(f"req-{start}", list(PROMPT), SamplingParams(max_new_tokens=1, temperature=0.0))
    if start is not None:
        seq.input_logprobs, seq.logprob_start_len = [], start
    runner.admit(seq, prompt_only=True)
    try:
        runner.prefill([seq])
    finally:
        runner.release(seq)
    return seq


@pytest.mark.parametrize("start", [1, 17, 50, 69])
def test_prompt_logprobs_for_the_asked_range_equal_the_full_ones(runner, start):
    full = _prefill(runner, 0)
    part = _prefill(runner, start)
    assert part.input_logprobs[:start] == [None] * start and len(part.input_logprobs) == len(PROMPT)
    for a, b in zip(part.input_logprobs[start:], full.input_logprobs[start:]):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4), (a, b)
    assert part.output_ids == full.output_ids  # the first token does not depend on the extra pass
    assert math.isclose(part.output_logprobs[0], full.output_logprobs[0], rel_tol=1e-4, abs_tol=1e-4)


def test_no_prompt_logprobs_when_none_are_asked(runner):
    seq = _prefill(runner, len(PROMPT))  # start past the prompt: OpenAI routes without echo
    assert seq.input_logprobs == [] and seq.output_ids == _prefill(runner, None).output_ids


def test_target_and_draft_pools_hand_out_the_same_pages(runner):
    seq = Sequence("a", list(PROMPT), SamplingParams(max_new_tokens=4))
    runner.admit(seq)
    assert seq.draft_pages == seq.pages
    runner.release(seq)
    stray = runner.draft.allocator.allocate(1)  # a draft page taken outside admit: the pools drift
    try:
        free_before = runner.target.allocator.num_free
        with pytest.raises(RuntimeError, match="drifted apart"):
            runner.admit(Sequence("b", list(PROMPT), SamplingParams(max_new_tokens=4)))
        assert runner.target.allocator.num_free == free_before  # nothing kept on the refusal
    finally:
        runner.draft.allocator.free(stray)
