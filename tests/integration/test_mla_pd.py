"""DeepSeek (MLA) across the pair: the ``deepseek-v3-tiny`` preset served by a real prefill and decode
whose pools are ``LatentCache``s (one latent region per layer), through the real sglang-router (and
vllm-router once), equals the colocated engine token for token, with every page of both daemons
back afterwards.

Cases: 16-token pages on both sides (the direct plan), also with staged rooms; 16 -> 64 and
64 -> 16 (the per-rank feed plan of ``tp_feed``, which a page-size change takes even at TP 1); a
decode-only dense draft (the default tiny Llama's, same tokenizer and vocabulary) beside the MLA
target, whose K/V regions the prefill ignores by key and whose prompt KV the decode fills itself;
the preset's DeepSeek draft on both sides (its latent region written too); the prefix cache on (a
second turn hits on both sides and equals the cold answer), at equal and different page sizes; n > 1
(the decode forks latent pages); vllm-router; and a DeepSeek on one side with a Llama on the other,
refused at registration naming both cache forms and fingerprints while both daemons keep serving.
"""

from __future__ import annotations

import random

import pytest

from kvferry.common.daemon.procs import http_json
from kvferry.common.models.config import ModelConfig
from kvferry.common.sampling.sampler import SamplingParams
from tests.cluster import (Cluster, assert_pages_return, cached_pages, free_pages, metric, ok, post, send_pair,
                           settle_prefix_cache)

LENGTHS = [1, 17, 70]  # one token, past one 16-token page, past one 64-token page
MAX_NEW = 5
EXTRA = ["--max-total-tokens", "2048"]
PREFIX_ON = {"KVFERRY_DISABLE_PREFIX_CACHE": "false"}
PROMPT = "The ferry leaves the north pier at seven"

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory) -> tuple[str, str]:
    from kvferry.common.models.tiny import make_tiny_model

    target, draft = make_tiny_model(tmp_path_factory.mktemp("deepseek-v3-tiny"), seed=0, preset="deepseek-v3-tiny")
    return str(target), str(draft)


def _prompts() -> list[list[int]]:
    rng = random.Random(31)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in LENGTHS]


def _greedy(max_new: int = MAX_NEW) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(mla_model):
    """The colocated engine over the DeepSeek target (16-token pages), the reference."""
    import torch

    from kvferry.common.engine.colocated import ColocatedEngine
    from kvferry.common.engine.factory import build_runner
    from kvferry.common.text.tokenizer import Tokenizer

    torch.set_num_threads(1)
    target = mla_model[0]
    return ColocatedEngine(build_runner(target, page_size=16, max_total_tokens=4096), Tokenizer.from_dir(target))


@pytest.fixture(scope="module")
def reference(engine) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [r.output_ids for r in engine.generate(_prompts(), params)]


def _start(cluster: Cluster, prefill_extra: list[str], decode_extra: list[str], *, draft: bool = False,
           env: dict | None = None):
    prefill = cluster.prefill(extra=EXTRA + prefill_extra, start=False, env=env)
    decode = cluster.decode(draft=draft, extra=EXTRA + decode_extra, start=False, env=env)
    for p in (prefill, decode):
        p.start()
    for p in (prefill, decode):
        p.wait_ready(180)
    return prefill, decode


def _generate(url: str, ids: list[int], max_new: int = MAX_NEW) -> dict:
    return ok(post(url + "/generate", {"input_ids": ids, "sampling_params": _greedy(max_new)})).json()


def _latent_summary(proc) -> dict:
    status, info = http_json(proc.url + "/server_info", timeout_s=10)
    assert status == 200, info
    return info["kv_layout"]


# Staging forced on (as tests/integration/test_staging_pd.py does): each room is gathered from the
# latent pages into a staging slot, written in chunks, and scattered back on the decode.
STAGED = (["--staging-bytes", str(1 << 20), "--staging-chunk-bytes", str(16 << 10), "--staging-crossover-runs", "1"],
          ["--staging-bytes", str(16 << 20)])
