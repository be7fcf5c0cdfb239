"""The one-launch greedy picks (``triton_sample.picks``) against torch's argmax and log_softmax, and
``sampler``'s use of them (the decode graph's head and ``Sampler.sample`` agree bit for bit).

Under ``TRITON_INTERPRET=1`` on CPU; on CUDA the same cases. Logprobs within 1e-5 (another summation
order and exp than torch's; values of order 10); tokens exactly, ties to the lowest index as argmax.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu
triton_sample = pytest.importorskip("kvferry.common.kernels.triton_sample")

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def _want(logits: torch.Tensor, token_ids: torch.Tensor | None = None):
    token_ids = logits.argmax(-1) if token_ids is None else token_ids
    return token_ids, torch.log_softmax(logits, -1).gather(-1, token_ids[:, None]).squeeze(-1)


@pytest.mark.parametrize("vocab", [512, 3000, 5000])
def test_picks_equal_argmax_and_log_softmax(vocab):
    """Vocabularies of one block, and of two and three 2,048-wide steps with the last one partial;
    each row's maximum in a different step; given tokens; the float64 pairs."""
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=g) * 4).to(DEVICE)
    for row, at in enumerate([0, vocab - 1, vocab // 2, 2047 % vocab, 2048 % vocab, 17]):
        logits[row, at] = 40.0
    tokens, logprobs = triton_sample.picks(logits)
    want_tokens, want_logprobs = _want(logits)
    assert torch.equal(tokens, want_tokens) and tokens.dtype == torch.int64
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-5)
    given = torch.randint(0, vocab, (6,), generator=g).to(DEVICE)
    same, given_logprobs = triton_sample.picks(logits, given)
    assert same is given
    torch.testing.assert_close(given_logprobs, _want(logits, given)[1], rtol=0, atol=1e-5)
    tokens2, logprobs2, pairs = triton_sample.picks(logits, pairs=True)
    assert torch.equal(tokens2, tokens) and torch.equal(logprobs2, logprobs) and pairs.dtype == torch.float64
    assert torch.equal(pairs, torch.stack([tokens.double(), logprobs.double()], 1))


def test_ties_go_to_the_lowest_index_and_a_strided_batch_reads_its_rows():
    """Equal maxima in one lane (2,048 apart), in two lanes of one step and across steps: the lowest
    index wins, as torch's argmax; rows of a wider buffer (row stride past V)."""
    buffer = torch.zeros(3, 6000, device=DEVICE)
    logits = buffer[:, :5000]
    logits[0, [3000, 952]] = 5.0  # the same lane (952 + 2048), steps 1 and 0
    logits[1, [7, 5]] = 5.0  # two lanes of step 0
    logits[2, [4999, 2100]] = 5.0
    tokens, logprobs = triton_sample.picks(logits)
    assert tokens.tolist() == [952, 5, 2100]
    torch.testing.assert_close(logprobs, _want(logits)[1], rtol=0, atol=1e-5)


def test_picks_refuse_what_they_cannot_read():
    with pytest.raises(ValueError, match=r"picks: fp32 logits \[B, V\] with unit stride, got \(4, 8\) torch.float16"):
        triton_sample.picks(torch.zeros(4, 8, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match=r"picks: token_ids \[4\] int64, got \(4,\) torch.int32"):
        triton_sample.picks(torch.zeros(4, 8, device=DEVICE), torch.zeros(4, dtype=torch.int32, device=DEVICE))


@pytest.mark.skipif(DEVICE == "cpu", reason="the sampler takes the kernel on CUDA only")
def test_sampler_greedy_rows_get_the_same_logprob_in_a_mixed_step():
    """A greedy row's (token, logprob) from an all-greedy step (greedy_picks, greedy_pairs) and from a step
    where another row samples (argmax, then ``_logprobs_of`` of the tokens) are bit for bit the same."""
    from kvferry.common.sampling import sampler

    logits = torch.randn(4, 3000, device=DEVICE) * 3
    tokens, logprobs = sampler.greedy_picks(logits)
    pair_tokens, pairs = sampler.greedy_pairs(logits)
    assert torch.equal(pair_tokens, tokens) and torch.equal(pairs[:, 1], logprobs.double())
    mixed = tokens.clone()
    mixed[1] = (mixed[1] + 1) % 3000  # row 1 sampled something else
    got = sampler._logprobs_of(logits, mixed)
    assert torch.equal(got[[0, 2, 3]], logprobs[[0, 2, 3]])
