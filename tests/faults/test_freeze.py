"""SIGSTOP a peer for longer than every deadline, then SIGCONT it.

A frozen peer is what NIXL never reports: the other side must notice through its own deadlines
and heartbeats, answer its clients in time, and — the subtle part — never hand out pages that the
frozen prefill may still WRITE into once it wakes up.
"""

from __future__ import annotations

import signal
import time

from tests.faults.harness import (
    DECODE_DEADLINE_S, PREFILL_DEADLINE_S, PREFILL_FLAGS, Pending, Leg, assert_answered,
    assert_clear_error, assert_within, body, boot, counter, metrics, new_room, prompt, wait_pages,
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
    assert time.monotonic() - thawed_at <= PREFILL_DEADLINE_S + 2.0, p
    assert_clear_error(p, "room")
    pair.wait_pages()
    pair.serve_soon()
    after = {"prefill": metrics(pair.prefill), "decode": metrics(pair.decode)}
    # The decode saw the silence and aborted; the prefill read the abort and failed the room.
    # (Timeouts are counted in the proxy's drop case; labelled series appear on first use.)
    assert "kvferry_stale_notifications_total" in after["decode"]
    for side, name, labels in (("decode", "kvferry_heartbeat_misses_total", {}),
                               ("decode", "kvferry_aborts_total", {"side": "decode"}),
                               ("prefill", "kvferry_aborts_total", {"side": "decode"}),
                               ("prefill", "kvferry_failed_transfers_total", {})):
        assert counter(after[side], name, **labels) > counter(before[side], name, **labels), (side, name)
    # The prefill's own stall is not the decode's silence: thawed, it read the queued pings
    # instead of dropping the decode.
    assert counter(after["prefill"], "kvferry_heartbeat_misses_total") == \
        counter(before["prefill"], "kvferry_heartbeat_misses_total")


def test_freeze_decode(healthy):
    """The decode freezes after asking for the KV: the prefill's WRITE (or its wait) hits its
    deadline, it answers with an error and frees its pages; the thawed decode answers its client,
    re-registers, and serves."""
    pair = healthy
    pair.reference(prompt(24, seed=7))
    room, ids = new_room(), prompt(40, seed=6)
    d_leg = _leg("decode", pair.decode, ids, room, pair.prefill.bootstrap_port)
    time.sleep(0.3)  # the transfer request is at the prefill, waiting for the room
    pair.freeze(pair.decode)
    p = _leg("prefill", pair.prefill, ids, room, pair.prefill.bootstrap_port).result()
    assert_within(p, PREFILL_DEADLINE_S)
    assert_answered(p)
    wait_pages(pair.prefill, pair.baseline["prefill"], 10, "prefill")
    time.sleep(max(0.0, FREEZE_S - p.elapsed_s))
    pair.thaw(pair.decode)
    d = d_leg.result()
    assert_answered(d)
    pair.wait_pages()
    pair.serve_soon()


def test_no_late_write_into_reused_pages(healthy):
    """A prefill frozen while it holds a decode's transfer request must not WRITE into pages the
    decode has handed to another request once it wakes.

    Prefill A (patient: a 30 s transfer wait, and 30 s before it gives up on a silent decode)
    holds room R when it freezes; the decode's request for R arrives, times out and is aborted.
    While A is still frozen the decode serves request C through prefill B, on the lowest free
    pages — R's pages if the decode let them go. Then A thaws with R's transfer request (and the
    abort after it) in its queue. C's output must equal its reference."""
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
    p_leg = _leg("prefill", slow, ids_r, room, slow.bootstrap_port)
    time.sleep(0.5)  # room R is prefilled and waiting for its transfer request
    slow.signal(signal.SIGSTOP)
    d = _leg("decode", pair.decode, ids_r, room, slow.bootstrap_port).result()
    assert_within(d, DECODE_DEADLINE_S)
    assert_clear_error(d, "room")
    time.sleep(6.0)  # past the decode's quarantine of R's pages
    c_room = new_room()
    c_p = _leg("prefill", pair.prefill, ids_c, c_room, pair.prefill.bootstrap_port, 300)
    c_d = _leg("decode", pair.decode, ids_c, c_room, pair.prefill.bootstrap_port, 300)
    assert c_p.result().is_ok
    slow.signal(signal.SIGCONT)  # A finds R's transfer request in its queue
    c: Leg = c_d.result()
    p = p_leg.result()
    assert_answered(p)
    assert c.is_ok, c
    assert c.answer["output_ids"] == want_c, "a late WRITE from the thawed prefill corrupted another request's KV"
    pair.wait_pages()
