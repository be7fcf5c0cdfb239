"""What every fault case needs: a prefill/decode pair with short deadlines, legs sent from threads
and timed, bounded waits for free pages, /metrics parsing, and the four invariants.

The invariants (checked by each case): no leg waits longer than its deadline plus ``SLACK_S``; every
client gets an answer (a result, or an HTTP error whose message says what happened); free pages on
both sides return to their starting count; the next requests succeed with the same output as before
the fault.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import random
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvferry.common.daemon.procs import Proc, http_json
from tests.cluster import ORDER_EVENTS, SLACK_S, Cluster, LogWatch, assert_order_path, free_pages, room_event

KV_WAIT_S = 3.0        # decode: --kv-wait-timeout-s
# prefill: --transfer-wait-timeout-s. Longer than the decode's wait, so a decode that gives up is
# heard (its abort) before the prefill's own deadline: each case has one expected outcome.
TRANSFER_WAIT_S = 4.0
XFER_S = 2.0           # both: --xfer-timeout-s
REGISTER_S = 3.0       # both: --register-timeout-s
HEARTBEAT_S = 0.5
HEARTBEAT_MISSES = 3
QUARANTINE_S = max(2 * XFER_S, 5.0)  # decode holds pages of a room whose WRITE may still land
DECODE_DEADLINE_S = KV_WAIT_S
PREFILL_DEADLINE_S = TRANSFER_WAIT_S + XFER_S
PAGES_WAIT_S = QUARANTINE_S + KV_WAIT_S + 6.0  # bounded wait for pages to come back

COMMON_FLAGS = ["--xfer-timeout-s", str(XFER_S), "--register-timeout-s", str(REGISTER_S),
                "--heartbeat-interval-s", str(HEARTBEAT_S), "--heartbeat-misses", str(HEARTBEAT_MISSES),
                "--request-timeout-s", "30", "--max-total-tokens", "16384", "--drain-timeout-s", "2"]
PREFILL_FLAGS = COMMON_FLAGS + ["--transfer-wait-timeout-s", str(TRANSFER_WAIT_S)]
DECODE_FLAGS = COMMON_FLAGS + ["--kv-wait-timeout-s", str(KV_WAIT_S)]

FAILURE_COUNTERS = ("kvferry_failed_transfers_total", "kvferry_timeouts_total", "kvferry_aborts_total",
                    "kvferry_stale_notifications_total", "kvferry_heartbeat_misses_total")
COUNTED = FAILURE_COUNTERS + ("kvferry_protocol_errors_total",)  # what failure_deltas compares


def prompt(num_tokens: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(num_tokens)]


def body(ids: list[int], max_new_tokens: int = 4, **extra) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                  "ignore_eos": True}, **extra}


def new_room() -> int:
    return random.getrandbits(63)


@dataclass
class Leg:
    """One HTTP leg's outcome: ``status`` is None when the connection itself failed."""

    name: str
    status: int | None
    answer: object
    elapsed_s: float

    @property
    def is_ok(self) -> bool:
        return self.status == 200

    @property
    def message(self) -> str:
        if isinstance(self.answer, dict) and isinstance(self.answer.get("error"), dict):
            return str(self.answer["error"].get("message", ""))
        return str(self.answer)


_CLONE_NEWNET = 0x40000000


def enter_netns(name: str) -> None:
    """Move the calling thread (only it: network namespaces are per thread) into ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def call_in(proc: Proc, fn, *args, **kwargs):
    """``fn(*args)`` from the network namespace ``proc`` runs in (a fresh thread), else here."""
    netns = getattr(proc, "netns", None)
    if netns is None:
        return fn(*args, **kwargs)
    out: dict = {}

    def run() -> None:
        try:
            enter_netns(netns)
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller's thread below
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def wait_ready(proc: Proc, timeout_s: float = 180.0) -> None:
    if getattr(proc, "netns", None) is None:
        proc.wait_ready(timeout_s)
        return
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.is_alive(), f"{proc.name} exited before it was ready:\n{proc.tail()}"
        try:
            if call_in(proc, http_json, proc.url + "/health", timeout_s=2)[0] == 200:
                return
        except OSError:
            pass  # not listening yet
        assert time.monotonic() < deadline, f"{proc.name} not ready within {timeout_s}s:\n{proc.tail()}"
        time.sleep(0.1)


def post(name: str, url: str, payload: dict, timeout_s: float = 60.0) -> Leg:
    started = time.monotonic()
    try:
        status, answer = http_json(url, payload, timeout_s=timeout_s)
    except OSError as exc:  # the daemon died under the request: no HTTP answer at all
        status, answer = None, f"{type(exc).__name__}: {exc}"
    return Leg(name, status, answer, time.monotonic() - started)


class Pending:
    """A leg sent from a thread (inside ``netns`` when given); ``result()`` joins it."""

    def __init__(self, name: str, url: str, payload: dict, timeout_s: float = 60.0, netns: str | None = None):
        self._leg: Leg | None = None
        self._netns = netns
        self._thread = threading.Thread(target=self._run, args=(name, url, payload, timeout_s), daemon=True)
        self._thread.start()

    def _run(self, *args) -> None:
        if self._netns is not None:
            enter_netns(self._netns)
        self._leg = post(*args)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def result(self, timeout_s: float = 90.0) -> Leg:
        self._thread.join(timeout_s)
        assert self._leg is not None, f"leg did not end within {timeout_s}s"
        return self._leg


def boot(port: int, room: int, host: str = "127.0.0.1") -> dict:
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


def abandon(url: str, payload: dict, until) -> None:
    """Send a POST and close the connection, without reading the answer, once ``until()`` returns
    (it waits for the phase the leg must have reached: a router that gave up on this leg then)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", parts.path, json.dumps(payload), {"Content-Type": "application/json"})
    try:
        until()
    finally:
        conn.close()


