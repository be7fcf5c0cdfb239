"""FP8 checkpoints served by the disaggregated pair through the real sglang-router.

The embedded tiny checkpoint (seed 0) written as ``--quantize fp8-channel`` (compressed-tensors,
per-channel scales) and ``fp8-block`` (quant_method fp8, 128 x 128 blocks, ragged k/v blocks):
the pair's greedy output equals a colocated engine's on the same FP8 checkpoint token for token,
with every page back afterwards. Against the unquantized checkpoint the output is only close:
the first greedy token of each prompt (the next-token argmax after the same prompt) agrees on
most prompts; the agreement of whole sequences is recorded (``record_property``), not asserted.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvferry.common.sampling.sampler import SamplingParams
from tests.cluster import Cluster, assert_pages_return, free_pages, ok, post

LENGTHS = [1, 17, 64, 300, 1000]
MAX_NEW = 8
KINDS = ("fp8-channel", "fp8-block")
# Measured with seed 0 on these 32 prompts: 31/32 (channel) and 30/32 (block) first tokens agree
# (whole 16-token sequences: 0.38 and 0.43 of positions, since one flip changes the rest). Scales
# ignored (one constant for every row) give 0/32. This is a coarse check: the tiny model's rows
# have similar scales, so shuffled scales still give 21/32 and 27/32; where each scale lands is
# checked exactly in tests/unit/test_fp8_weights.py.
MIN_FIRST_TOKEN_AGREEMENT = 0.75

pytestmark = pytest.mark.timeout(600)


def _prompts(lengths: list[int], seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in lengths]


def _greedy(max_new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory) -> dict[str, tuple[str, str]]:
    from kvferry.common.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("fp8-models")
    return {kind: tuple(map(str, make_tiny_model(root / kind, seed=0, quantize=kind))) for kind in KINDS}


@pytest.fixture(scope="module")
def fp8_colocated(fp8_models):
    """``fp8_colocated(kind)``: a colocated engine over that FP8 checkpoint, built once."""
    from kvferry.common.engine.colocated import ColocatedEngine
    from kvferry.common.engine.factory import build_runner
    from kvferry.common.text.tokenizer import Tokenizer

    torch.set_num_threads(1)
    cache = {}

    def get(kind: str) -> ColocatedEngine:
        if kind not in cache:
            target = fp8_models[kind][0]
            runner = build_runner(target, page_size=16, max_total_tokens=16384)
            cache[kind] = ColocatedEngine(runner, Tokenizer.from_dir(target))
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", KINDS)
def test_pair_through_router_equals_colocated(tmp_path, fp8_models, fp8_colocated, kind):
    prompts = _prompts(LENGTHS)
    want = [r.output_ids for r in fp8_colocated(kind).generate(prompts, _greedy(MAX_NEW))]
    cluster = Cluster(tmp_path / "logs", *fp8_models[kind])
    try:
        prefill, decode, before = cluster.pair()
        router = cluster.router([prefill], [decode])

        def one(ids: list[int]) -> list[int]:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0,
                                                          "ignore_eos": True}}
            return ok(post(router.url + "/generate", body)).json()["output_ids"]

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(one, prompts)) == want
        assert_pages_return([prefill, decode], before)
    finally:
        cluster.stop_all()


@pytest.mark.parametrize("kind", KINDS)
def test_output_stays_close_to_the_unquantized_model(fp8_colocated, colocated, kind, record_property):
    prompts = _prompts([5 + 9 * i for i in range(32)], seed=11)
    first = [r.output_ids for r in fp8_colocated(kind).generate(prompts, _greedy(1))]
    first_plain = [r.output_ids for r in colocated(False).generate(prompts, _greedy(1))]
    first_agreement = sum(a == b for a, b in zip(first, first_plain)) / len(prompts)
    whole = [r.output_ids for r in fp8_colocated(kind).generate(prompts[:8], _greedy(16))]
    whole_plain = [r.output_ids for r in colocated(False).generate(prompts[:8], _greedy(16))]
    same_tokens = sum(a == b for x, y in zip(whole, whole_plain) for a, b in zip(x, y)) / (8 * 16)
    record_property("first_token_agreement", first_agreement)
    record_property("greedy_position_agreement_16_tokens", same_tokens)
    assert first_agreement >= MIN_FIRST_TOKEN_AGREEMENT, (first_agreement, same_tokens)
