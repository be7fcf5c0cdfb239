"""Control-plane faults through a ZeroMQ man in the middle: the decode uses the proxy's port as the
prefill's bootstrap port. Frames are dropped, delayed, duplicated or corrupted, in either direction.

Each case gets a fresh proxy, so the decode opens a fresh link (and registers) through it. The
proxies stay open (without a fault) until the module ends: the decode keeps pinging every link it
opened, and a closed proxy would add heartbeat misses to every later case's counters.
"""

from __future__ import annotations

import time

import pytest

from tests.faults.harness import (
    DECODE_DEADLINE_S, HEARTBEAT_MISSES, PREFILL_DEADLINE_S, AtLeast, assert_clear_error, assert_within,
    failure_deltas, metrics, prompt,
)
from tests.faults.zmq_proxy import TO_DECODE, TO_PREFILL, Fault, ZmqProxy


@pytest.fixture(scope="module")
def open_proxies():
    proxies: list[ZmqProxy] = []
    yield proxies
    for p in proxies:
        p.close()


@pytest.fixture
def proxy(healthy, open_proxies):
    p = ZmqProxy(healthy.prefill.bootstrap_port).start()
    open_proxies.append(p)
    yield p
    p.set_fault(None)


def _kinds(*names: str) -> frozenset[str]:
    return frozenset(names)


# (fault, warm up first, words in the decode's error, words in the prefill's error, how much each
# failure counter moves: "side:series" → amount; every series not named must stay where it was)
# The decode's wait for the KV timed out, it aborted the room, the prefill read the abort.
KV_LOST = {'decode:kvferry_timeouts_total{stage="wait_kv"}': 1, 'decode:kvferry_aborts_total{side="decode"}': 1,
           'decode:kvferry_failed_transfers_total{reason="timeout"}': 1,
           'prefill:kvferry_aborts_total{side="decode"}': 1,
           'prefill:kvferry_failed_transfers_total{reason="aborted"}': 1}
# The decode never heard its registration acknowledged: it gave up on the room and told the
# prefill (which had registered it, so the abort is the room's own decode's), whose leg ends at once.
ACK_LOST = {'decode:kvferry_timeouts_total{stage="register"}': 1, 'decode:kvferry_aborts_total{side="decode"}': 1,
            'decode:kvferry_failed_transfers_total{reason="timeout"}': 1,
            'prefill:kvferry_aborts_total{side="decode"}': 1,
            'prefill:kvferry_failed_transfers_total{reason="aborted"}': 1}
# The prefill went silent for the decode: the decode failed the room; the prefill's room waited
# out its transfer wait (the decode's transfer request and abort were still in the delay).
PREFILL_SILENT = {'decode:kvferry_failed_transfers_total{reason="peer_lost"}': 1,
                  'decode:kvferry_aborts_total{side="decode"}': 1,
                  'prefill:kvferry_timeouts_total{stage="wait_transfer"}': 1,
                  'prefill:kvferry_failed_transfers_total{reason="timeout"}': 1}
FAILING = {
    "drop_transfer": (Fault("drop", TO_PREFILL, _kinds("transfer"), count=1), True, ["did not arrive"],
                      ["decode aborted"], KV_LOST),
    "drop_register_ack": (Fault("drop", TO_DECODE, _kinds("register_ack"), count=1), False, ["registration"],
                          ["decode aborted", "registration"], ACK_LOST),
    "corrupt_transfer": (Fault("corrupt", TO_PREFILL, _kinds("transfer"), count=1), True, ["did not arrive"],
                         ["decode aborted"], {**KV_LOST, "prefill:kvferry_protocol_errors_total": 1,
                                              # the prefill's error answer to the corrupt frame
                                              "decode:kvferry_protocol_errors_total": 1}),
    "corrupt_register_ack": (Fault("corrupt", TO_DECODE, _kinds("register_ack"), count=1), False, ["registration"],
                             ["decode aborted", "registration"], {**ACK_LOST, "decode:kvferry_protocol_errors_total": 1}),
    # Everything toward the prefill 6 s late (order kept): past both waits and the heartbeat limits.
    # The decode counts every ping the delay swallows (at least HEARTBEAT_MISSES before it fails the
    # room; how many more depends on timing). The prefill does not drop the decode: the same
    # process also registered over its direct link, whose pings keep it alive there.
    "delay_past_deadlines": (Fault("delay", TO_PREFILL, None, delay_s=6.0), True, ["room"], ["no transfer request"],
                             {**PREFILL_SILENT, "decode:kvferry_heartbeat_misses_total": AtLeast(HEARTBEAT_MISSES)}),
}


@pytest.mark.parametrize("case", list(FAILING))
def test_fault_fails_cleanly(healthy, proxy, case):
    """The request under the fault fails on both legs within their deadlines, with errors that say
    what happened; the failure counters move by exactly what the fault causes; nothing crashes,
    both pools come back, and the next requests succeed."""
    pair = healthy
    fault, warm, decode_words, prefill_words, moves = FAILING[case]
    if warm:
        pair.check_serving(1, bootstrap_port=proxy.port)
    before = {"prefill": metrics(pair.prefill), "decode": metrics(pair.decode)}
    proxy.set_fault(fault)
    p, d = pair.send(prompt(30, seed=31), bootstrap_port=proxy.port)
    assert proxy.num_applied() >= 1, proxy.seen
    assert_within(d, DECODE_DEADLINE_S)
    assert_clear_error(d, *decode_words)
    assert_within(p, PREFILL_DEADLINE_S)
    assert_clear_error(p, *prefill_words)
    proxy.set_fault(None)
    pair.wait_pages()
    assert pair.prefill.is_alive() and pair.decode.is_alive()
    pair.serve_soon(bootstrap_port=proxy.port)
    after = {"prefill": metrics(pair.prefill), "decode": metrics(pair.decode)}
    moved = failure_deltas(before, after)
    assert moved == moves, moved


PASSING = {
    "delay_to_prefill": Fault("delay", TO_PREFILL, None, delay_s=0.3),
    "delay_to_decode": Fault("delay", TO_DECODE, None, delay_s=0.3),
    "duplicate_to_prefill": Fault("duplicate", TO_PREFILL),
    "duplicate_to_decode": Fault("duplicate", TO_DECODE),
}


@pytest.mark.parametrize("case", list(PASSING))
def test_fault_is_absorbed(healthy, proxy, case):
    """Short delays and duplicated frames (register, transfer, abort, ping and their answers)
    change nothing a client sees: every request succeeds with its usual output."""
    pair = healthy
    pair.check_serving(1, bootstrap_port=proxy.port)
    proxy.set_fault(PASSING[case])
    pair.check_serving(3, bootstrap_port=proxy.port)
    # the answers do not wait for every frame: a room's transfer_result may still be on its way to the
    # decode (it lands by its notification), so the frames the fault changed are counted until a deadline
    deadline = time.monotonic() + 10.0
    while proxy.num_applied() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proxy.num_applied() >= 2, proxy.seen
    proxy.set_fault(None)
    pair.wait_pages()
