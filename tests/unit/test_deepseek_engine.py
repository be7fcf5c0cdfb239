"""The colocated engine serves the tiny DeepSeek presets on CPU end to end: greedy output equals
transformers' generate, with and without a DeepSeek draft (speculative decoding)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvferry.common.cache.mla_cache import LatentCache  # noqa: E402
from kvferry.common.engine.colocated import ColocatedEngine  # noqa: E402
from kvferry.common.engine.factory import build_runner  # noqa: E402
from kvferry.common.models.tiny import make_tiny_model  # noqa: E402
from kvferry.common.sampling.sampler import SamplingParams  # noqa: E402
from kvferry.common.text.tokenizer import Tokenizer  # noqa: E402

torch.set_num_threads(1)
PROMPTS = ["The ferry leaves", "Once upon a time there was", "Numbers: one, two"]
MAX_NEW = 9  # prompts of 4-7 tokens on pages of 4: every sequence crosses pages while decoding


@pytest.fixture(scope="module", params=["deepseek-v2-tiny", "deepseek-v3-tiny"])
def checkpoint(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), seed=2, preset=request.param)


@pytest.mark.parametrize("with_draft", [False, True])
def test_engine_greedy_equals_transformers(checkpoint, with_draft):
    target, draft = checkpoint
    runner = build_runner(str(target), str(draft) if with_draft else None, device="cpu", dtype="float32",
                          page_size=4, max_total_tokens=256, spec_k=2)
    assert all(isinstance(slot.kv, LatentCache) for slot in runner.slots)
    tokenizer = Tokenizer.from_dir(target)
    engine = ColocatedEngine(runner, tokenizer)
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for result in results:
        assert 4 <= len(result.prompt_ids) and len(result.output_ids) == MAX_NEW
        with torch.no_grad():
            ref = hf.generate(torch.tensor([result.prompt_ids]), do_sample=False, max_new_tokens=MAX_NEW)
        assert result.output_ids == ref[0, len(result.prompt_ids):].tolist(), result.prompt_ids
    if with_draft:
        assert sum(r.num_proposed for r in results) > 0
    assert runner.target.allocator.num_free == runner.target.allocator.num_pages  # every page back
