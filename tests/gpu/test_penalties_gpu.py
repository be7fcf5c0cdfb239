"""Penalties, logit bias and min_tokens on CUDA: a step's adjustments (history rows included) and
the sampler make no host sync; the adjusted logits equal the plain reference of
tests/unit/test_penalties.py; the engine, with CUDA graphs, plain, speculative and overlapped,
gives the reference decode loop's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from kvferry.common.engine.colocated import ColocatedEngine
from kvferry.common.engine.factory import build_runner
from kvferry.common.engine.penalty_inputs import decode_adjust
from kvferry.common.sampling.penalties import TokenHistory
from kvferry.common.sampling.sampler import Sampler, SamplingParams, make_generator
from kvferry.common.text.tokenizer import Tokenizer
from tests.gpu.test_host_syncs import _no_sync
from tests.unit.test_penalties import ENGINE_PARAMS, EOS, PROMPTS, VOCAB, _case, _sequences, reference, reference_greedy

pytestmark = pytest.mark.gpu


def test_adjusted_sampling_makes_no_host_sync():
    logits, rows = _case(3)
    logits = logits.cuda()
    rows = [(SamplingParams(**{**{f: getattr(p, f) for f in p.__dataclass_fields__},
                               "temperature": 0.0 if i % 2 else 0.8, "seed": i}), prompt, output)
            for i, (p, prompt, output) in enumerate(rows)]
    history = TokenHistory(VOCAB, "cuda", EOS)
    warm = _sequences(rows)
    generators = [make_generator(p.seed, "cuda") for p, _, _ in rows]
    Sampler().sample(logits, [p for p, _, _ in rows], generators, decode_adjust(warm, history))  # warm-up
    seqs = _sequences(rows)  # new sequences: their history rows are filled under the check too

    def step():
        return Sampler().sample(logits, [p for p, _, _ in rows], generators, decode_adjust(seqs, history))
    tokens, _ = _no_sync(step)
    assert tokens.shape == (len(rows),)


@pytest.mark.parametrize("seed", range(3))
def test_cuda_adjustments_equal_the_reference(seed):
    logits, rows = _case(seed)
    adjust = decode_adjust(_sequences(rows), TokenHistory(VOCAB, "cuda", EOS))
    got = adjust.apply(logits.cuda()).cpu()
    for i, (params, prompt, output) in enumerate(rows):
        want = torch.tensor(reference(logits[i].tolist(), prompt, output, params))
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return Tokenizer.from_dir(tiny_models[0])


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "speculative"])
def test_graph_engine_equals_the_reference_loop(tiny_models, tokenizer, draft):
    target, draft_dir = tiny_models
    runner = build_runner(target, draft_dir if draft else None, device="cuda:0", dtype="float32",
                          max_total_tokens=8192, cuda_graph_max_bs=8)
    engine = ColocatedEngine(runner, tokenizer)
    got = engine.generate(PROMPTS, ENGINE_PARAMS)
    for prompt, params, result in zip(PROMPTS, ENGINE_PARAMS, got):
        assert result.output_ids == reference_greedy(runner, prompt, params, tokenizer.eos_token_ids), params


def test_overlapped_equals_one_step_at_a_time(tiny_models, tokenizer):
    from tests.unit.test_batcher import _generate

    runner = build_runner(tiny_models[0], device="cuda:0", dtype="float32", max_total_tokens=8192, cuda_graph_max_bs=8)
    params = [SamplingParams(**{**{f: getattr(p, f) for f in p.__dataclass_fields__}, "max_new_tokens": 9 + i})
              for i, p in enumerate(ENGINE_PARAMS)]
    params.append(SamplingParams(max_new_tokens=8, temperature=0.9, seed=5, frequency_penalty=2.0,
                                 logit_bias=((17, 3.0),)))
    want, _ = _generate(runner, tokenizer, overlap=False, params=params)
    got, _ = _generate(runner, tokenizer, overlap=True, params=params)
    assert {rid: ids for rid, (ids, _, _) in got.items()} == {rid: ids for rid, (ids, _, _) in want.items()}
