"""The prefix cache (both daemons) beyond the plain pair of test_prefix_cache.py: each case is a
three-turn conversation (each prompt the previous prompt, its answer and a new question) whose
greedy answers must equal the colocated engine's token for token, with hits on later turns.

- vllm-router (two-stage PD, ``/v1/completions`` with a token-id prompt): the router calls the
  prefill first (``max_tokens: 1``), then the decode with the prefill's ``kv_transfer_params``. The
  prefill caches the prompt it computed; the decode, admitted after that leg ended, still finds the
  earlier turn (prompt and answer) in its own cache and asks the waiting room for the suffix only.
  So both sides hit on later turns: ``usage.prompt_tokens_details.cached_tokens`` is the prefill's
  hit (what the answer calls ``cached_tokens``), equal to the growth of the prefill's
  ``kvferry_prefix_hit_tokens{side="prefill"}``, and the decode's counter grows too.
- sglang-router with a decode-only draft (speculative decoding on the decode): equal to the
  colocated engine with its draft, with prefill and decode hits on later turns.
- a TP 2 prefill feeding a TP 1 decode (KV cut per rank): the feeds honour
  ``decode_prefix_len``, so both sides hit (the decode holds at most all but the last prompt token,
  so no feed is left with nothing to write).
- a page-16 prefill feeding a page-64 decode: the prefill hits whole 16-token pages, the decode
  whole 64-token pages.
- a decode restarted (same port) after turn 2: turn 3 equals the reference with no decode hit
  (its cache went with the process; only the prefill's remains), and turn 4 hits the new
  decode's cache again.

After each case every page of every pool is free or held by the prefix cache alone.
"""

from __future__ import annotations


import pytest

from kvferry.common.api.logprobs import token_text
from kvferry.common.api.sampling_schema import sglang_params
from tests.cluster import Cluster, metric, ok, post
from tests.integration.test_prefix_cache import GREEDY, ON, SYSTEM, _info, _pages_accounted, _question

pytestmark = pytest.mark.timeout(600)

EXTRA = ["--max-total-tokens", "4096"]


def _start(procs) -> None:
    """Start daemons made with ``start=False`` at once (their model loads overlap), bounded."""
    for p in procs:
        p.start()
    for p in procs:
        p.wait_ready(180)


def _hit_tokens(proc, side: str) -> float:
    """``kvferry_prefix_hit_tokens_total`` of ``side`` from the daemon's /metrics (0 until the
    side's first hit: a labelled series appears with its first event)."""
    return metric(proc, "kvferry_prefix_hit_tokens_total", side=side)


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_models):
    """One page-16 prefill with its cache on, feeding (each behind its own router): a plain decode
    (vllm-router and sglang-router), a decode with a draft, and a page-64 decode."""
    c = Cluster(tmp_path_factory.mktemp("prefix-layouts") / "logs", *tiny_models)
    try:
        prefill = c.prefill(env=ON, extra=EXTRA, start=False)
        decode = c.decode(env=ON, extra=EXTRA, start=False)
        spec = c.decode(env=ON, extra=EXTRA, draft=True, start=False)
        pages64 = c.decode(env=ON, extra=EXTRA + ["--page-size", "64"], start=False)
        _start([prefill, decode, spec, pages64])
        yield {"cluster": c, "prefill": prefill, "decode": decode, "spec": spec, "pages64": pages64,
               "vllm": c.vllm_router([prefill], [decode]), "sglang": c.router([prefill], [decode]),
               "spec_router": c.router([prefill], [spec]), "pages64_router": c.router([prefill], [pages64])}
    finally:
        c.stop_all()


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory, tiny_models):
    """A TP-2 prefill feeding a TP-1 decode, both with the cache on, behind sglang-router."""
    c = Cluster(tmp_path_factory.mktemp("prefix-tp") / "logs", *tiny_models)
    try:
        prefill = c.prefill(env=ON, extra=EXTRA + ["--tp-size", "2"], start=False)
        decode = c.decode(env=ON, extra=EXTRA + ["--tp-size", "1"], start=False)
        _start([prefill, decode])
        yield prefill, decode, c.router([prefill], [decode])
    finally:
        c.stop_all()


def _head(tok, name: str) -> list[int]:
    """The conversation's first prompt tokens: a name of its own first, so that no other case's
    cached pages match it."""
    return tok.encode(f"Conversation {name}. " + SYSTEM)


def _turn(url: str, tok, engine, history: list[int], i: int) -> tuple[dict, list[int]]:
    """One turn through sglang-router's /generate, checked against ``engine`` token for token;
    (meta_info, the next turn's history)."""
    prompt = history + _question(tok, i)
    out = ok(post(url + "/generate", {"input_ids": prompt, "sampling_params": GREEDY})).json()
    ref = engine.generate([prompt], sglang_params(GREEDY))[0]
    assert out["output_ids"] == ref.output_ids, f"turn {i}"
    return out["meta_info"], prompt + out["output_ids"]


def _conversation(url: str, tok, engine, name: str, turns: int = 3) -> list[dict]:
    history, metas = _head(tok, name), []
    for i in range(turns):
        meta, history = _turn(url, tok, engine, history, i)
        metas.append(meta)
    return metas


