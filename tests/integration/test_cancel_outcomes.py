"""Clients that hang up, through the real sglang-router: a cancel is its own outcome (issue 31).

Two requests run to their end (streamed chats; the one sent to the pair directly also checks
``continuous_usage_stats``, which sglang-router drops). Four streams are
left during decode, one while queued for a place in the decode's batch (``--max-running-requests
4`` with the four running; sent to the pair directly, see below), and four during the KV wait: the
prefill is held still (SIGSTOP) while their legs reach the decode, the clients leave, then it runs
again. Both daemons must count every
request under exactly one outcome, the cancels as ``cancelled``, with no failed transfer on either
side, and log each cancel at INFO with its phase. Heartbeat misses are raised so that the held
prefill is never declared lost: the case is a cancel, not a peer failure.
"""

from __future__ import annotations

import http.client
import json
import random
import signal
import socket
import struct
import threading
import time

import pytest

from kvferry.common.api.outcome import OUTCOMES
from kvferry.common.daemon.procs import http_json
from tests.cluster import Cluster, assert_pages_return, ok, post
from tests.faults.harness import counter, metrics

pytestmark = pytest.mark.timeout(400)
WAIT_S = 90.0
LONG = 3000  # tokens a stream that its client leaves asks for
PROMPT = "The ferry leaves the north pier at seven"
LONG_BODY = {"text": PROMPT, "stream": True,
             "sampling_params": {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_models):
    c = Cluster(tmp_path_factory.mktemp("cancel-outcomes") / "logs", *tiny_models)
    c.env["KVFERRY_HEARTBEAT_MISSES"] = "2000"  # the held prefill must not look dead
    try:
        prefill = c.prefill()
        decode = c.decode(extra=["--max-running-requests", "4"])
        before = {p.name: _free(p) for p in (prefill, decode)}
        yield c, prefill, decode, c.router([prefill], [decode]), before
    finally:
        c.stop_all()


def _free(proc):
    from tests.cluster import free_pages

    return free_pages(proc)


class Stream:
    """A streamed /generate through the router, on a connection of its own that ``leave`` resets."""

    def __init__(self, url: str, **extra):
        host, port = url.split("//")[1].split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
        self.conn.request("POST", "/generate", json.dumps({**LONG_BODY, **extra}), {"Content-Type": "application/json"})

    def read_events(self, num: int) -> None:
        resp = self.conn.getresponse()
        assert resp.status == 200, resp.read()
        seen = 0
        for _ in range(10 * num + 100):  # bounded: a few lines per event
            line = resp.fp.readline()
            assert line, "stream ended early"
            if line.startswith(b"data: {"):
                assert b'"error"' not in line, line
                seen += 1
                if seen == num:
                    return
        raise AssertionError(f"fewer than {num} events")

    def leave(self) -> None:
        sock = self.conn.sock
        if sock is not None:  # RST: the router sees the client gone at once
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.conn.close()


def _chat_legs(prefill, decode, body: dict):
    """``body`` to both daemons at once with a fresh room, as sglang-router sends it; the decode's answer."""
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    leg = threading.Thread(target=http_json, args=(prefill.url + "/v1/chat/completions", {**body, **boot}),
                           kwargs={"timeout_s": WAIT_S})
    leg.start()
    try:
        return ok(post(decode.url + "/v1/chat/completions", {**body, **boot}, timeout_s=WAIT_S))
    finally:
        leg.join(WAIT_S)


def outcomes(proc) -> dict[str, float]:
    values = metrics(proc)
    return {name: counter(values, "kvferry_requests_total", outcome=name) for name in OUTCOMES}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def wait_for(what: str, check, *procs) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S}s; " + \
            "; ".join(f"{p.name}: {outcomes(p)}" for p in procs)
        time.sleep(0.2)


ESTABLISHED, CLOSE_WAIT = "01", "08"  # /proc/net/tcp connection states


def unread_connections(port: int, state: str = ESTABLISHED) -> int:
    """Connections to local ``port`` in ``state`` holding bytes its (held still) process has not
    read: the router's requests, sent (ESTABLISHED), or sent and then closed by the router because
    their client left (CLOSE_WAIT). From /proc/net/tcp: local address, state, rx queue."""
    count = 0
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            local, conn_state, queues = fields[1], fields[3], fields[4]
            if int(local.split(":")[1], 16) == port and conn_state == state and int(queues.split(":")[1], 16) > 0:
                count += 1
    return count


def gauge(proc, name: str) -> float:
    return counter(metrics(proc), name)


def _cancel_lines(proc, offset: int) -> list[str]:
    text = proc.log_path.read_text(errors="replace")[offset:]
    return [line for line in text.splitlines() if "request cancelled request_id=" in line]


