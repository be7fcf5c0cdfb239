"""Qwen3-MoE across the pair: the ``tiny-moe`` preset (8 experts, top-2, one dense layer) served by a
real prefill and decode through the real sglang-router equals the colocated engine token for
token, with every page of both daemons back afterwards; at prefill TP 2 -> decode TP 1 too (each
prefill rank holds half of every expert's intermediate dim and writes its KV heads)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvferry.common.daemon.procs import http_json
from kvferry.common.sampling.sampler import SamplingParams
from tests.cluster import Cluster, assert_pages_return, free_pages, ok, post

LENGTHS = [1, 17, 64, 300]
MAX_NEW = 6

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> tuple[str, str]:
    from kvferry.common.models.tiny import make_tiny_model

    target, draft = make_tiny_model(tmp_path_factory.mktemp("tiny-moe"), seed=0, preset="tiny-moe")
    return str(target), str(draft)


def _prompts() -> list[list[int]]:
    rng = random.Random(21)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(moe_model) -> list[list[int]]:
    import torch

    from kvferry.common.engine.colocated import ColocatedEngine
    from kvferry.common.engine.factory import build_runner
    from kvferry.common.text.tokenizer import Tokenizer

    torch.set_num_threads(1)
    target = moe_model[0]
    engine = ColocatedEngine(build_runner(target, page_size=16, max_total_tokens=4096), Tokenizer.from_dir(target))
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [r.output_ids for r in engine.generate(_prompts(), params)]


@pytest.mark.parametrize("prefill_tp", [1, 2], ids=["tp1to1", "tp2to1"])
def test_moe_pair_through_router_equals_colocated(tmp_path, moe_model, reference, prefill_tp):
    cluster = Cluster(tmp_path / "logs", *moe_model)
    try:
        prefill = cluster.prefill(extra=["--tp-size", str(prefill_tp), "--max-total-tokens", "4096"], start=False)
        decode = cluster.decode(extra=["--max-total-tokens", "4096"], start=False)
        for p in (prefill, decode):
            p.start()
        for p in (prefill, decode):
            p.wait_ready(180)
        router = cluster.router([prefill], [decode])
        before = {p.name: free_pages(p) for p in (prefill, decode)}

        def one(ids: list[int]) -> list[int]:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0,
                                                          "ignore_eos": True}}
            return ok(post(router.url + "/generate", body)).json()["output_ids"]

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(one, _prompts())) == reference
        status, info = http_json(prefill.url + "/server_info", timeout_s=10)
        assert (status, info["tp_size"]) == (200, prefill_tp), info
        assert_pages_return([prefill, decode], before)
    finally:
        cluster.stop_all()
