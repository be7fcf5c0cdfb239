"""Disaggregated greedy output equals the colocated engine's, token for token (real daemons,
real ZeroMQ and NIXL over loopback), with the two HTTP legs in every order."""

from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvferry.common.sampling.sampler import SamplingParams
from tests.cluster import free_pages, http_json, metric, send_pair

# 32 prompt lengths from 1 to 2,000 tokens; 16, 32, 64, 128, 256, 512, 1024 end exactly on a page.
LENGTHS = [1, 2, 5, 15, 16, 17, 31, 32, 33, 48, 64, 100, 127, 128, 129, 200,
           255, 256, 300, 400, 512, 600, 700, 800, 1000, 1023, 1024, 1200, 1500, 1800, 1999, 2000]
MAX_NEW = 8


def prompts(vocab_size: int = 512, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in range(n)] for n in LENGTHS]


def expected(colocated, draft: bool) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [r.output_ids for r in colocated(draft).generate(prompts(), params)]


def body(ids: list[int]) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}


def run_all(prefill, decode, order: str) -> list[list[int]]:
    def one(ids):
        (ps, pa), (ds, da) = send_pair(prefill, decode, body(ids), order=order)
        assert ps == 200, pa
        assert ds == 200, da
        return da["output_ids"]

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, prompts()))


@pytest.mark.parametrize("order", ["concurrent", "prefill_first", "decode_first"])
def test_greedy_equals_colocated(cluster, colocated, order):
    prefill, decode = cluster.prefill(), cluster.decode()
    before = free_pages(prefill), free_pages(decode)
    assert run_all(prefill, decode, order) == expected(colocated, draft=False)
    assert (free_pages(prefill), free_pages(decode)) == before


def test_decode_only_speculative(cluster, colocated):
    """Decode has a draft, prefill does not: the plan ignores the draft regions and the decode
    fills the draft's prompt KV itself. Tokens and acceptance equal the colocated engine's."""
    prefill, decode = cluster.prefill(), cluster.decode(draft=True)
    got = run_all(prefill, decode, "concurrent")
    assert got == expected(colocated, draft=False)
    assert got == expected(colocated, draft=True)
    # /metrics counts the draft's proposals and acceptances (fails if they are never counted)
    proposed = metric(decode, "kvferry_spec_proposed_tokens_total")
    accepted = metric(decode, "kvferry_spec_accepted_tokens_total")
    assert 0 < accepted <= proposed, (accepted, proposed)


def prefill_chunks(prefill) -> int:
    status, info = http_json(prefill.url + "/server_info", timeout_s=10)
    assert status == 200, info
    return info["prefill_chunks"]


def batch_metrics(prefill) -> tuple[float, float]:
    """(batches, new tokens) the prefill's forwards ran: ``kvferry_prefill_batch_seconds_count`` and
    ``kvferry_prefill_batch_tokens_total``."""
    return metric(prefill, "kvferry_prefill_batch_seconds_count"), metric(prefill, "kvferry_prefill_batch_tokens_total")


def test_chunked_prefill(cluster, colocated):
    """The prefill splits every prompt longer than 100 tokens into chunks (and runs the draft on
    the completed prompt): output equals the colocated engine's, every page comes back, and the
    prefill ran ceil(length / 100) chunks per prompt (/server_info ``prefill_chunks``), in batches
    of at most 256 new tokens that ran every prompt token once (/metrics). Fails if the daemon does
    not hand ``--chunked-prefill-size`` to its scheduler (``chunk_tokens=0 * ...``)."""
    prefill = cluster.prefill(draft=True, extra=["--chunked-prefill-size", "100", "--max-prefill-tokens", "256"])
    decode = cluster.decode(draft=True)
    before = free_pages(prefill), free_pages(decode)
    chunks_before, (batches_before, tokens_before) = prefill_chunks(prefill), batch_metrics(prefill)
    assert run_all(prefill, decode, "concurrent") == expected(colocated, draft=True)
    assert (free_pages(prefill), free_pages(decode)) == before
    assert prefill_chunks(prefill) - chunks_before == sum(math.ceil(n / 100) for n in LENGTHS)
    batches, tokens = batch_metrics(prefill)
    assert tokens - tokens_before == sum(LENGTHS)
    assert sum(LENGTHS) / 256 <= batches - batches_before <= sum(math.ceil(n / 100) for n in LENGTHS)


def test_draft_on_both_sides(cluster, colocated):
    """Prefill runs the draft too: the draft regions are written, and the decode uses them."""
    prefill, decode = cluster.prefill(draft=True), cluster.decode(draft=True)
    got = run_all(prefill, decode, "concurrent")
    assert got == expected(colocated, draft=True)


def test_acceptance_rate_matches_colocated(cluster, colocated):
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    ids = prompts()[:8]
    reference = colocated(True).generate(ids, params)
    for draft_on_prefill in (False, True):
        prefill, decode = cluster.prefill(draft=draft_on_prefill), cluster.decode(draft=True)
        for p, ref in zip(ids, reference):
            b = {"input_ids": p, "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}}
            (_, _), (ds, da) = send_pair(prefill, decode, b)
            assert ds == 200, da
            assert da["output_ids"] == ref.output_ids
            assert da["meta_info"]["spec_accept_rate"] == pytest.approx(ref.acceptance_rate)