class Pair:
    """One prefill and one decode with short deadlines, restartable at the same ports."""

    def __init__(self, cluster: Cluster, prefill: Proc, decode: Proc):
        """A pair of running daemons; ``baseline`` is their free pages now."""
        self.cluster, self.prefill, self.decode = cluster, prefill, decode
        self.bootstrap_host = "127.0.0.1"  # where the decode reaches the prefill's bootstrap port
        self.stopped: set[int] = set()
        self.baseline = {"prefill": pages(prefill), "decode": pages(decode)}
        self._references: dict[tuple, list[int]] = {}

    @classmethod
    def launch(cls, cluster: Cluster, *, prefill_extra: list[str] | None = None,
               decode_extra: list[str] | None = None) -> "Pair":
        prefill = cluster.prefill(extra=PREFILL_FLAGS + (prefill_extra or []), start=False)
        decode = cluster.decode(extra=DECODE_FLAGS + (decode_extra or []), start=False)
        cls.start(prefill, decode)
        pair = cls(cluster, prefill, decode)
        pair.warm_up()
        return pair

    def warm_up(self, timeout_s: float = 60.0) -> None:
        """One request through the pair, retried until it succeeds. A prefill's first registration
        waits for its NIXL probe process to import NIXL, which can outlast ``REGISTER_S`` on a busy
        machine; the cases start from a pair that has registered once."""
        deadline = time.monotonic() + timeout_s
        while True:
            p, d = self.send(prompt(8, seed=1), max_new_tokens=1, timeout_s=30)
            if p.is_ok and d.is_ok:
                break
            assert time.monotonic() < deadline, f"the new pair did not serve within {timeout_s}s: {p} {d}"
        self.wait_pages()

    @staticmethod
    def start(*procs: Proc) -> None:
        """Start processes at once (model loads overlap) and wait until each serves."""
        for p in procs:
            p.start()
        for p in procs:
            wait_ready(p)

    def kill(self, proc: Proc) -> None:
        proc.signal(signal.SIGKILL)
        proc.popen.wait(10)

    def freeze(self, proc: Proc) -> None:
        proc.signal(signal.SIGSTOP)
        self.stopped.add(proc.pid)

    def thaw(self, proc: Proc) -> None:
        proc.signal(signal.SIGCONT)
        self.stopped.discard(proc.pid)

    def restart(self, proc: Proc) -> None:
        if proc.is_alive():
            self.kill(proc)
        self.start(proc)

    def ensure_healthy(self) -> None:
        """Undo what an earlier case left behind (a frozen or dead daemon), then check the pools."""
        for proc in (self.prefill, self.decode):
            if proc.is_alive() and proc.pid in self.stopped:
                self.thaw(proc)
            if not proc.is_alive():
                self.start(proc)
        self.wait_pages()

    def wait_pages(self, timeout_s: float = PAGES_WAIT_S) -> None:
        for name, proc in (("prefill", self.prefill), ("decode", self.decode)):
            wait_pages(proc, self.baseline[name], timeout_s, name)

    # -- requests -------------------------------------------------------------------------------
    def send(self, ids: list[int], *, max_new_tokens: int = 4, room: int | None = None,
             order: str = "concurrent", bootstrap_port: int | None = None,
             timeout_s: float = 60.0) -> tuple[Leg, Leg]:
        """Both legs the way a router sends them; returns (prefill leg, decode leg). ``order`` as in
        ``tests.cluster.send_pair``: the second leg goes once the prefill logged the first's effect."""
        room = new_room() if room is None else room
        port = bootstrap_port or self.prefill.bootstrap_port
        payload = {**body(ids, max_new_tokens), **boot(port, room, self.bootstrap_host)}
        procs = {"prefill": self.prefill, "decode": self.decode}
        first = "decode" if order == "decode_first" else "prefill"
        second = "prefill" if first == "decode" else "decode"

        def leg(name: str) -> Pending:
            proc = procs[name]
            return Pending(name, proc.url + "/generate", payload, timeout_s, getattr(proc, "netns", None))

        watch = LogWatch(self.prefill)
        a = leg(first)
        if order != "concurrent":
            room_event(watch, room, ORDER_EVENTS[order][0], timeout_s=timeout_s, unless=a.thread)
        b = leg(second)
        got = {first: a.result(timeout_s + 30), second: b.result(timeout_s + 30)}
        if order != "concurrent":
            assert_order_path(watch, room, order)
        return got["prefill"], got["decode"]

    def reference(self, ids: list[int], max_new_tokens: int = 4, bootstrap_port: int | None = None) -> list[int]:
        """The output of ``ids`` on this healthy pair (computed once, before any fault)."""
        key = (tuple(ids), max_new_tokens)
        if key not in self._references:
            p, d = self.send(ids, max_new_tokens=max_new_tokens, bootstrap_port=bootstrap_port)
            assert p.is_ok and d.is_ok, (p, d)
            self._references[key] = d.answer["output_ids"]
        return self._references[key]

    def check_serving(self, num_requests: int = 3, bootstrap_port: int | None = None,
                      timeout_s: float = 30.0) -> None:
        """Invariant 4: fresh requests succeed with the output they had before the fault."""
        cases = [(prompt(20 + 7 * i, seed=100 + i), 4) for i in range(num_requests)]
        expected = [self.reference(ids, n, bootstrap_port) for ids, n in cases]
        with ThreadPoolExecutor(num_requests) as pool:
            results = list(pool.map(lambda c: self.send(c[0], max_new_tokens=c[1], bootstrap_port=bootstrap_port,
                                                        timeout_s=timeout_s), cases))
        for (p, d), want in zip(results, expected):
            assert p.is_ok, f"prefill leg after the fault: {p}"
            assert d.is_ok, f"decode leg after the fault: {d}"
            assert d.answer["output_ids"] == want

    def serve_soon(self, timeout_s: float = 20.0, bootstrap_port: int | None = None) -> None:
        """Invariant 4 where a link needs a moment to heal first (a restarted or thawed peer):
        retry single requests until one succeeds, then require a clean batch."""
        deadline = time.monotonic() + timeout_s
        ids = prompt(24, seed=7)
        want = self.reference(ids, bootstrap_port=bootstrap_port)
        while True:
            p, d = self.send(ids, bootstrap_port=bootstrap_port, timeout_s=15)
            if p.is_ok and d.is_ok:
                assert d.answer["output_ids"] == want
                break
            assert time.monotonic() < deadline, f"no success within {timeout_s}s after the fault: {p} {d}"
            time.sleep(0.5)
        self.wait_pages()
        self.check_serving(bootstrap_port=bootstrap_port)


