"""SIGSTOP a peer for longer than every deadline, then SIGCONT it.

A frozen peer is what NIXL never reports: the other side must notice through its own deadlines
and heartbeats, answer its clients in time, and — the subtle part — never hand out pages that the
frozen prefill may still WRITE into once it wakes up.
"""

from __future__ import annotations

import signal
import time

from tests.cluster import LogWatch, room_event
from tests.faults.harness import (
    DECODE_DEADLINE_S, HEARTBEAT_MISSES, PREFILL_DEADLINE_S, PREFILL_FLAGS, QUARANTINE_S, SLACK_S, AtLeast, Leg,
    Pending, assert_answered, assert_clear_error, assert_within, body, boot, failure_deltas, metrics, new_room,
    pages, prompt, wait_pages,
)

FREEZE_S = 6.0  # longer than the KV wait (3 s), the transfer wait (3 s) and the heartbeat limit (1.5 s)


def _leg(name: str, proc, ids, room, bootstrap_port, max_new_tokens=4) -> Pending:
    payload = {**body(ids, max_new_tokens), **boot(bootstrap_port, room)}
    return Pending(name, proc.url + "/generate", payload)


def test_freeze_prefill(healthy):
    """Both legs reach a frozen prefill. The decode gives up within its deadline; once thawed the
    prefill answers its (late) leg with an error, and both pools come back."""
    pair = healthy
    pair.reference(prompt(24, seed=7))
    before = {"prefill": metrics(pair.prefill), "decode": metrics(pair.decode)}
    pair.freeze(pair.prefill)
    frozen_at = time.monotonic()
    room, ids = new_room(), prompt(40, seed=5)
    d_leg = _leg("decode", pair.decode, ids, room, pair.prefill.bootstrap_port)
    p_leg = _leg("prefill", pair.prefill, ids, room, pair.prefill.bootstrap_port)
    d = d_leg.result()
    assert_within(d, DECODE_DEADLINE_S)
    assert_clear_error(d, "room")
    time.sleep(max(0.0, FREEZE_S - (time.monotonic() - frozen_at)))
    pair.thaw(pair.prefill)
    thawed_at = time.monotonic()
    p = p_leg.result()
    assert time.monotonic() - thawed_at <= PREFILL_DEADLINE_S + SLACK_S, p
    assert_clear_error(p, "room")
    pair.wait_pages()
    pair.serve_soon()
    after = {"prefill": metrics(pair.prefill), "decode": metrics(pair.decode)}
    # The decode found the prefill silent (one miss per ping while frozen), failed the room and
    # aborted it; the thawed prefill read the abort and failed the room without a WRITE, so no
    # notification came late. Its own stall is not the decode's silence: it read the queued
    # pings instead of dropping the decode (no heartbeat miss on the prefill).
    assert failure_deltas(before, after) == {
        'decode:kvferry_failed_transfers_total{reason="peer_lost"}': 1,
        'decode:kvferry_aborts_total{side="decode"}': 1,
        "decode:kvferry_heartbeat_misses_total": AtLeast(HEARTBEAT_MISSES),
        'prefill:kvferry_aborts_total{side="decode"}': 1,
        'prefill:kvferry_failed_transfers_total{reason="aborted"}': 1}


def test_freeze_decode(healthy):
    """The decode freezes once its transfer request is held at the prefill: the prefill's WRITE
    into the frozen decode hits its deadline (--xfer-timeout-s, shorter than the prefill's
    heartbeat limit), it answers with that error and frees its pages; the thawed decode answers
    its client with an error, re-registers, and serves."""
    pair = healthy
    pair.reference(prompt(24, seed=7))
    room, ids = new_room(), prompt(40, seed=6)
    watch = LogWatch(pair.prefill)
    d_leg = _leg("decode", pair.decode, ids, room, pair.prefill.bootstrap_port)
    room_event(watch, room, "held", unless=d_leg.thread)  # the transfer request waits for its room
    pair.freeze(pair.decode)
    p = _leg("prefill", pair.prefill, ids, room, pair.prefill.bootstrap_port).result()
    assert_within(p, PREFILL_DEADLINE_S)
    assert_clear_error(p, "room", "timed out", "frozen")
    wait_pages(pair.prefill, pair.baseline["prefill"], 10, "prefill")
    time.sleep(max(0.0, FREEZE_S - p.elapsed_s))
    pair.thaw(pair.decode)
    d = d_leg.result()
    assert_clear_error(d, "room")
    pair.wait_pages()
    pair.serve_soon()


def test_no_late_write_into_reused_pages(healthy):
    """A prefill frozen while it holds a decode's transfer request must not WRITE into pages the
    decode has handed to another request once it wakes.

    Prefill A (patient: a 30 s transfer wait, and 30 s before it gives up on a silent decode)
    holds room R, prefilled and waiting for its transfer request, when it freezes; the decode's
    request for R arrives, times out and is aborted. Past the decode's hold time the decode still
    holds R's pages (A could WRITE into them on waking). While A is still frozen the decode serves
    request C through prefill B, on the lowest free pages — R's pages if the decode let them go.
    Then A thaws with R's transfer request (and the abort after it) in its queue. C's output must
    equal its reference."""
    pair = healthy
    patient = ["--transfer-wait-timeout-s", "30", "--heartbeat-interval-s", "5"]
    slow = pair.cluster.prefill(extra=PREFILL_FLAGS + patient, start=False)
    pair.start(slow)
    try:
        _late_write_case(pair, slow)
    finally:
        slow.signal(signal.SIGCONT)  # in case an assertion left it frozen
        slow.stop(10)


def _late_write_case(pair, slow) -> None:
    ids_r, ids_c = prompt(64, seed=21), prompt(64, seed=22)
    want_c = pair.reference(ids_c, max_new_tokens=300)
    warm = new_room()  # the decode registers with A while A is awake
    warm_p = _leg("prefill", slow, ids_r, warm, slow.bootstrap_port)
    assert _leg("decode", pair.decode, ids_r, warm, slow.bootstrap_port).result().is_ok
    assert warm_p.result().is_ok
    room = new_room()
    watch = LogWatch(slow)
    p_leg = _leg("prefill", slow, ids_r, room, slow.bootstrap_port)
    room_event(watch, room, "prefilled_waiting", unless=p_leg.thread)  # R's WRITE can start at once
    slow.signal(signal.SIGSTOP)
    d = _leg("decode", pair.decode, ids_r, room, slow.bootstrap_port).result()
    assert_within(d, DECODE_DEADLINE_S)
    assert_clear_error(d, "room")
    time.sleep(QUARANTINE_S + 1.0)  # the decode's hold time for R's pages, and a sweep, pass
    assert pages(pair.decode) != pair.baseline["decode"], "the decode let go of pages a frozen prefill may fill"
    c_room = new_room()
    c_p = _leg("prefill", pair.prefill, ids_c, c_room, pair.prefill.bootstrap_port, 300)
    c_d = _leg("decode", pair.decode, ids_c, c_room, pair.prefill.bootstrap_port, 300)
    assert c_p.result().is_ok
    slow.signal(signal.SIGCONT)  # A finds R's transfer request in its queue
    c: Leg = c_d.result()
    p = p_leg.result()
    # R's own leg may end either way, both safe: thawed, A may start R's WRITE (into R's pages,
    # which the decode still holds) before it reads the abort queued behind the transfer request.
    assert_answered(p)
    assert c.is_ok, c
    assert c.answer["output_ids"] == want_c, "a late WRITE from the thawed prefill corrupted another request's KV"
    pair.wait_pages()