def _check_hits(metas: list[dict], prefill_page: int, decode_page: int) -> None:
    """The first turn misses both caches; every later one hits both, in whole pages of each side."""
    assert metas[0]["cached_tokens_prefill"] == 0 and metas[0]["cached_tokens_decode"] == 0, metas[0]
    for i, meta in enumerate(metas[1:], 1):
        assert meta["cached_tokens"] == meta["cached_tokens_prefill"] > 0, (i, meta)
        assert meta["cached_tokens_prefill"] % prefill_page == 0, (i, meta)
        assert meta["cached_tokens_decode"] > 0 and meta["local_prefill"] is False, (i, meta)
        assert meta["cached_tokens_decode"] % decode_page == 0, (i, meta)
        assert meta["cached_tokens_decode"] < meta["prompt_tokens"], (i, meta)


def test_vllm_router_conversation_hits_both_caches(pd, tok, colocated):
    prefill, decode, router = pd["prefill"], pd["decode"], pd["vllm"]
    history = _head(tok, "vllm")
    usages, prefill_hits, decode_hits = [], [], []
    for i in range(3):
        prompt = history + _question(tok, i)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": GREEDY["max_new_tokens"], "temperature": 0,
                "logprobs": 1}
        ref = colocated(False).generate([prompt], sglang_params(GREEDY))[0]
        before = _hit_tokens(prefill, "prefill"), _hit_tokens(decode, "decode")
        out = ok(post(router.url + "/v1/completions", body)).json()
        choice = out["choices"][0]
        # token for token: the answer's tokens (as completions logprobs name them), their count and text
        assert choice["logprobs"]["tokens"] == [token_text(tok, t) for t in ref.output_ids], f"turn {i}"
        assert out["usage"]["completion_tokens"] == len(ref.output_ids), f"turn {i}"
        assert choice["text"] == ref.text, f"turn {i}"
        assert out["usage"]["prompt_tokens"] == len(prompt)
        usages.append(out["usage"])
        prefill_hits.append(_hit_tokens(prefill, "prefill") - before[0])
        decode_hits.append(_hit_tokens(decode, "decode") - before[1])
        history = prompt + ref.output_ids
    assert "prompt_tokens_details" not in usages[0] and prefill_hits[0] == 0 and decode_hits[0] == 0
    page = _info(prefill)["page_size"]
    for i in (1, 2):
        cached = usages[i]["prompt_tokens_details"]["cached_tokens"]
        assert cached == prefill_hits[i] > 0 and cached % page == 0, (i, usages[i], prefill_hits[i])
        # the decode's own hit: the earlier turn's prompt and answer, past what the prefill cached
        assert decode_hits[i] > 0 and decode_hits[i] % page == 0, (i, decode_hits[i])
        assert decode_hits[i] >= prefill_hits[i], (i, decode_hits[i], prefill_hits[i])
    _pages_accounted([prefill, decode])


def test_decode_only_draft_conversation_hits_both_caches(pd, tok, colocated):
    prefill, spec = pd["prefill"], pd["spec"]
    metas = _conversation(pd["spec_router"].url, tok, colocated(True), "draft")
    _check_hits(metas, 16, 16)
    assert all(m.get("spec_num_proposed", 0) > 0 for m in metas), metas  # the draft did propose
    _pages_accounted([prefill, spec])


def test_tp2_prefill_to_tp1_decode_conversation_hits_both_caches(tp_pair, tok, colocated):
    prefill, decode, router = tp_pair
    assert (_info(prefill)["tp_size"], _info(decode)["tp_size"]) == (2, 1)
    metas = _conversation(router.url, tok, colocated(False), "tp")
    _check_hits(metas, 16, 16)
    _pages_accounted([prefill, decode])


def test_page16_prefill_to_page64_decode_hits_whole_pages(pd, tok, colocated):
    prefill, decode = pd["prefill"], pd["pages64"]
    assert (_info(prefill)["page_size"], _info(decode)["page_size"]) == (16, 64)
    metas = _conversation(pd["pages64_router"].url, tok, colocated(False), "pages")
    _check_hits(metas, 16, 64)
    _pages_accounted([prefill, decode])


def test_decode_restarted_mid_conversation(pd, tok, colocated):
    prefill, decode, router = pd["prefill"], pd["decode"], pd["sglang"]
    engine = colocated(False)
    history, metas = _head(tok, "restart"), []
    for i in range(2):
        meta, history = _turn(router.url, tok, engine, history, i)
        metas.append(meta)
    assert metas[1]["cached_tokens_decode"] > 0, metas[1]
    old_id = _info(decode)["decode_id"]
    decode.stop(20)
    decode.start()
    decode.wait_ready(180)
    assert _info(decode)["decode_id"] != old_id
    assert _info(decode)["prefix_cache"]["cached_pages"] == 0
    meta, history = _turn(router.url, tok, engine, history, 2)
    # the new decode holds nothing: it fetched the whole prompt; the prefill's cache still served
    assert meta["cached_tokens_decode"] == 0 and meta["local_prefill"] is False, meta
    assert meta["cached_tokens_prefill"] > 0, meta
    meta, history = _turn(router.url, tok, engine, history, 3)
    assert meta["cached_tokens_decode"] > 0, meta  # the new decode cached turn 3
    _pages_accounted([prefill, decode])
