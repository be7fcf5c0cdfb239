"""Legs that lose their partner: router retries (sglang-router answers a 5xx by retrying with a new
room, leaving the first room's other leg orphaned) and clients that disconnect, mid-wait or in the
middle of a stream. Orphans end within their deadline and every page comes back.
"""

from __future__ import annotations

import http.client
import json

from tests.cluster import LogWatch, room_event
from tests.faults.harness import (
    DECODE_DEADLINE_S, PREFILL_DEADLINE_S, TRANSFER_WAIT_S, Pending, abandon, assert_clear_error, assert_within,
    body, boot, counter, metrics, new_room, prompt, wait_pages,
)


def _released_by_timer(decode_watch: LogWatch, room: int) -> bool:
    """Whether the decode let ``room``'s held pages go because its hold time passed (it logs
    that), rather than because the prefill confirmed that nothing more will be written."""
    return decode_watch.has(rf"room={room}: quarantine over")


NUM_STREAMED = 2000  # tokens a stream asks for; its client leaves after three events


def _leg(name: str, proc, ids, room, port, max_new_tokens=4) -> Pending:
    return Pending(name, proc.url + "/generate", {**body(ids, max_new_tokens), **boot(port, room)})


def test_retry_orphans_decode_leg(healthy):
    """Room A's decode leg is sent, its prefill leg never is; the router retries with room B."""
    pair = healthy
    ids = prompt(40, seed=41)
    want = pair.reference(ids)
    orphan = _leg("decode", pair.decode, ids, new_room(), pair.prefill.bootstrap_port)
    p, d = pair.send(ids)
    assert p.is_ok and d.is_ok and d.answer["output_ids"] == want, (p, d)
    a = orphan.result()
    assert_within(a, DECODE_DEADLINE_S)
    assert_clear_error(a, "did not arrive")
    pair.wait_pages()
    pair.check_serving()


def test_retry_orphans_prefill_leg(healthy):
    """Room A's prefill leg is sent, its decode leg never is; the router retries with room B."""
    pair = healthy
    ids = prompt(40, seed=42)
    want = pair.reference(ids)
    orphan = _leg("prefill", pair.prefill, ids, new_room(), pair.prefill.bootstrap_port)
    p, d = pair.send(ids)
    assert p.is_ok and d.is_ok and d.answer["output_ids"] == want, (p, d)
    a = orphan.result()
    assert_within(a, PREFILL_DEADLINE_S)
    assert_clear_error(a, "no transfer request")
    pair.wait_pages()
    pair.check_serving()


def test_router_drops_decode_leg(healthy):
    """The router gives up on room A's decode leg (closes the connection) before room A's prefill
    leg arrives. The decode aborts the room at once; the prefill remembers that, so its late leg
    for A fails at once with the decode's reason (not at its transfer deadline, holding pages)."""
    pair = healthy
    ids, room = prompt(40, seed=43), new_room()
    before = metrics(pair.prefill)
    payload = {**body(ids), **boot(pair.prefill.bootstrap_port, room)}
    prefill_log, decode_log = LogWatch(pair.prefill), LogWatch(pair.decode)
    abandon(pair.decode.url + "/generate", payload, until=lambda: room_event(prefill_log, room, "held"))
    wait_pages(pair.decode, pair.baseline["decode"], name="decode")
    assert not _released_by_timer(decode_log, room), "the decode's pages came back by its hold timer"
    late = _leg("prefill", pair.prefill, ids, room, pair.prefill.bootstrap_port).result()
    assert_clear_error(late, "decode aborted", "client disconnected")
    assert late.elapsed_s < TRANSFER_WAIT_S, late  # ended by the remembered abort, not by the deadline
    assert counter(metrics(pair.prefill), "kvferry_aborts_total", side="decode") > \
        counter(before, "kvferry_aborts_total", side="decode")
    pair.wait_pages()
    pair.check_serving()


def test_router_drops_prefill_leg(healthy):
    """The router gives up on room A's prefill leg while it waits for its decode: its pages go back
    at once, not at the transfer deadline."""
    pair = healthy
    ids, room = prompt(40, seed=44), new_room()
    payload = {**body(ids), **boot(pair.prefill.bootstrap_port, room)}
    before, watch = metrics(pair.prefill), LogWatch(pair.prefill)
    abandon(pair.prefill.url + "/generate", payload, until=lambda: room_event(watch, room, "prefilled_waiting"))
    wait_pages(pair.prefill, pair.baseline["prefill"], name="prefill")
    # Freed by the disconnect: the room's transfer wait never expired.
    assert counter(metrics(pair.prefill), "kvferry_timeouts_total", stage="wait_transfer") == \
        counter(before, "kvferry_timeouts_total", stage="wait_transfer")
    pair.wait_pages()
    pair.check_serving()


def _stream(url: str, payload: dict, num_events: int) -> list[dict]:
    """POST a streaming request, read ``num_events`` SSE events, then hang up."""
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    conn.request("POST", "/generate", json.dumps({**payload, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    events = []
    while len(events) < num_events:
        line = resp.fp.readline()
        assert line, "stream ended early"
        if line.startswith(b"data: {"):
            events.append(json.loads(line[6:]))
    conn.close()
    return events


def test_client_disconnects_mid_stream(healthy):
    """The client leaves a long decode stream after a few tokens: the decode stops generating for it
    and frees its pages; the prefill had freed its own after the WRITE."""
    pair = healthy
    ids, room = prompt(40, seed=45), new_room()
    before = metrics(pair.decode)
    p_leg = _leg("prefill", pair.prefill, ids, room, pair.prefill.bootstrap_port, NUM_STREAMED)
    payload = {**body(ids, NUM_STREAMED), **boot(pair.prefill.bootstrap_port, room)}
    events = _stream(pair.decode.url, payload, 3)
    assert all("error" not in e for e in events), events
    assert p_leg.result().is_ok
    pair.wait_pages()
    # Stopped, not finished: far fewer tokens than asked for were generated.
    generated = counter(metrics(pair.decode), "kvferry_generated_tokens_total") - \
        counter(before, "kvferry_generated_tokens_total")
    assert generated < NUM_STREAMED // 2, generated
    pair.check_serving()


def test_client_disconnects_while_waiting_for_kv(healthy):
    """The client of a stream leaves before the first token (its KV never came): the room is
    aborted and the pages come back as soon as the prefill confirms."""
    pair = healthy
    ids, room = prompt(40, seed=46), new_room()
    payload = {**body(ids), **boot(pair.prefill.bootstrap_port, room), "stream": True}
    prefill_log, decode_log = LogWatch(pair.prefill), LogWatch(pair.decode)
    abandon(pair.decode.url + "/generate", payload, until=lambda: room_event(prefill_log, room, "held"))
    wait_pages(pair.decode, pair.baseline["decode"], name="decode")
    assert not _released_by_timer(decode_log, room), "the decode's pages came back by its hold timer"
    pair.wait_pages()
    pair.check_serving()
