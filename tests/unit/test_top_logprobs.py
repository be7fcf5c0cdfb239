"""Top logprobs (common/sampling/top_logprobs.py) against a torch reference: log_softmax, then topk, of the
raw logits. The pure functions on random logits, then whole requests on the tiny checkpoint: the
prefill's first token, plain and speculative decode steps, and prompt positions, each checked
against one full forward over the prompt and the output."""

from __future__ import annotations

import pytest
import torch

from kvferry.common.engine.colocated import ColocatedEngine
from kvferry.common.engine.sequence import Sequence
from kvferry.common.models.llama import SeqChunk
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.text.tokenizer import Tokenizer
from kvferry.common.sampling.top_logprobs import attach, prompt_tops, to_host, top_logprobs, with_tops
from tests.cluster import tiny_model_dirs, tiny_runner

TOL = 1e-4


def reference(logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return ids.tolist(), values.tolist()


def test_rows_that_ask_get_exactly_the_reference():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 4
    nums = [0, 3, 0, 20, 1]
    tops = top_logprobs(logits, nums)
    assert tops.rows == [1, 3, 4] and tops.nums == [3, 20, 1] and tops.ids.shape == (3, 20)
    tokens, logprobs = logits.argmax(-1), torch.log_softmax(logits, -1).max(-1).values
    out = with_tops(tokens, logprobs, tops)
    assert [len(o) for o in out] == [2, 3, 2, 3, 3]  # (token, logprob[, alternatives])
    for row, n in zip(tops.rows, tops.nums):
        ids, values = reference(logits[row:row + 1], n)
        assert [t for t, _ in out[row][2]] == ids[0]
        assert all(abs(a - b) < TOL for (_, a), b in zip(out[row][2], values[0]))
        assert out[row][2][0] == (out[row][0], pytest.approx(out[row][1], abs=TOL))  # argmax is the top one
    assert attach([(t, lp) for t, lp, *_ in out], to_host(tops)) == out
    assert top_logprobs(logits, [0] * 5) is None and with_tops(tokens, logprobs, None) == [o[:2] for o in out]


def test_prompt_tops_and_a_vocabulary_smaller_than_k():
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    got = prompt_tops(logits, 20)  # only 8 tokens exist
    ids, values = reference(logits, 8)
    assert [[t for t, _ in row] for row in got] == ids
    assert prompt_tops(logits, 0) == [[], [], [], []]


@pytest.fixture(scope="module")
def engines():
    tokenizer = Tokenizer.from_dir(tiny_model_dirs()[0])
    return {draft: ColocatedEngine(tiny_runner(draft=draft), tokenizer) for draft in (False, True)}


def full_logits(runner, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: every position's logits from one forward over ``ids``."""
    seq = Sequence("ref", list(ids), SamplingParams(max_new_tokens=1))
    runner.admit(seq, prompt_only=True)
    try:
        with torch.inference_mode():
            return runner.target.model.forward([SeqChunk(ids, 0, seq.pages)], runner.target.kv, all_logits=True)[0]
    finally:
        runner.release(seq)


def assert_tops_match(got: list[tuple[int, float]], logits_row: torch.Tensor, k: int) -> None:
    ids, values = reference(logits_row[None], k)
    assert [t for t, _ in got] == ids[0]
    assert all(abs(a - b) < TOL for (_, a), b in zip(got, values[0])), (got, values[0])


@pytest.mark.parametrize("draft", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_output_and_prompt_top_logprobs_equal_the_reference(engines, draft, temperature):
    engine, k = engines[draft], 5
    prompt = [(11 * i + 7) % 400 + 5 for i in range(40)]
    params = SamplingParams(max_new_tokens=10, temperature=temperature, seed=3, ignore_eos=True)
    result = engine.generate([prompt], params, return_logprob=True, top_logprobs_num=k)[0]
    assert len(result.output_top_logprobs) == len(result.output_ids) == 10
    logits = full_logits(engine.runner, prompt + result.output_ids)
    n = len(prompt)
    for i, alts in enumerate(result.output_top_logprobs):  # output token i is predicted by row n - 1 + i
        assert_tops_match(alts, logits[n - 1 + i], k)
    assert result.input_top_logprobs[0] == [] and len(result.input_top_logprobs) == n
    for j in range(1, n):
        assert_tops_match(result.input_top_logprobs[j], logits[j - 1], k)


def test_no_top_logprobs_unless_asked(engines):
    result = engines[False].generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0.0))[0]
    assert result.output_top_logprobs is None and result.input_top_logprobs is None