# (prefill page size, decode page size, staged)
CASES = [(16, 16, False), (16, 64, False), (64, 16, False), (16, 16, True)]


@pytest.mark.parametrize("prefill_page,decode_page,staged", CASES,
                         ids=[f"pages{p}to{d}" + ("-staged" if s else "") for p, d, s in CASES])
def test_mla_pair_through_router_equals_colocated(tmp_path, mla_model, reference, prefill_page, decode_page,
                                                  staged):
    cluster = Cluster(tmp_path / "logs", *mla_model)
    try:
        prefill_extra, decode_extra = STAGED if staged else ([], [])
        prefill, decode = _start(cluster, ["--page-size", str(prefill_page), *prefill_extra],
                                 ["--page-size", str(decode_page), *decode_extra])
        router = cluster.router([prefill], [decode])
        before = {p.name: free_pages(p) for p in (prefill, decode)}
        assert [_generate(router.url, ids)["output_ids"] for ids in _prompts()] == reference
        if staged:
            assert metric(prefill, "kvferry_staging_rooms_total", path="staged", reason="") == len(LENGTHS)
        for proc, page in ((prefill, prefill_page), (decode, decode_page)):
            layout = _latent_summary(proc)
            # one latent region per layer of three, each page one row of latent + rope per token
            assert (layout["page_size"], layout["target"]["layers"], layout["target"]["regions"]) == (page, 3, 3)
            assert layout["target"]["kv_heads"] == [[0, 1]]
        assert_pages_return([prefill, decode], before)
    finally:
        cluster.stop_all()


@pytest.mark.parametrize("decode_page", [16, 64], ids=["pages16to16", "pages16to64"])
def test_mla_pair_with_decode_only_dense_draft(tmp_path, mla_model, tiny_models, reference, decode_page):
    """The decode runs the tiny Llama draft (K/V regions) beside the DeepSeek target (latent
    regions); the prefill writes the latent, ignores the draft's regions by key (in the direct
    plan and in the feed plan of a page-size change), and the decode prefills the draft itself:
    greedy output is the target's, with draft tokens proposed."""
    cluster = Cluster(tmp_path / "logs", mla_model[0], tiny_models[1])
    try:
        prefill, decode = _start(cluster, [], ["--page-size", str(decode_page)], draft=True)
        router = cluster.router([prefill], [decode])
        before = {p.name: free_pages(p) for p in (prefill, decode)}
        proposed = metric(decode, "kvferry_spec_proposed_tokens_total")
        assert [_generate(router.url, ids)["output_ids"] for ids in _prompts()] == reference
        assert metric(decode, "kvferry_spec_proposed_tokens_total") > proposed
        layout = _latent_summary(decode)
        assert layout["draft"]["regions"] == 2 * layout["draft"]["layers"] and layout["target"]["regions"] == 3
        assert _latent_summary(prefill)["draft"] is None
        registered = f"3 regions written, {layout['draft']['regions']} ignored, decode_only_spec_dec=True"
        assert registered in prefill.log_path.read_text(), prefill.tail()
        assert_pages_return([prefill, decode], before)
    finally:
        cluster.stop_all()


def test_mla_pair_with_mla_draft_on_both_sides(tmp_path, mla_model, reference):
    """Both daemons run the preset's one-layer DeepSeek draft: the prefill writes the draft's latent
    region too (matched by key like the target's), nothing is ignored, and greedy output is the
    target's with draft tokens proposed."""
    cluster = Cluster(tmp_path / "logs", *mla_model)
    try:
        prefill = cluster.prefill(draft=True, extra=EXTRA, start=False)
        decode = cluster.decode(draft=True, extra=EXTRA, start=False)
        for p in (prefill, decode):
            p.start()
        for p in (prefill, decode):
            p.wait_ready(180)
        router = cluster.router([prefill], [decode])
        before = {p.name: free_pages(p) for p in (prefill, decode)}
        proposed = metric(decode, "kvferry_spec_proposed_tokens_total")
        assert [_generate(router.url, ids)["output_ids"] for ids in _prompts()] == reference
        assert metric(decode, "kvferry_spec_proposed_tokens_total") > proposed
        for proc in (prefill, decode):
            assert _latent_summary(proc)["draft"]["regions"] == 1  # one latent region of one layer
        assert "4 regions written, 0 ignored, decode_only_spec_dec=False" in prefill.log_path.read_text()
        assert_pages_return([prefill, decode], before)
    finally:
        cluster.stop_all()


