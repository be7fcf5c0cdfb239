"""kill -9 of the prefill or the decode before, during and after a room's KV transfer, then a
restart of the killed daemon at the same ports.

Each phase is reached by what the prefill logs about the room (tests.cluster.ROOM_EVENTS), not by
sleeping. "During": the decode's transfer request is held at the prefill and the room has just
opened with it, so the prefill is in the forward of a long prompt, after which the WRITE (which
takes microseconds on loopback) follows at once; the kill lands before the prefill can answer.
"""

from __future__ import annotations

import time

from kvferry.common.daemon.procs import http_json
from tests.cluster import LogWatch, room_event
from tests.faults.harness import (
    DECODE_DEADLINE_S, PREFILL_DEADLINE_S, SLACK_S, XFER_S, Pending, assert_clear_error, assert_within, body,
    boot, counter, metrics, new_room, prompt,
)

LONG_PROMPT = prompt(3000, seed=11)


def _prefill_id(pair) -> str:
    return http_json(pair.prefill.url + "/server_info", timeout_s=10)[1]["prefill_id"]


def _decode_leg(pair, ids, room, max_new_tokens=4) -> Pending:
    payload = {**body(ids, max_new_tokens), **boot(pair.prefill.bootstrap_port, room)}
    return Pending("decode", pair.decode.url + "/generate", payload)


def _prefill_leg(pair, ids, room, max_new_tokens=4) -> Pending:
    payload = {**body(ids, max_new_tokens), **boot(pair.prefill.bootstrap_port, room)}
    return Pending("prefill", pair.prefill.url + "/generate", payload)


def _restart_prefill(pair) -> None:
    old_id = _prefill_id(pair) if pair.prefill.is_alive() else None
    pair.restart(pair.prefill)
    assert _prefill_id(pair) != old_id
    pair.wait_pages()
    pair.serve_soon()


def _in_forward(pair, ids, room) -> tuple[Pending, Pending]:
    """Both legs of ``room``, returned once the prefill holds the decode's transfer request and has
    opened the room with it: the room's forward is running; its WRITE follows it."""
    watch = LogWatch(pair.prefill)
    d_leg = _decode_leg(pair, ids, room)
    room_event(watch, room, "held", unless=d_leg.thread)
    p_leg = _prefill_leg(pair, ids, room)
    room_event(watch, room, "opened_with_transfer", unless=p_leg.thread)
    return p_leg, d_leg


def test_kill_prefill_before_transfer(healthy):
    """The decode's transfer request waits at the prefill for the room's prefill leg, which never
    comes: the prefill dies. The decode notices (heartbeats) and answers within its deadline."""
    pair = healthy
    pair.reference(prompt(24, seed=7))
    room, watch = new_room(), LogWatch(pair.prefill)
    leg = _decode_leg(pair, prompt(40, seed=1), room)
    room_event(watch, room, "held", unless=leg.thread)
    pair.kill(pair.prefill)
    d = leg.result()
    assert_within(d, DECODE_DEADLINE_S)
    assert_clear_error(d, "room")
    _restart_prefill(pair)


def test_kill_prefill_during_transfer(healthy):
    """Killed in the room's forward: the prefill leg gets no answer at all; the decode finds the
    prefill gone and answers within its deadline."""
    pair = healthy
    pair.reference(prompt(24, seed=7))
    p_leg, d_leg = _in_forward(pair, LONG_PROMPT, new_room())
    pair.kill(pair.prefill)
    p, d = p_leg.result(), d_leg.result()
    assert p.status is None, p  # killed under the request
    assert_within(d, DECODE_DEADLINE_S)
    assert_clear_error(d, "room")
    _restart_prefill(pair)


def test_kill_prefill_after_transfer(healthy):
    """Once the KV has landed the decode no longer needs the prefill: generation completes."""
    pair = healthy
    ids = prompt(64, seed=3)
    want = pair.reference(ids, max_new_tokens=120)
    room = new_room()
    p_leg, d_leg = _prefill_leg(pair, ids, room, 120), _decode_leg(pair, ids, room, 120)
    p = p_leg.result()
    assert p.is_ok, p
    pair.kill(pair.prefill)
    d = d_leg.result()
    assert d.is_ok, d
    assert d.answer["output_ids"] == want
    _restart_prefill(pair)


def _restart_decode(pair) -> None:
    """A restarted decode has a new decode_id and agent: the prefill drops the stale agent (its
    heartbeats stopped) and accepts a new registration with a new plan."""
    before = metrics(pair.prefill)
    old_id = http_json(pair.decode.url + "/server_info", timeout_s=10)[1]["decode_id"] \
        if pair.decode.is_alive() else None
    pair.restart(pair.decode)
    assert http_json(pair.decode.url + "/server_info", timeout_s=10)[1]["decode_id"] != old_id
    pair.wait_pages()
    pair.serve_soon()
    after = metrics(pair.prefill)
    assert counter(after, "kvferry_registrations_total", result="accepted") > \
        counter(before, "kvferry_registrations_total", result="accepted")
    deadline = time.monotonic() + 10
    while counter(metrics(pair.prefill), "kvferry_heartbeat_misses_total") <= \
            counter(before, "kvferry_heartbeat_misses_total"):
        assert time.monotonic() < deadline, "prefill never dropped the dead decode's agent"
        time.sleep(0.3)


def test_kill_decode_before_transfer(healthy):
    """The decode asks for the room, then dies before the prefill leg arrives: the prefill's WRITE
    (or its peer check) fails fast, the prefill answers with an error and frees the pages."""
    pair = healthy
    pair.reference(prompt(24, seed=7))
    ids, room, watch = prompt(40, seed=2), new_room(), LogWatch(pair.prefill)
    d_leg = _decode_leg(pair, ids, room)
    room_event(watch, room, "held", unless=d_leg.thread)
    pair.kill(pair.decode)
    d = d_leg.result()
    assert d.status is None, d
    p = _prefill_leg(pair, ids, room).result()
    assert_within(p, PREFILL_DEADLINE_S)
    assert_clear_error(p, "room")
    _restart_decode(pair)


def test_kill_decode_during_transfer(healthy):
    """Killed while the prefill runs the room's forward: the decode leg gets no answer; once the
    forward ends, the prefill's WRITE to the dead decode fails (or its heartbeat check drops the
    decode), and the prefill answers with an error within its WRITE deadline."""
    pair = healthy
    pair.reference(prompt(24, seed=7))
    room = new_room()
    watch = LogWatch(pair.prefill)
    p_leg, d_leg = _in_forward(pair, LONG_PROMPT, room)
    pair.kill(pair.decode)
    room_event(watch, room, "prefilled_with_transfer", unless=p_leg.thread)
    prefilled_at = time.monotonic()
    p, d = p_leg.result(), d_leg.result()
    assert d.status is None, d  # killed under the request
    assert time.monotonic() - prefilled_at <= XFER_S + SLACK_S, p
    assert_clear_error(p, "room")
    _restart_decode(pair)


def test_kill_decode_after_transfer(healthy):
    """Killed while it generates (the prefill has answered: the KV is there): the decode leg gets
    no answer; the prefill is not involved any more."""
    pair = healthy
    ids = prompt(64, seed=4)
    pair.reference(prompt(24, seed=7))
    room = new_room()
    p_leg, d_leg = _prefill_leg(pair, ids, room, 400), _decode_leg(pair, ids, room, 400)
    p = p_leg.result()
    assert p.is_ok, p
    pair.kill(pair.decode)  # 400 decode steps are far from done when the prefill's answer is in
    d = d_leg.result()
    assert d.status is None, d
    _restart_decode(pair)
