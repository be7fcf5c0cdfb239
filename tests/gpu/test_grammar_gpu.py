"""Structured output on CUDA: the grammar mask applied on the device equals the one applied on the
host; the engine (CUDA graphs, plain and speculative) produces schema-valid JSON and full regex
matches, speculating under the grammar with a draft."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvferry.common.engine.colocated import ColocatedEngine
from kvferry.common.engine.factory import build_runner
from kvferry.common.sampling.grammar import GrammarCache, GrammarSpec, mask_logits
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.text.tokenizer import Tokenizer
from tests.json_schema_check import errors
from tests.unit.test_grammar import ANSWER, PERSON, PROMPTS

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return Tokenizer.from_dir(tiny_models[0])


@pytest.fixture(scope="module")
def engines(tiny_models, tokenizer):
    target, draft = tiny_models
    return {d: ColocatedEngine(build_runner(target, draft if d else None, device="cuda", page_size=16,
                                            max_total_tokens=8192), tokenizer) for d in (False, True)}


def test_device_mask_equals_host_mask(tokenizer):
    cache = GrammarCache(tokenizer, tokenizer.vocab_size)
    matchers = [cache.matcher(GrammarSpec("json_schema", json.dumps(PERSON), "f")), None,
                cache.matcher(GrammarSpec("regex", ANSWER, "f"))]
    logits = torch.randn(3, tokenizer.vocab_size, generator=torch.Generator().manual_seed(0))
    on_host = mask_logits(logits.clone(), matchers)
    on_device = mask_logits(logits.cuda(), matchers)
    assert on_device.is_cuda
    torch.testing.assert_close(on_device.cpu(), on_host)


@pytest.mark.parametrize("draft", [False, True])
def test_constrained_generation_on_cuda(engines, draft):
    engine = engines[draft]
    schema = GrammarSpec("json_schema", json.dumps(PERSON), "response_format")
    answer = GrammarSpec("regex", ANSWER, "regex")
    free = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    params = [SamplingParams(max_new_tokens=300, temperature=0, grammar=schema),
              SamplingParams(max_new_tokens=40, temperature=0.7, seed=5, grammar=answer), free]
    results = engine.generate(PROMPTS, params)
    assert errors(json.loads(results[0].text), PERSON) == [], results[0].text
    assert re.fullmatch(ANSWER, results[1].text), results[1].text
    assert all((r.num_proposed > 0) == draft for r in results)  # constrained rows speculate too