@pytest.mark.parametrize("decode_page", [16, 64], ids=["pages16to16", "pages16to64"])
def test_mla_prefix_cache_second_turn_hits_both_sides(tmp_path, mla_model, engine, decode_page):
    """The second turn's prefix is cached on both sides: the prefill computes only the rest, and
    writes only the latent rows past what the decode holds (cut at the decode's pages)."""
    cluster = Cluster(tmp_path / "logs", *mla_model)
    try:
        prefill, decode = _start(cluster, [], ["--page-size", str(decode_page)], env=PREFIX_ON)
        router = cluster.router([prefill], [decode])
        before = {p.name: free_pages(p) for p in (prefill, decode)}
        rng = random.Random(5)
        first = [rng.randrange(5, 512) for _ in range(140)]
        held = cached_pages(prefill)
        turn = _generate(router.url, first)
        assert turn["meta_info"]["cached_tokens"] == 0
        settle_prefix_cache(prefill, held)  # the prefill caches the first prompt as its leg ends
        second = first + turn["output_ids"] + [rng.randrange(5, 512) for _ in range(30)]
        hit = _generate(router.url, second)
        cold = engine.generate([second], SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
        assert hit["output_ids"] == cold[0].output_ids
        meta = hit["meta_info"]
        assert meta["cached_tokens_prefill"] >= 128 and meta["cached_tokens_decode"] >= 128, meta
        assert meta["cached_tokens_decode"] % decode_page == 0, meta
        assert meta["local_prefill"] is False
        for proc in (prefill, decode):
            assert ok(post(proc.url + "/flush_cache", {})).json()["message"] == "Cache flushed."
        assert_pages_return([prefill, decode], before)
    finally:
        cluster.stop_all()


@pytest.fixture(scope="module")
def pair(tmp_path_factory, mla_model):
    """(cluster, prefill, decode, free pages at the start): 16-token pages, no prefix cache."""
    cluster = Cluster(tmp_path_factory.mktemp("mla-pair") / "logs", *mla_model)
    try:
        prefill, decode = _start(cluster, [], [])
        yield cluster, prefill, decode, {p.name: free_pages(p) for p in (prefill, decode)}
    finally:
        cluster.stop_all()


def test_mla_pair_through_vllm_router(pair, engine):
    from kvferry.common.api.sampling_schema import openai_params

    cluster, prefill, decode, before = pair
    router = cluster.vllm_router([prefill], [decode])
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    ref = engine.generate([PROMPT], openai_params(body, chat=False))[0]
    out = ok(post(router.url + "/v1/completions", body)).json()
    assert out["choices"][0]["text"] == ref.text
    assert out["usage"]["completion_tokens"] == len(ref.output_ids)
    assert_pages_return([prefill, decode], before)


def test_mla_pair_forks_n_completions(pair, reference):
    """n = 3 on a 17-token prompt: the decode forks the transferred latent pages, copying the
    shared partial page for each child (``LatentCache.copy_page``); every child decodes the
    reference, and every page, shared ones included, comes back."""
    cluster, prefill, decode, before = pair
    router = cluster.router([prefill], [decode])
    body = {"input_ids": _prompts()[1], "sampling_params": {**_greedy(), "n": 3}}
    outs = ok(post(router.url + "/generate", body)).json()
    assert [o["output_ids"] for o in outs] == [reference[1]] * 3
    assert_pages_return([prefill, decode], before)


@pytest.mark.parametrize("mla_side", ["decode", "prefill"])
def test_mismatched_forms_refused_at_registration(tmp_path, mla_model, tiny_models, mla_side):
    """A DeepSeek decode registering with a Llama prefill (or a Llama decode with a DeepSeek
    prefill) is refused at registration, the reason naming both cache forms and both fingerprints;
    both legs fail, every page comes back, and both daemons keep serving: the prefill a decode of
    its own model, the refused decode its health check."""
    models = {"mla": mla_model, "dense": tiny_models}
    prefill_model, decode_model = ("dense", "mla") if mla_side == "decode" else ("mla", "dense")
    prefill_side = Cluster(tmp_path / "prefill-logs", *models[prefill_model])
    decode_side = Cluster(tmp_path / "decode-logs", *models[decode_model])
    try:
        prefill = prefill_side.prefill(extra=EXTRA)
        decode = decode_side.decode(extra=EXTRA)
        before = {p.name: free_pages(p) for p in (prefill, decode)}
        body = {"input_ids": _prompts()[1], "sampling_params": _greedy()}
        (prefill_status, _), (decode_status, answer) = send_pair(prefill, decode, body)
        assert prefill_status >= 400 and decode_status >= 400, answer
        reason = answer["error"]["message"]
        forms = {"mla": "one MLA latent per layer", "dense": "K and V per layer"}
        assert f"KV form mismatch: prefill caches {forms[prefill_model]}, decode caches {forms[decode_model]}" \
            in reason, reason
        fingerprints = [ModelConfig.from_dir(models[m][0]).fingerprint for m in (prefill_model, decode_model)]
        assert f"prefill {fingerprints[0]!r}, decode {fingerprints[1]!r}" in reason, reason
        assert metric(prefill, "kvferry_registrations_total", result="rejected") >= 1
        assert_pages_return([prefill, decode], before)
        same = prefill_side.decode(extra=EXTRA)
        (prefill_status, _), (decode_status, served) = send_pair(prefill, same, body)
        assert (prefill_status, decode_status) == (200, 200), served
        assert len(served["output_ids"]) == MAX_NEW
        assert http_json(decode.url + "/health", timeout_s=10)[0] == 200
    finally:
        decode_side.stop_all()
        prefill_side.stop_all()


# (prefill TP, decode TP, prefill page size, decode page size): the per-rank feeds, each decode rank
# receiving every layer's latent whole, the layers' writers spread over the prefill ranks
TP_CASES = [(2, 1, 16, 16), (1, 2, 16, 64), (2, 4, 64, 16)]


@pytest.mark.parametrize("prefill_tp,decode_tp,prefill_page,decode_page", TP_CASES,
                         ids=[f"tp{a}to{b}-pages{p}to{d}" for a, b, p, d in TP_CASES])
def test_mla_pair_across_tp_sizes_equals_colocated(tmp_path, mla_model, reference, prefill_tp, decode_tp,
                                                   prefill_page, decode_page):
    cluster = Cluster(tmp_path / "logs", *mla_model)
    try:
        prefill, decode = _start(cluster, ["--tp-size", str(prefill_tp), "--page-size", str(prefill_page)],
                                 ["--tp-size", str(decode_tp), "--page-size", str(decode_page)])
        router = cluster.router([prefill], [decode])
        before = {p.name: free_pages(p) for p in (prefill, decode)}
        assert [_generate(router.url, ids)["output_ids"] for ids in _prompts()] == reference
        for proc, tp in ((prefill, prefill_tp), (decode, decode_tp)):
            status, info = http_json(proc.url + "/server_info", timeout_s=10)
            assert (status, info["tp_size"]) == (200, tp), info
        assert_pages_return([prefill, decode], before)
    finally:
        cluster.stop_all()
