"""Restarts at the same address and ports (SIGTERM, then start again).

A restarted prefill has a new prefill_id and knows no decode: the decode registers again, on its
own, before its next transfer. A restarted decode has a new decode_id and NIXL agent: the prefill
accepts the new registration with a new plan and drops the stale agent once its heartbeats stop.
"""

from __future__ import annotations

import time

from kvferry.common.daemon.procs import http_json
from tests.faults.harness import DECODE_FLAGS, Pair, counter, metrics, wait_pages


def _info(proc) -> dict:
    status, info = http_json(proc.url + "/server_info", timeout_s=10)
    assert status == 200, info
    return info


def _restart(pair: Pair, proc) -> None:
    proc.stop(20)
    pair.start(proc)


def test_restart_prefill(healthy):
    """The very first requests after the restart succeed: the decode's link noticed the silence
    (or is told "not registered") and registers with the new process."""
    pair = healthy
    pair.check_serving()
    old_id = _info(pair.prefill)["prefill_id"]
    _restart(pair, pair.prefill)
    assert _info(pair.prefill)["prefill_id"] != old_id
    pair.check_serving()
    assert counter(metrics(pair.prefill), "kvferry_registrations_total", result="accepted") >= 1
    pair.wait_pages()


def test_restart_prefill_faster_than_heartbeats(healthy):
    """A decode with a long heartbeat limit (60 s: longer than a prefill restart takes on a loaded
    2-core machine, 16 s once) still sees its link as registered after the prefill came back; the
    new prefill answers its first transfer with "not registered", and the decode registers again
    and asks once more within the same deadline: no client sees an error."""
    pair = healthy
    patient = pair.cluster.decode(extra=DECODE_FLAGS + ["--heartbeat-misses", "120"], start=False)
    pair.start(patient)
    other = Pair(pair.cluster, pair.prefill, patient)
    try:
        other.check_serving()
        _restart(pair, pair.prefill)
        other.check_serving()
        assert _info(patient)["prefills"] == {f"127.0.0.1:{pair.prefill.bootstrap_port}": "registered"}
        assert "prefill forgot this decode; registering again" in patient.tail(20000)
        other.wait_pages()
    finally:
        patient.stop(20)


def test_restart_decode(healthy):
    pair = healthy
    pair.check_serving()
    before = metrics(pair.prefill)
    old_id = _info(pair.decode)["decode_id"]
    _restart(pair, pair.decode)
    assert _info(pair.decode)["decode_id"] != old_id
    pair.check_serving()
    after = metrics(pair.prefill)
    assert counter(after, "kvferry_registrations_total", result="accepted") == \
        counter(before, "kvferry_registrations_total", result="accepted") + 1
    # The old decode's agent goes once its heartbeats have been missing for the peer timeout.
    deadline = time.monotonic() + 10
    while counter(metrics(pair.prefill), "kvferry_heartbeat_misses_total") <= \
            counter(before, "kvferry_heartbeat_misses_total"):
        assert time.monotonic() < deadline, "the prefill kept the restarted decode's stale agent"
        time.sleep(0.3)
    pair.check_serving()
    wait_pages(pair.prefill, pair.baseline["prefill"])
    pair.wait_pages()
