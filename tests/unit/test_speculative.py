"""Speculative decoding: greedy output equals plain greedy exactly; the sampled accept/reject rule
keeps the target distribution (statistical test on a small vocabulary, fixed seed)."""

from __future__ import annotations

import random

import pytest
import torch

from kvferry.common.engine.colocated import ColocatedEngine
from kvferry.common.engine.factory import build_runner
from kvferry.common.engine.spec import verify_greedy, verify_sampled
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.text.tokenizer import Tokenizer
from tests.cluster import tiny_model_dirs


@pytest.fixture(scope="module")
def engines():
    torch.set_num_threads(1)
    target, draft = tiny_model_dirs()
    tok = Tokenizer.from_dir(target)
    plain = ColocatedEngine(build_runner(target, None, max_total_tokens=65536), tok)
    spec = ColocatedEngine(build_runner(target, draft, max_total_tokens=65536, spec_k=4), tok)
    return plain, spec


def test_greedy_speculative_equals_plain_on_50_prompts(engines):
    plain, spec = engines
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 512) for _ in range(rng.randrange(1, 200))] for _ in range(50)]
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    a = plain.generate(prompts, params)
    b = spec.generate(prompts, params)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    proposed = sum(r.num_proposed for r in b)
    accepted = sum(r.num_accepted for r in b)
    assert proposed > 0 and 0.3 < accepted / proposed <= 1.0  # the tiny draft agrees most of the time


def test_greedy_speculative_respects_stops(engines):
    """A stop inside an accepted run ends the output at the same token as plain decoding."""
    plain, spec = engines
    prompts = ["Once upon a time", "The quick brown fox", "In the morning"]
    params = SamplingParams(max_new_tokens=30, temperature=0.0, stop=("e",))
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    assert [(r.output_ids, r.text, r.finish_reason) for r in a] == [(r.output_ids, r.text, r.finish_reason) for r in b]


def test_speculative_pages_return(engines):
    _, spec = engines
    before = spec.runner.target.allocator.num_free, spec.runner.draft.allocator.num_free
    spec.generate(["a b c"] * 5, SamplingParams(max_new_tokens=9, temperature=0.8, seed=3))
    assert (spec.runner.target.allocator.num_free, spec.runner.draft.allocator.num_free) == before


def test_verify_greedy_rule():
    logits = torch.tensor([[0.0, 5, 0], [3, 0, 0], [0, 0, 9]])
    assert verify_greedy(logits, [1, 0]).tokens([1, 0]) == [1, 0, 2]
    assert verify_greedy(logits, [1, 2]).tokens([1, 2]) == [1, 0]
    assert verify_greedy(logits, [0, 0]).tokens([0, 0]) == [1]


def _chi_square_ok(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    n = counts.sum()
    expected = p * n
    mask = expected > 0
    chi2 = float((((counts - expected) ** 2)[mask] / expected[mask]).sum())
    tv = float(0.5 * (counts / n - p).abs().sum())
    return chi2, tv


def test_sampled_rule_preserves_target_distribution():
    """6-token vocabulary, k=2, 40,000 rounds: the emitted first and second tokens follow the
    target's p[0] and p[1] (positions are independent in this synthetic model). Tolerance: total
    variation < 0.015 and chi-square below the 0.999 quantile for 5 degrees of freedom (20.5)."""
    g = torch.Generator().manual_seed(1234)
    p = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
                      [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
                      [1 / 6] * 6])
    q = torch.tensor([[0.10, 0.10, 0.40, 0.10, 0.10, 0.20],
                      [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(40_000):
        d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        tokens = verify_sampled(p, q, d, g).tokens(d)
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    for counts, target in ((first, p[0]), (second, p[1])):
        chi2, tv = _chi_square_ok(counts, target)
        assert tv < 0.015, (counts, target)
        assert chi2 < 20.5, (chi2, counts)
    assert first[5] == 0  # a token the target forbids is never emitted
