"""Prefix reuse across the pair, through the real sglang-router: a conversation's later turns hit
the prefill's cache (compute skipped) and the decode's (transfer skipped: only the suffix pages
are written), with greedy tokens equal to the colocated engine's; local prefill on the decode,
through sglang-router and vllm-router; ``/flush_cache``; and every page either free or held by a
cache once the requests are done."""

from __future__ import annotations

import time

import pytest

from kvferry.common.api.logprobs import token_text
from kvferry.common.api.sampling_schema import sglang_params
import msgpack
import zmq

from kvferry.common.daemon.procs import free_port, http_json
from tests.cluster import Cluster, cached_pages, metric, ok, post, settle_prefix_cache

ON = {"KVFERRY_DISABLE_PREFIX_CACHE": "false"}
GREEDY = {"max_new_tokens": 8, "temperature": 0}
SYSTEM = "You are the ferry's helpful assistant. Answer in one short sentence about the harbour. " * 3


def _info(proc) -> dict:
    status, info = http_json(proc.url + "/server_info", timeout_s=10)
    assert status == 200, info
    return info


def _pages_accounted(procs, timeout_s: float = 10.0) -> None:
    """Once idle, every page of every pool is free or held by the prefix cache alone."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = [_info(p) for p in procs]
        short = [(p.name, i["free_pages"], i["prefix_cache"]) for p, i in zip(procs, infos)
                 if any(free + i["prefix_cache"]["cached_pages"] != _total(i) for free in i["free_pages"].values())]
        if not short or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    assert short == []


def _total(info: dict) -> int:
    return info["max_total_tokens"] // info["page_size"]


def _question(tok, i: int) -> list[int]:
    return tok.encode(f" Question {i}: where does the ferry go at {7 + i} o'clock?")


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_models):
    """(prefill, decode, router) with the prefix cache on both sides, and a decode that prefills
    locally what it holds but for 64 tokens, behind a second router."""
    c = Cluster(tmp_path_factory.mktemp("prefix-cache") / "logs", *tiny_models)
    try:
        extra = ["--max-total-tokens", "4096"]
        events_port = free_port()
        prefill = c.prefill(env=ON, extra=extra + ["--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}"])
        prefill.events_url = f"tcp://127.0.0.1:{events_port}"
        decode = c.decode(env=ON, extra=extra)
        local = c.decode(env=ON, extra=extra + ["--max-local-prefill-tokens", "64"])
        yield c, prefill, decode, c.router([prefill], [decode]), local, c.router([prefill], [local])
    finally:
        c.stop_all()


def _conversation(router_url: str, tok, colocated, prefill) -> list[dict]:
    """Three turns, each prompt the previous one, its answer and a new question; each answer is
    checked against the colocated engine (no cache) token for token. Each next turn goes once the
    prefill has cached the last prompt (``settle_prefix_cache``), as a client's next turn usually does."""
    history = tok.encode(SYSTEM)
    metas = []
    for i in range(3):
        prompt = history + _question(tok, i)
        held = cached_pages(prefill)
        out = ok(post(router_url + "/generate", {"input_ids": prompt, "sampling_params": GREEDY})).json()
        settle_prefix_cache(prefill, held)
        ref = colocated(False).generate([prompt], sglang_params(GREEDY))[0]
        assert out["output_ids"] == ref.output_ids, f"turn {i}"
        metas.append(out["meta_info"])
        history = prompt + out["output_ids"]
    return metas


def test_later_turns_hit_both_caches_and_equal_the_reference(pd, tok, colocated):
    _, prefill, decode, router, _, _ = pd
    metas = _conversation(router.url, tok, colocated, prefill)
    assert metas[0]["cached_tokens"] == 0
    for meta in metas[1:]:
        # the prefill skipped the cached prefix; the decode held it (and more: the earlier answer)
        assert meta["cached_tokens_prefill"] > 0 and meta["cached_tokens"] == meta["cached_tokens_prefill"]
        assert meta["cached_tokens_decode"] > 0 and meta["local_prefill"] is False
        assert meta["cached_tokens_decode"] % _info(decode)["page_size"] == 0
    _pages_accounted([prefill, decode])


