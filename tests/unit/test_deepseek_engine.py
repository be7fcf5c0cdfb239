"""The colocated engine serves the tiny DeepSeek presets on CPU end to end: greedy output equals
transformers' generate, with and without a DeepSeek draft (speculative decoding), and over a
prefix-cache hit (the runner's extend path over cached latent pages)."""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvferry.common.cache.mla_cache import LatentCache  # noqa: E402
from kvferry.common.engine.colocated import ColocatedEngine  # noqa: E402
from kvferry.common.engine.factory import build_runner  # noqa: E402
from kvferry.common.engine.sequence import Sequence  # noqa: E402
from kvferry.common.models.tiny import make_tiny_model  # noqa: E402
from kvferry.common.sampling.sampler import SamplingParams  # noqa: E402
from kvferry.common.text.tokenizer import Tokenizer  # noqa: E402

torch.set_num_threads(1)
PROMPTS = ["The ferry leaves", "Once upon a time there was", "Numbers: one, two"]
MAX_NEW = 9  # prompts of 4-7 tokens on pages of 4: every sequence crosses pages while decoding
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["deepseek-v2-tiny", "deepseek-v3-tiny"])
def checkpoint(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), seed=2, preset=request.param)


@pytest.mark.parametrize("with_draft", [False, True])
def test_engine_greedy_equals_transformers(checkpoint, with_draft):
    target, draft = checkpoint
    runner = build_runner(str(target), str(draft) if with_draft else None, device="cpu", dtype="float32",
                          page_size=4, max_total_tokens=256, spec_k=2)
    assert all(isinstance(slot.kv, LatentCache) for slot in runner.slots)
    results = _generate(runner, target)
    _assert_equals_transformers(target, results)
    if with_draft:
        assert sum(r.num_proposed for r in results) > 0
    assert runner.target.allocator.num_free == runner.target.allocator.num_pages  # every page back


def test_prefix_cache_hit_extends_over_cached_latent_pages(checkpoint):
    """A prompt sharing three pages with a cached one is prefilled from the hit on (the extend
    path over cached latent rows) and decodes what transformers generates from the whole prompt."""
    target, _ = checkpoint
    runner = build_runner(str(target), device="cpu", dtype="float32", page_size=4, max_total_tokens=256)
    runner.enable_prefix_cache()
    rng = random.Random(7)
    shared = [rng.randrange(5, 500) for _ in range(13)]
    first = Sequence("first", shared, PARAMS)
    runner.admit(first)
    runner.prefill([first])
    assert runner.cache_tokens(first) == 3  # whole pages only
    runner.release(first)
    second = Sequence("second", shared[:12] + [rng.randrange(5, 500) for _ in range(5)], PARAMS)
    runner.admit(second, max_hit=second.num_prompt_tokens)
    assert second.cached_tokens == 12 and second.num_cached == 12
    runner.prefill([second])
    while len(second.output_ids) < MAX_NEW:
        second.output_ids.extend(tok for tok, *_ in runner.decode([second])[0])
    hf = _transformers(target)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([second.prompt_ids]), do_sample=False, max_new_tokens=MAX_NEW)
    assert second.output_ids == ref[0, second.num_prompt_tokens:].tolist()


def _generate(runner, target):
    engine = ColocatedEngine(runner, Tokenizer.from_dir(target))
    return engine.generate(PROMPTS, PARAMS)


def _transformers(target):
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # full-length greedy, as ignore_eos asks of ours
    return hf


def _assert_equals_transformers(target, results) -> None:
    hf = _transformers(target)
    for result in results:
        assert 4 <= len(result.prompt_ids) and len(result.output_ids) == MAX_NEW
        with torch.no_grad():
            ref = hf.generate(torch.tensor([result.prompt_ids]), do_sample=False, max_new_tokens=MAX_NEW)
        assert result.output_ids == ref[0, len(result.prompt_ids):].tolist(), result.prompt_ids
