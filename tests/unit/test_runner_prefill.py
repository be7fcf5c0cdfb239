"""ModelRunner.prefill on the tiny checkpoint: prompt logprobs for exactly the asked range, and the
target and draft pools handing out the same page ids."""

from __future__ import annotations

import math

import pytest
import torch

from kvferry.common.engine.sequence import Sequence
from kvferry.common.sampling.sampler import SamplingParams
from tests.cluster import tiny_model_dirs, tiny_runner

PROMPT = [(7 * i + 3) % 400 + 5 for i in range(70)]


@pytest.fixture(scope="module")
def runner():
    return tiny_runner(draft=True)


@pytest.fixture(scope="module")
def reference_logprobs() -> list[float | None]:
    """Each prompt token's logprob given its prefix, independently of kvferry: transformers' logits
    of the tiny target, then log_softmax."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dirs()[0], dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    return [None] + [float(logprobs[j - 1, PROMPT[j]]) for j in range(1, len(PROMPT))]


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
def test_prompt_logprobs_for_the_asked_range_equal_the_full_ones(runner, reference_logprobs, start):
    """The asked range equals the whole prompt's, and both equal transformers' log_softmax. Fails if
    ``runner._input_logprobs`` drops its normalisation (``logsumexp`` times 0: raw logits)."""
    full = _prefill(runner, 0)
    part = _prefill(runner, start)
    assert part.input_logprobs[:start] == [None] * start and len(part.input_logprobs) == len(PROMPT)
    for a, b, ref in zip(part.input_logprobs[start:], full.input_logprobs[start:], reference_logprobs[start:]):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4), (a, b)
        assert math.isclose(a, ref, rel_tol=1e-4, abs_tol=1e-4), (a, ref)
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


def _pool_pages(runner, seq) -> torch.Tensor:
    """[k|v, layer, token, heads, dim] of ``seq``'s prompt tokens in the target pool."""
    kv = runner.target.kv
    pages = torch.stack([torch.stack([torch.stack([side[layer][p] for p in seq.pages]) for layer in range(len(side))])
                         for side in (kv.k, kv.v)])  # [2, L, pages, page_size, H, D]
    return pages.flatten(2, 3)[:, :, :seq.num_prompt_tokens]


@pytest.mark.parametrize("chunk", [1, 16, 23, 64])
def test_chunked_prefill_fills_the_same_kv_and_first_token(runner, chunk):
    whole = Sequence("whole", list(PROMPT), SamplingParams(max_new_tokens=1, temperature=0.0))
    runner.admit(whole, prompt_only=True)
    try:
        runner.prefill([whole])
        want_kv = _pool_pages(runner, whole).clone()
    finally:
        runner.release(whole)
    seq = Sequence("chunked", list(PROMPT), SamplingParams(max_new_tokens=1, temperature=0.0))
    runner.admit(seq, prompt_only=True)
    kv = runner.target.kv
    for side in (kv.k, kv.v):  # whatever an earlier prefill left in these pages is gone
        for layer in range(len(side)):
            side[layer][seq.pages] = 0
    try:
        while seq.num_cached < seq.num_prompt_tokens:
            assert seq.output_ids == []  # no token before the last chunk
            runner.prefill([seq], ends=[min(seq.num_cached + chunk, seq.num_prompt_tokens)])
        assert seq.output_ids == whole.output_ids
        assert math.isclose(seq.output_logprobs[0], whole.output_logprobs[0], rel_tol=1e-4, abs_tol=1e-4)
        torch.testing.assert_close(_pool_pages(runner, seq), want_kv, rtol=1e-4, atol=1e-4)
    finally:
        runner.release(seq)
