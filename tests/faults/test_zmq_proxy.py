"""Control-plane faults through a ZeroMQ man in the middle: the decode uses the proxy's port as the
prefill's bootstrap port. Frames are dropped, delayed, duplicated or corrupted, in either direction.

Each case gets a fresh proxy, so the decode opens a fresh link (and registers) through it.
"""

from __future__ import annotations

import pytest

from tests.faults.harness import (
    DECODE_DEADLINE_S, FAILURE_COUNTERS, PREFILL_DEADLINE_S, assert_clear_error, assert_within, counter, metrics,
    prompt,
)
from tests.faults.zmq_proxy import TO_DECODE, TO_PREFILL, Fault, ZmqProxy


@pytest.fixture
def proxy(healthy):
    p = ZmqProxy(healthy.prefill.bootstrap_port).start()
    yield p
    p.close()


def _kinds(*names: str) -> frozenset[str]:
    return frozenset(names)


# (fault, warm up first, words in the decode's error, words in the prefill's error, counters that must grow)
FAILING = {
    "drop_transfer": (Fault("drop", TO_PREFILL, _kinds("transfer"), count=1), True, ["did not arrive"],
                      ["decode aborted"], [("decode", "kvferry_timeouts_total", {"stage": "wait_kv"}),
                                           ("decode", "kvferry_aborts_total", {"side": "decode"}),
                                           ("prefill", "kvferry_aborts_total", {"side": "decode"})]),
    "drop_register_ack": (Fault("drop", TO_DECODE, _kinds("register_ack"), count=1), False, ["registration"],
                          ["no transfer request"], [("prefill", "kvferry_timeouts_total", {"stage": "wait_transfer"})]),
    "corrupt_transfer": (Fault("corrupt", TO_PREFILL, _kinds("transfer"), count=1), True, ["did not arrive"],
                         ["decode aborted"], [("prefill", "kvferry_protocol_errors_total", {}),
                                              ("decode", "kvferry_protocol_errors_total", {})]),
    "corrupt_register_ack": (Fault("corrupt", TO_DECODE, _kinds("register_ack"), count=1), False, ["registration"],
                             ["no transfer request"], [("decode", "kvferry_protocol_errors_total", {})]),
    # Everything toward the prefill 6 s late (order kept): past both waits and the heartbeat limits.
    "delay_past_deadlines": (Fault("delay", TO_PREFILL, None, delay_s=6.0), True, ["room"],
                             ["no transfer request"], [("decode", "kvferry_heartbeat_misses_total", {}),
                                                      ("prefill", "kvferry_heartbeat_misses_total", {})]),
}


@pytest.mark.parametrize("case", list(FAILING))
def test_fault_fails_cleanly(healthy, proxy, case):
    """The request under the fault fails on both legs within their deadlines, with errors that say
    what happened; nothing crashes, both pools come back, and the next requests succeed."""
    pair = healthy
    fault, warm, decode_words, prefill_words, grows = FAILING[case]
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
    for side, name, labels in grows:
        assert counter(after[side], name, **labels) > counter(before[side], name, **labels), (side, name, labels)
    if case == "drop_transfer":  # a timeout, an abort and a failed room: every failure counter is on show
        names = {key.partition("{")[0] for side in after.values() for key in side}
        assert set(FAILURE_COUNTERS) <= names, set(FAILURE_COUNTERS) - names


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
    assert proxy.num_applied() >= 2, proxy.seen
    proxy.set_fault(None)
    pair.wait_pages()