def test_flush_cache_empties_it_and_the_next_prompt_misses(pd, tok, colocated):
    _, prefill, decode, router, _, _ = pd
    prompt = tok.encode(SYSTEM) + _question(tok, 9)
    ok(post(router.url + "/generate", {"input_ids": prompt, "sampling_params": GREEDY}))
    _pages_accounted([prefill, decode])
    for proc in (prefill, decode):
        answer = ok(post(proc.url + "/flush_cache", {}))
        assert answer.json()["message"] == "Cache flushed."
        info = _info(proc)
        assert info["prefix_cache"]["cached_pages"] == 0
        assert all(free == _total(info) for free in info["free_pages"].values())
    out = ok(post(router.url + "/generate", {"input_ids": prompt, "sampling_params": GREEDY})).json()
    assert out["meta_info"]["cached_tokens_prefill"] == 0 and out["meta_info"]["cached_tokens_decode"] == 0
    ref = colocated(False).generate([prompt], sglang_params(GREEDY))[0]
    assert out["output_ids"] == ref.output_ids


def test_local_prefill_on_the_decode_equals_the_reference(pd, tok, colocated):
    _, prefill, _, _, local, local_router = pd
    metas = _conversation(local_router.url, tok, colocated, prefill)
    assert metas[0]["local_prefill"] is False  # nothing cached yet: the prefill computed and wrote it
    later = [m for m in metas[1:] if m["local_prefill"]]
    assert later, metas  # each later turn adds fewer than 64 tokens past what the decode holds
    for meta in later:
        assert meta["cached_tokens"] == meta["cached_tokens_decode"] > 0
    _pages_accounted([prefill, local])


def test_prefill_publishes_kv_events_of_what_it_caches(pd, tok):
    """A subscriber written against vLLM's kv_events format sees BlockStored for the new prompt's pages."""
    _, prefill, _, router, _, _ = pd
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(prefill.events_url)
    try:
        page_size = _info(prefill)["page_size"]
        stored: list[list] = []
        deadline = time.monotonic() + 30.0
        for i in range(10):  # the first messages after connecting may be lost (PUB/SUB joining)
            prompt = tok.encode(f"Event probe {i}: " + SYSTEM)
            ok(post(router.url + "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}))
            while sub.poll(500) and time.monotonic() < deadline:
                topic, seq, payload = sub.recv_multipart()
                assert len(seq) == 8
                ts, events, _rank = msgpack.unpackb(payload)
                stored += [e for e in events if e[0] == "BlockStored"]
            if any(e[3] == prompt[:len(e[3])] and len(e[3]) >= page_size for e in stored):
                break
            assert time.monotonic() < deadline, "no BlockStored for the probe prompts"
        match = [e for e in stored if e[3] == prompt[:len(e[3])] and len(e[3]) >= page_size]
        assert match, stored[:2]
        _, hashes, _parent, tokens, block_size = match[-1][:5]
        assert block_size == page_size and len(hashes) == len(tokens) // page_size
    finally:
        sub.close()


def test_openai_usage_names_the_cached_prompt_tokens(pd):
    router = pd[3]
    body = {"model": "m", "prompt": SYSTEM + " Where is the pier?", "max_tokens": 2, "temperature": 0}
    first = ok(post(router.url + "/v1/completions", body)).json()["usage"]
    again = ok(post(router.url + "/v1/completions", body)).json()["usage"]
    assert first["prompt_tokens"] == again["prompt_tokens"]
    assert 0 < again["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens"]


def _local_rooms(proc) -> float:
    return metric(proc, "kvferry_local_prefill_rooms_total")


def test_local_prefill_through_vllm_router_equals_the_reference(pd, tok, colocated):
    """vllm-router runs the prefill's leg to its end before it calls the decode, so the prefill has
    computed (and cached) the prompt; the decode, holding all but a few tokens, computes those
    itself and ends the waiting room without a WRITE. Same greedy tokens as the colocated engine."""
    c, prefill, _, _, local, _ = pd
    router = c.vllm_router([prefill], [local])
    history = tok.encode("A vllm-router conversation. " + SYSTEM)
    rooms = []
    for i in range(3):
        prompt = history + _question(tok, i)
        ref = colocated(False).generate([prompt], sglang_params(GREEDY))[0]
        before = _local_rooms(local)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": GREEDY["max_new_tokens"], "temperature": 0,
                "logprobs": 1}
        choice = ok(post(router.url + "/v1/completions", body)).json()["choices"][0]
        assert choice["logprobs"]["tokens"] == [token_text(tok, t) for t in ref.output_ids], f"turn {i}"
        assert choice["text"] == ref.text, f"turn {i}"
        rooms.append(_local_rooms(local) - before)
        history = prompt + ref.output_ids
    assert rooms[0] == 0 and rooms[1:] == [1, 1], rooms
    _pages_accounted([prefill, local])
