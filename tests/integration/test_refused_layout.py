"""A decode whose KV layout the prefill refuses, behind both routers: a prefill started with
``--draft-model`` and a decode without one (the decode registers fewer regions than the prefill).

Both legs end at once with the refusal's reason (the decode aborts each room it could not
transfer, and the prefill takes that abort from the connection whose registration it refused),
the prefill's pages come back at once instead of at its transfer deadline, and the decode answers
later requests from its memory of the refusal without registering again.
"""

from __future__ import annotations

import time

import pytest

from kvferry.common.daemon.procs import http_json
from tests.cluster import Cluster, assert_pages_return, free_pages, metric, post

TRANSFER_WAIT_S = 60.0  # the prefill's own deadline: nothing below may come near it
BODY = {"text": "The ferry leaves the north pier at seven", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory, tiny_models):
    c = Cluster(tmp_path_factory.mktemp("refused-layout") / "logs", *tiny_models)
    try:
        prefill = c.prefill(draft=True, extra=["--transfer-wait-timeout-s", str(TRANSFER_WAIT_S)])
        decode = c.decode()
        yield c, prefill, decode, {p.name: free_pages(p) for p in (prefill, decode)}
    finally:
        c.stop_all()


def registrations(proc, result: str) -> float:
    return metric(proc, "kvferry_registrations_total", result=result)


def aborted_transfers(proc) -> float:
    return metric(proc, "kvferry_failed_transfers_total", reason="aborted")


def decode_aborts(proc) -> float:
    return metric(proc, "kvferry_aborts_total", side="decode")


def test_server_info_shows_both_layouts(mismatched):
    _, prefill, decode, _ = mismatched
    layouts = {p.name: http_json(p.url + "/server_info", timeout_s=10)[1]["kv_layout"] for p in (prefill, decode)}
    p, d = layouts[prefill.name], layouts[decode.name]
    assert p["model"] == d["model"] and p["page_size"] == d["page_size"] and p["kv_dtype"] == d["kv_dtype"]
    assert p["draft"] is not None and d["draft"] is None and p["draft_model"] and d["draft_model"] is None
    assert p["target"] == {**d["target"], "num_pages": p["target"]["num_pages"]}
    assert (p["tp_size"], p["tp_rank"]) == (d["tp_size"], d["tp_rank"]) == (1, 0)


@pytest.mark.parametrize("router_kind", ["sglang", "vllm"])
def test_both_legs_fail_at_once_with_the_reason(mismatched, router_kind):
    c, prefill, decode, before = mismatched
    router = (c.router if router_kind == "sglang" else c.vllm_router)([prefill], [decode])
    try:
        counts, aborted, aborts = [], aborted_transfers(prefill), decode_aborts(prefill)
        for attempt in range(2):
            started = time.monotonic()
            answer = post(router.url + "/generate", BODY, timeout_s=TRANSFER_WAIT_S)
            assert answer.status >= 400, answer.raw[:500]
            assert "fewer KV regions" in answer.raw and "draft" in answer.raw, answer.raw[:1000]
            # the prefill's pages are back well before its own transfer deadline
            assert_pages_return([prefill, decode], before, timeout_s=10.0)
            assert time.monotonic() - started < TRANSFER_WAIT_S / 2
            counts.append(registrations(prefill, "rejected"))
            # one failed transfer per aborted room (the router may retry a request), whether the
            # decode's abort reached the prefill before the prefill leg opened the room or after
            num_aborts = decode_aborts(prefill) - aborts
            assert num_aborts >= attempt + 1 and aborted_transfers(prefill) - aborted == num_aborts
        # the second request was answered from the decode's memory of the refusal: no new register
        assert counts[0] >= 1 and counts[1] == counts[0], counts
    finally:
        router.stop(20)