def test_every_request_ends_in_one_outcome_and_cancels_are_no_failures(pd):
    c, prefill, decode, router, free_before = pd
    procs = {"prefill": prefill, "decode": decode}
    start = {n: outcomes(p) for n, p in procs.items()}
    failed_before = {n: counter(metrics(p), "kvferry_failed_transfers_total") for n, p in procs.items()}
    log_at = {n: p.log_path.stat().st_size for n, p in procs.items()}

    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert ok(post(router.url + "/v1/chat/completions", chat)).events()[-1]["usage"]["completion_tokens"] == 6
    # sglang-router 0.3.2 drops continuous_usage_stats (its stream_options know include_usage only):
    # the pair's own answer carries it, one leg to each daemon as a router sends them
    events = _chat_legs(prefill, decode, chat).events()
    running = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert running == sorted(running) and running[-1] == 6 and events[-1]["usage"]["completion_tokens"] == 6, events

    decoding = [Stream(router.url) for _ in range(4)]
    for s in decoding:
        s.read_events(3)
    # Its KV arrives, then it waits: the four hold every running place. Sent to the pair directly:
    # sglang-router notices a client gone only when it next writes to it, which a queued stream never does.
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    leg = threading.Thread(target=http_json, args=(prefill.url + "/generate", {**LONG_BODY, **boot}))
    leg.start()
    queued = Stream(decode.url, **boot)
    queued.read_events(1)  # the prefill's first token; the rest waits for a place in the batch
    wait_for("a fifth request waiting in the decode's batch", lambda: gauge(decode, "kvferry_requests_running") >= 5)
    queued.leave()
    leg.join(WAIT_S)
    wait_for("the queued request's cancel", lambda: outcomes(decode)["cancelled"] - start["decode"]["cancelled"] >= 1,
             prefill, decode)
    for s in decoding:
        s.leave()
    wait_for("five cancels on the decode", lambda: outcomes(decode)["cancelled"] - start["decode"]["cancelled"] >= 5,
             prefill, decode)

    prefill.signal(signal.SIGSTOP)
    try:
        waiting = [Stream(router.url) for _ in range(4)]
        wait_for("four rooms waiting for KV", lambda: gauge(decode, "kvferry_rooms_waiting") >= 4)
        for s in waiting:
            s.leave()
        wait_for("nine cancels on the decode",
                 lambda: outcomes(decode)["cancelled"] - start["decode"]["cancelled"] >= 9)
    finally:
        prefill.signal(signal.SIGCONT)

    wait_for("eleven outcomes on the prefill",
             lambda: sum(outcomes(prefill).values()) - sum(start["prefill"].values()) >= 11)
    assert_pages_return([prefill, decode], free_before, timeout_s=WAIT_S)
    moved = {n: delta(outcomes(p), start[n]) for n, p in procs.items()}
    # the prefill's legs of the decode-phase and queued cancels had finished: their KV was written
    assert moved == {"decode": {"ok": 2, "cancelled": 9}, "prefill": {"ok": 7, "cancelled": 4}}, moved
    for n, p in procs.items():
        assert counter(metrics(p), "kvferry_failed_transfers_total") == failed_before[n], n
    phases = [line.split("phase=")[1].split(":")[0].split()[0] for line in _cancel_lines(decode, log_at["decode"])]
    assert sorted(phases) == ["decode"] * 4 + ["kv_wait"] * 4 + ["queued"], phases
    assert all(" INFO " in line for line in _cancel_lines(decode, log_at["decode"]))


def test_through_vllm_router_cancels_are_counted_on_the_daemons_that_saw_them(pd):
    """vllm-router calls the prefill first and the decode after its answer: a client that leaves
    during the prefill (held still) is a cancel on the prefill only, one that leaves during decode
    a cancel on the decode, whose prefill leg had ended ok. No failed transfer either side."""
    c, prefill, decode, _, free_before = pd
    router = c.vllm_router([prefill], [decode])
    procs = {"prefill": prefill, "decode": decode}
    start = {n: outcomes(p) for n, p in procs.items()}
    failed_before = {n: counter(metrics(p), "kvferry_failed_transfers_total") for n, p in procs.items()}
    ok(post(router.url + "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}))
    decoding = [Stream(router.url) for _ in range(2)]
    for s in decoding:
        s.read_events(3)
    for s in decoding:
        s.leave()
    wait_for("two cancels on the decode", lambda: outcomes(decode)["cancelled"] - start["decode"]["cancelled"] >= 2,
             prefill, decode)
    prefill.signal(signal.SIGSTOP)
    try:
        prefilling = [Stream(router.url) for _ in range(2)]
        port = int(prefill.url.rsplit(":", 1)[1])
        wait_for("the router's two prefill legs sent", lambda: unread_connections(port) >= 2)
        for s in prefilling:
            s.leave()
        # resumed only once the router has closed both legs, so the prefill sees its clients gone
        # (a prefill resumed first could answer before the close arrives: ok instead of cancelled)
        wait_for("the router's two prefill legs closed", lambda: unread_connections(port, CLOSE_WAIT) >= 2)
    finally:
        prefill.signal(signal.SIGCONT)
    wait_for("five outcomes on the prefill",
             lambda: sum(outcomes(prefill).values()) - sum(start["prefill"].values()) >= 5, prefill, decode)
    assert_pages_return([prefill, decode], free_before, timeout_s=WAIT_S)
    moved = {n: delta(outcomes(p), start[n]) for n, p in procs.items()}
    assert moved == {"decode": {"ok": 1, "cancelled": 2}, "prefill": {"ok": 3, "cancelled": 2}}, moved
    for n, p in procs.items():
        assert counter(metrics(p), "kvferry_failed_transfers_total") == failed_before[n], n