def pages(proc: Proc) -> dict:
    """The daemon's free pages per model (/server_info)."""
    return call_in(proc, free_pages, proc)


def wait_pages(proc: Proc, expected: dict, timeout_s: float = PAGES_WAIT_S, name: str = "") -> None:
    """Poll /server_info until ``free_pages`` equals ``expected`` (quarantine may hold some)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = pages(proc)
        if got == expected:
            return
        assert time.monotonic() < deadline, \
            f"{name or proc.name}: free pages {got} did not return to {expected} within {timeout_s}s"
        time.sleep(0.2)


def assert_within(leg: Leg, deadline_s: float, slack_s: float = SLACK_S) -> None:
    assert leg.elapsed_s <= deadline_s + slack_s, \
        f"{leg.name} leg waited {leg.elapsed_s:.2f}s, deadline {deadline_s}s + {slack_s}s: {leg}"


def assert_clear_error(leg: Leg, *words: str) -> None:
    """Invariant 2 for a failed leg: an HTTP error status with a message naming what happened."""
    assert leg.status is not None and leg.status >= 400, f"{leg.name} leg should have failed: {leg}"
    message = leg.message.lower()
    assert len(message) > 20, f"{leg.name} leg error message too vague: {leg}"
    for word in words:
        assert word.lower() in message, f"{leg.name} leg error should mention {word!r}: {leg}"


def assert_answered(leg: Leg) -> None:
    """Invariant 2 for a leg that may have succeeded or failed: either way an HTTP answer."""
    if leg.is_ok:
        return
    assert_clear_error(leg)


def metrics(proc: Proc) -> dict[str, float]:
    """``name{labels}`` → value, from the daemon's Prometheus text."""
    status, text = call_in(proc, http_json, proc.url + "/metrics", timeout_s=10)
    assert status == 200, text
    out = {}
    for line in str(text).splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


@dataclass(frozen=True)
class AtLeast:
    """An expected counter move that depends on timing beyond a floor (pings missed while a
    fault lasts): equal to any amount >= ``amount``."""

    amount: float

    def __eq__(self, other) -> bool:
        return isinstance(other, (int, float)) and other >= self.amount


def failure_deltas(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, float]:
    """``side:series`` → how much each failure counter (``COUNTED``, every label set) moved
    between two snapshots ``{"prefill": metrics(...), "decode": metrics(...)}``; unmoved ones left out."""
    out = {}
    for side in after:
        for key, value in after[side].items():
            if key.partition("{")[0] in COUNTED and value != before[side].get(key, 0.0):
                out[f"{side}:{key}"] = value - before[side].get(key, 0.0)
    return out


def counter(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of ``name`` over the series whose labels include ``labels``."""
    total = 0.0
    for key, value in values.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total
