"""Qwen3-MoE across the pair: the ``tiny-moe`` preset (8 experts, top-2, one dense layer; 4 attention
heads, 2 KV heads) served by a real prefill and decode equals the colocated engine token for token,
with every page of both daemons back afterwards.

Through the real sglang-router, every (prefill TP, decode TP) pair of (1,1), (2,1), (1,2), (2,4)
(each rank holds its block of every expert's intermediate dim; at TP 4 each KV head sits on two
ranks and the lowest writes it), the page-size pairs (16,16), (16,64), (64,16), and a decode-only
draft: the default tiny Llama's two-layer draft (same tokenizer, vocabulary 512, but its own KV
geometry) runs on the decode, whose draft regions the prefill ignores by key. One pair at TP 1 with
the prefix cache on both sides serves a second turn that hits both caches and equals a cold run,
and answers through the real vllm-router too.
"""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvferry.common.daemon.procs import http_json
from kvferry.common.sampling.sampler import SamplingParams
from tests.cluster import Cluster, assert_pages_return, free_pages, ok, post

LENGTHS = [1, 17, 64, 300]
MAX_NEW = 6
SAMPLING = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
PREFIX_CACHE_ON = {"KVFERRY_DISABLE_PREFIX_CACHE": "false"}
# what the prefill logs when a decode registers (prefill_worker/registrar.py)
REGISTERED = re.compile(r"registered decode_id=\S+ peer=\S+: (\d+) regions written, (\d+) ignored, "
                        r"decode_only_spec_dec=(\w+)")

pytestmark = pytest.mark.timeout(600)

# (prefill TP, decode TP, prefill page size, decode page size, decode-only draft)
CASES = [
    (1, 1, 16, 16, False),
    (2, 1, 16, 16, False),
    (1, 2, 16, 64, True),
    (2, 4, 64, 16, False),
]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory, tiny_models) -> tuple[str, str]:
    """(the tiny-moe target, the default tiny Llama's draft): both vocabularies are the tiny tokenizer's."""
    from kvferry.common.models.tiny import make_tiny_model

    target, _ = make_tiny_model(tmp_path_factory.mktemp("tiny-moe"), seed=0, preset="tiny-moe")
    return str(target), tiny_models[1]


def _prompts() -> list[list[int]]:
    rng = random.Random(21)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def engine(moe_model):
    """The colocated engine over the MoE target at TP 1, no prefix cache, no draft."""
    import torch

    from kvferry.common.engine.colocated import ColocatedEngine
    from kvferry.common.engine.factory import build_runner
    from kvferry.common.text.tokenizer import Tokenizer

    torch.set_num_threads(1)
    target = moe_model[0]
    return ColocatedEngine(build_runner(target, page_size=16, max_total_tokens=4096), Tokenizer.from_dir(target))


def _greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [r.output_ids for r in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def reference(engine) -> list[list[int]]:
    return _greedy(engine, _prompts())


def _generate(url: str, ids: list[int]) -> dict:
    return ok(post(url + "/generate", {"input_ids": ids, "sampling_params": SAMPLING})).json()


def _flags(tp: int, page_size: int) -> list[str]:
    return ["--tp-size", str(tp), "--page-size", str(page_size), "--max-total-tokens", "4096"]


@pytest.mark.parametrize("prefill_tp,decode_tp,prefill_page,decode_page,draft", CASES,
                         ids=[f"tp{a}to{b}-pages{p}to{q}" + ("-draft" if d else "") for a, b, p, q, d in CASES])
def test_moe_pair_through_router_equals_colocated(tmp_path, moe_model, reference, prefill_tp, decode_tp,
                                                  prefill_page, decode_page, draft):
    cluster = Cluster(tmp_path / "logs", *moe_model)
    try:
        prefill = cluster.prefill(extra=_flags(prefill_tp, prefill_page), start=False)
        decode = cluster.decode(draft=draft, extra=_flags(decode_tp, decode_page), start=False)
        for p in (prefill, decode):
            p.start()
        for p in (prefill, decode):
            p.wait_ready(180)
        router = cluster.router([prefill], [decode])
        before = {p.name: free_pages(p) for p in (prefill, decode)}

        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda ids: _generate(router.url, ids), _prompts()))
        assert [o["output_ids"] for o in outs] == reference
        # the draft proposed tokens on the decode (the one-token prompt's sequence too: MAX_NEW > 1)
        assert all(("spec_num_proposed" in o["meta_info"]) == draft for o in outs), [o["meta_info"] for o in outs]
        # the prefill wrote the target's regions and ignored the draft's (by key) at each registration
        registrations = REGISTERED.findall(prefill.log_path.read_text(errors="replace"))
        assert registrations and all((int(num_ignored) > 0, spec_dec) == (draft, str(draft))
                                     for _, num_ignored, spec_dec in registrations), registrations
        for proc, tp in ((prefill, prefill_tp), (decode, decode_tp)):
            status, info = http_json(proc.url + "/server_info", timeout_s=10)
            assert (status, info["tp_size"], len(info["tp_ranks"])) == (200, tp, tp), info
        assert_pages_return([prefill, decode], before)
    finally:
        cluster.stop_all()


