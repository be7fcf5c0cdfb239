"""Tensor parallelism across the pair, through the real sglang-router: a prefill at TP A feeds a
decode at TP B, with page sizes that may differ.

Each daemon runs its ranks as processes (gloo on CPU); every rank owns its KV heads and its NIXL
agent; the decode registers once per rank, and each prefill rank WRITEs the heads it holds into
each decode rank that holds them, cut at both sides' page boundaries. Greedy output must equal the
TP-1 colocated engine token for token, on prompts of 1 to 2,000 tokens, with every page of both
daemons back afterwards.

Models: the embedded tiny checkpoint as ``make up`` uses it (4 attention heads, 2 KV heads: TP 4
replicates each KV head on two ranks, and the lowest rank holding a head writes it) and
``tiny-kv8`` (8 KV heads, split in blocks). The cases cover every (prefill TP, decode TP) pair of
(1,1), (1,2), (2,1), (2,2), (2,4), (4,2), (1,4), every page-size pair of (16,16), (16,64), (64,16),
and a decode-only draft (the draft runs unsharded on decode rank 0) on three of them. (2,2) is the
one case of equal TP sizes above 1 (tests/faults/test_tp_faults.py's 2 -> 2 pair compares with its
own output before the fault, not with TP 1).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.daemon.procs import http_json
from tests.cluster import Cluster, assert_pages_return, free_pages, ok, post

LENGTHS = [1, 17, 64, 300, 2000]
MAX_NEW = 6

pytestmark = pytest.mark.timeout(600)

# (model, prefill TP, decode TP, prefill page size, decode page size, decode-only draft)
CASES = [
    ("tiny", 1, 1, 16, 64, False),
    ("tiny", 1, 2, 16, 16, True),
    ("tiny", 2, 1, 64, 16, False),
    ("tiny", 2, 2, 16, 16, False),
    ("tiny", 2, 4, 16, 64, True),
    ("kv8", 4, 2, 64, 16, False),
    ("kv8", 1, 4, 16, 16, True),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_models) -> dict[str, tuple[str, str]]:
    from kvferry.common.models.tiny import make_tiny_model

    target, draft = make_tiny_model(tmp_path_factory.mktemp("kv8"), seed=1, preset="tiny-kv8")
    return {"tiny": tiny_models, "kv8": (str(target), str(draft))}


@pytest.fixture(scope="module")
def references(models):
    """TP-1 colocated greedy outputs per model (a draft changes nothing under greedy decoding)."""
    import torch

    from kvferry.common.engine.colocated import ColocatedEngine
    from kvferry.common.engine.factory import build_runner
    from kvferry.common.text.tokenizer import Tokenizer

    torch.set_num_threads(1)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    out = {}
    for name, (target, _) in models.items():
        engine = ColocatedEngine(build_runner(target, page_size=16, max_total_tokens=16384), Tokenizer.from_dir(target))
        out[name] = [r.output_ids for r in engine.generate(_prompts(), params)]
    return out


def _prompts() -> list[list[int]]:
    rng = random.Random(15)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in LENGTHS]


def _flags(tp: int, page_size: int) -> list[str]:
    return ["--tp-size", str(tp), "--page-size", str(page_size), "--max-total-tokens", "8192"]


@pytest.mark.parametrize("model,prefill_tp,decode_tp,prefill_page,decode_page,draft", CASES,
                         ids=[f"{m}-tp{a}to{b}-pages{p}to{q}" + ("-draft" if d else "") for m, a, b, p, q, d in CASES])
def test_tp_pair_through_router_equals_colocated(tmp_path, models, references, model, prefill_tp, decode_tp,
                                                 prefill_page, decode_page, draft):
    cluster = Cluster(tmp_path / "logs", *models[model])
    try:
        prefill = cluster.prefill(extra=_flags(prefill_tp, prefill_page), start=False)
        decode = cluster.decode(draft=draft, extra=_flags(decode_tp, decode_page), start=False)
        for p in (prefill, decode):
            p.start()
        for p in (prefill, decode):
            p.wait_ready(180)
        router = cluster.router([prefill], [decode])
        before = free_pages(prefill), free_pages(decode)

        def one(ids: list[int]) -> list[int]:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0,
                                                          "ignore_eos": True}}
            return ok(post(router.url + "/generate", body)).json()["output_ids"]

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(one, _prompts())) == references[model]
        for proc, tp in ((prefill, prefill_tp), (decode, decode_tp)):
            status, info = http_json(proc.url + "/server_info", timeout_s=10)
            assert (status, info["tp_size"], len(info["tp_ranks"])) == (200, tp, tp), info
        assert_pages_return([prefill, decode], {p.name: f for p, f in zip((prefill, decode), before)})
    finally:
        cluster.stop_all()
