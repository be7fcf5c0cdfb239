"""Prompt logprobs at the size of one control frame, with a vocabulary past 65,536 (real daemons,
ZeroMQ and NIXL over loopback).

The TransferResult that carries a room's prompt logprobs to the decode is one msgpack frame, and the
decode's DEALER drops a connection whose frame passes ``wire.MAX_FRAME_BYTES`` (libzmq's
MAXMSGSIZE), failing every room on that link. With token ids >= 65,536 msgpack spends 5 bytes on
each id, and each position's two lists of alternatives carry their own headers. The checkpoint is
``tiny-vocab-66k`` (common/models/tiny.py): every position's 20 most likely tokens have such ids.
"""

from __future__ import annotations

import pytest

from kvferry.common.text.tokenizer import Tokenizer
from kvferry.prefill_worker.prompt_logprobs import max_prompt_logprob_tokens
from tests.cluster import Cluster, assert_pages_return, free_pages, send_pair

TOP = 20  # the most alternatives a request may ask for: the fewest positions that fill a frame
DAEMON = ["--max-total-tokens", "16384"]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """(prefill, decode) over the tiny-vocab-66k checkpoint."""
    from kvferry.common.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("vocab66k")
    target, draft = make_tiny_model(root / "model", seed=0, preset="tiny-vocab-66k")
    c = Cluster(root / "logs", str(target), str(draft))
    try:
        yield c.prefill(extra=DAEMON), c.decode(extra=DAEMON), Tokenizer.from_dir(target)
    finally:
        c.stop_all()


def test_as_many_prompt_logprobs_as_the_prefill_allows_reach_the_decode_in_one_frame(wide):
    """A request for exactly as many prompt positions (with 20 alternatives each, all ids >= 65,536)
    as the prefill accepts is answered in full by the decode, and the link still serves the next
    room. Fails if the prefill's limit leaves out msgpack's list headers (9 + 14 * top bytes a
    position): the frame then passes 1 MiB, the decode's DEALER drops the link and the room fails."""
    prefill, decode, tok = wide
    before = {p.name: free_pages(p) for p in (prefill, decode)}
    limit = max_prompt_logprob_tokens(TOP)
    prompt = [(i * 7919) % 500 + 5 for i in range(limit + 1)]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": TOP}
    (ps, pa), (ds, got) = send_pair(prefill, decode, body, timeout_s=300)
    assert ps == 200 and ds == 200, (ps, str(pa)[:500], ds, str(got)[:500])
    tops = got["meta_info"]["input_top_logprobs"]
    assert len(tops) == limit and all(len(alts) == TOP for alts in tops)
    assert min(t for alts in tops for _, t, _ in alts) >= 1 << 16  # the frame is at the size the test means
    small = {"input_ids": tok.encode("The ferry"), "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    (ps, pa), (ds, got) = send_pair(prefill, decode, small)
    assert ps == 200 and ds == 200, (pa, got)
    assert_pages_return([prefill, decode], before)


def test_one_more_position_is_refused_before_the_forward_with_the_reason(wide):
    """One position past the limit: the prefill refuses it (a 400 naming logprob_start_len) and the
    decode leg ends with the reason, instead of a frame that could not be sent."""
    prefill, decode, _ = wide
    limit = max_prompt_logprob_tokens(TOP)
    body = {"input_ids": [(i * 7919) % 500 + 5 for i in range(limit + 2)],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": TOP}
    (ps, pa), (ds, da) = send_pair(prefill, decode, body, timeout_s=300)
    assert ps == 400 and pa["error"]["param"] == "logprob_start_len", pa
    assert ds == 502 and f"returns at most {limit}" in da["error"]["message"], da