@pytest.fixture(scope="module")
def cached_pair(tmp_path_factory, moe_model):
    """(prefill, decode, sglang-router, vllm-router, free pages of both at the start): TP 1, 16-token
    pages, the prefix cache on both sides, both routers in front of the same pair."""
    cluster = Cluster(tmp_path_factory.mktemp("moe-prefix") / "logs", *moe_model)
    try:
        extra = ["--max-total-tokens", "4096"]
        prefill = cluster.prefill(env=PREFIX_CACHE_ON, extra=extra, start=False)
        decode = cluster.decode(env=PREFIX_CACHE_ON, extra=extra, start=False)
        for p in (prefill, decode):
            p.start()
        for p in (prefill, decode):
            p.wait_ready(180)
        before = {p.name: free_pages(p) for p in (prefill, decode)}
        yield prefill, decode, cluster.router([prefill], [decode]), cluster.vllm_router([prefill], [decode]), before
    finally:
        cluster.stop_all()


def _flush_and_check_pages(prefill, decode, before: dict) -> None:
    """Empty both prefix caches, then every page of both pools is free again."""
    for proc in (prefill, decode):
        assert ok(post(proc.url + "/flush_cache", {})).json()["message"] == "Cache flushed."
    assert_pages_return([prefill, decode], before)


def test_moe_second_turn_hits_both_caches_and_equals_a_cold_run(cached_pair, engine):
    prefill, decode, router, _, before = cached_pair
    first_prompt = _prompts()[-1]
    first = _generate(router.url, first_prompt)
    assert first["meta_info"]["cached_tokens_prefill"] == 0
    second_prompt = first_prompt + first["output_ids"] + [7 + i for i in range(20)]
    second = _generate(router.url, second_prompt)
    assert [first["output_ids"], second["output_ids"]] == _greedy(engine, [first_prompt, second_prompt])
    meta = second["meta_info"]
    page_size = 16
    # the prefill skipped the first turn's prompt pages; the decode held them and sent for the rest
    assert meta["cached_tokens_prefill"] >= len(first_prompt) // page_size * page_size, meta
    assert meta["cached_tokens_decode"] > 0 and meta["cached_tokens_decode"] % page_size == 0, meta
    assert meta["local_prefill"] is False, meta
    _flush_and_check_pages(prefill, decode, before)


def test_moe_pair_through_vllm_router_equals_colocated(cached_pair, reference):
    prefill, decode, _, vllm_router, before = cached_pair
    outs = [_generate(vllm_router.url, ids) for ids in _prompts()]
    assert [o["output_ids"] for o in outs] == reference
    host_port = lambda p: p.url.removeprefix("http://")  # noqa: E731
    # vllm-router names the request after the pair it picked: it took the two-stage path
    pair_id = f"___prefill_addr_{host_port(prefill)}___decode_addr_{host_port(decode)}_"
    assert all(pair_id in o["meta_info"]["id"] for o in outs), [o["meta_info"]["id"] for o in outs]
    _flush_and_check_pages(prefill, decode, before)
