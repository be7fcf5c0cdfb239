"""A staged room under faults: the fault rules of a direct WRITE hold for the staging slots too.

The pair stages every room (crossover 1, chunks of 128 KiB, so a room is several WRITEs). The decode
freezes while its transfer request waits at the prefill: the prefill's first chunk WRITE into the
frozen decode hits ``--xfer-timeout-s``, is cancelled, and the prefill fails the room and frees its
pages and its slot; the thawed decode hears the failure, frees the room's pages and its slot, and
serves the next room staged. A room aborted mid-transfer (a client that gives up) posts no chunk
WRITE after the abort: tests/unit/test_staging_paths.py
::test_a_staged_room_aborted_mid_transfer_posts_no_further_chunk, where the abort can be timed
between two chunks.
"""

from __future__ import annotations

import time

import pytest

from kvferry.common.daemon.procs import http_json
from tests.cluster import Cluster, LogWatch, room_event
from tests.faults.harness import (PREFILL_DEADLINE_S, Pair, Pending, assert_clear_error, assert_within, body, boot,
                                  metrics, new_room, prompt, wait_pages)

PREFILL = ["--staging-bytes", str(1 << 20), "--staging-chunk-bytes", str(128 << 10), "--staging-crossover-runs", "1"]
DECODE = ["--staging-bytes", str(16 << 20)]
FREEZE_S = 6.0


@pytest.fixture(scope="module")
def staged_pair(tmp_path_factory, tiny_models):
    c = Cluster(tmp_path_factory.mktemp("staging-faults") / "logs", *tiny_models)
    try:
        yield Pair.launch(c, prefill_extra=PREFILL, decode_extra=DECODE)
    finally:
        c.stop_all()


def _slots(proc) -> tuple[int, int, int]:
    status, info = http_json(proc.url + "/server_info", timeout_s=10)
    assert status == 200, info
    s = info["staging"]
    return s["slots"], s["slots_free"], s["slots_quarantined"]


def _staged(proc) -> float:
    return metrics(proc).get('kvferry_staging_rooms_total{path="staged",reason=""}', 0.0)


def _wait_slots_free(proc, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        total, free, quarantined = _slots(proc)
        if free == total and quarantined == 0:
            return
        assert time.monotonic() < deadline, f"{proc.name}: {free} of {total} staging slots free, {quarantined} quarantined"
        time.sleep(0.1)


def test_frozen_decode_fails_the_staged_room_and_every_slot_comes_back(staged_pair):
    pair = staged_pair
    staged_before = _staged(pair.prefill)
    p, d = pair.send(prompt(300, seed=3))  # one staged room end to end first
    assert p.is_ok and d.is_ok, (p, d)
    assert _staged(pair.prefill) > staged_before, {k: v for k, v in metrics(pair.prefill).items() if "staging" in k}
    room, ids = new_room(), prompt(400, seed=8)
    watch = LogWatch(pair.prefill)
    d_leg = Pending("decode", pair.decode.url + "/generate", {**body(ids), **boot(pair.prefill.bootstrap_port, room)})
    room_event(watch, room, "held", unless=d_leg.thread)  # the transfer request (with its slot) waits
    pair.freeze(pair.decode)
    try:
        p = Pending("prefill", pair.prefill.url + "/generate",
                    {**body(ids), **boot(pair.prefill.bootstrap_port, room)}).result()
        assert_within(p, PREFILL_DEADLINE_S)
        assert_clear_error(p, "room", "staged WRITE", "timed out")
        wait_pages(pair.prefill, pair.baseline["prefill"], 10, "prefill")
        _wait_slots_free(pair.prefill)  # the cancelled chunk WRITE no longer reads the prefill's slot
        time.sleep(max(0.0, FREEZE_S - p.elapsed_s))
    finally:
        pair.thaw(pair.decode)
    d = d_leg.result()
    assert_clear_error(d, "room")
    pair.wait_pages()
    _wait_slots_free(pair.decode)
    pair.serve_soon()
    assert _staged(pair.prefill) > staged_before + 1  # the rooms after the fault were staged again
    _wait_slots_free(pair.prefill)
