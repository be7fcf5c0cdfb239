"""Requests the pair must refuse, clearly and without leaking: a decode whose KV geometry does not
match the prefill's, two legs that tokenized the prompt differently, and two requests that share
one bootstrap room.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from tests.faults.harness import (
    DECODE_DEADLINE_S, DECODE_FLAGS, PREFILL_DEADLINE_S, TRANSFER_WAIT_S, Pending, assert_answered, assert_clear_error, assert_within,
    body, boot, counter, metrics, new_room, pages, prompt, wait_pages,
)


def _leg(name: str, proc, ids, room, port) -> Pending:
    return Pending(name, proc.url + "/generate", {**body(ids), **boot(port, room)})


def test_geometry_refusal(healthy):
    """A decode with bfloat16 KV registers with a float32 prefill: the prefill refuses and says
    both values; the decode's request fails with that reason, and so does the prefill's leg, at
    once (the decode aborts the room it could not transfer) instead of at its transfer deadline;
    the prefill keeps serving the decode that matches, at the same time."""
    pair = healthy
    wrong = pair.cluster.decode(extra=DECODE_FLAGS + ["--dtype", "bfloat16"], start=False)
    pair.start(wrong)
    try:
        wrong_pages = pages(wrong)
        before = metrics(pair.prefill)
        ids, room = prompt(40, seed=51), new_room()
        p_leg, d_leg = _leg("prefill", pair.prefill, ids, room, pair.prefill.bootstrap_port), \
            _leg("decode", wrong, ids, room, pair.prefill.bootstrap_port)
        with ThreadPoolExecutor(1) as pool:
            meanwhile = pool.submit(pair.check_serving)
            d, p = d_leg.result(), p_leg.result()
            meanwhile.result(60)  # the matching decode was served all along
        assert_within(d, DECODE_DEADLINE_S)
        assert_clear_error(d, "rejected", "kv_dtype", "float32", "bfloat16")
        assert d.status == 502, d
        assert_clear_error(p, "decode aborted", "rejected", "kv_dtype", "float32", "bfloat16")
        assert p.elapsed_s < TRANSFER_WAIT_S, p  # ended by the decode's word, not by the prefill's deadline
        assert counter(metrics(pair.prefill), "kvferry_registrations_total", result="rejected") == \
            counter(before, "kvferry_registrations_total", result="rejected") + 1
        wait_pages(wrong, wrong_pages, 5, "decode with bfloat16 KV")
        pair.wait_pages()
        pair.check_serving()
    finally:
        wrong.stop(20)


def test_tokenizer_mismatch(healthy):
    """The two legs of one room carry prompts of different lengths (as two tokenizers would make):
    the prefill refuses the transfer naming both counts, and both clients hear it."""
    pair = healthy
    room = new_room()
    p_leg = _leg("prefill", pair.prefill, prompt(20, seed=52), room, pair.prefill.bootstrap_port)
    d_leg = _leg("decode", pair.decode, prompt(24, seed=52), room, pair.prefill.bootstrap_port)
    p, d = p_leg.result(), d_leg.result()
    for leg in (p, d):
        assert_clear_error(leg, "num_prompt_tokens", "20", "24", "tokenizer")
    assert_within(p, PREFILL_DEADLINE_S)
    assert_within(d, DECODE_DEADLINE_S)
    pair.wait_pages()
    pair.check_serving()


def test_duplicate_rooms(healthy):
    """Two requests (different prompts) share one room. The second claim on each side is refused
    with a message that says so; whatever pairs up either succeeds with the right output for its
    prompt or fails cleanly; no page leaks.

    Both prefill legs go first and the decode legs once one of them has ended: a prefill leg cannot
    end well before a decode asks for its room, so the second open finds the room in use however
    slowly this machine runs. (Sent all four at once, a loaded machine served one request's two
    legs whole before the other's arrived, and a room id used again after its room closed is no
    conflict.)"""
    pair = healthy
    room = new_room()
    prompts = {"a": prompt(30, seed=53), "b": prompt(45, seed=54)}
    want = {k: pair.reference(ids) for k, ids in prompts.items()}
    legs = {("prefill", k): _leg("prefill", pair.prefill, ids, room, pair.prefill.bootstrap_port)
            for k, ids in prompts.items()}
    until = time.monotonic() + TRANSFER_WAIT_S / 2  # the winner waits TRANSFER_WAIT_S for its decode
    while all(leg.thread.is_alive() for leg in legs.values()) and time.monotonic() < until:
        time.sleep(0.01)
    for k, ids in prompts.items():
        legs[("decode", k)] = _leg("decode", pair.decode, ids, room, pair.prefill.bootstrap_port)
    got = {key: leg.result() for key, leg in legs.items()}
    for (side, k), leg in got.items():
        assert_within(leg, PREFILL_DEADLINE_S if side == "prefill" else DECODE_DEADLINE_S)
        assert_answered(leg)
        if side == "decode" and leg.is_ok:
            assert leg.answer["output_ids"] == want[k]
    refusals = [leg for leg in got.values() if not leg.is_ok and ("already in use" in leg.message
                                                                 or "duplicate transfer" in leg.message)]
    assert refusals, got
    pair.wait_pages()
    pair.check_serving()
