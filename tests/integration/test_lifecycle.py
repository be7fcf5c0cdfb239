"""Daemon lifecycle with real signals: sd_notify readiness, the SIGTERM drain under load, and the
second SIGTERM that ends a long drain at once.

Each daemon runs with ``NOTIFY_SOCKET`` pointing at a datagram socket this test binds, as systemd's
would be. What is asserted:

- ``READY=1`` arrives only once the daemon serves: ``GET /health`` answers 200 at the moment it is
  received. ``STOPPING=1`` follows a SIGTERM.
- SIGTERM mid-load (to the decode, and in another case to the prefill): every request gets an
  answer within its deadlines, either the colocated engine's tokens or an error that says what
  happened; requests in flight at the signal finish (the drain); the daemon exits 0; the surviving
  side's free pages come back to their starting count.
- A second SIGTERM during a drain that would last a minute exits within seconds with status 1
  (``kvferry.common.daemon.lifecycle``: the forced exit skips the drain, so it does not report success).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from kvferry.common.daemon.procs import Proc, free_port, http_json
from kvferry.common.api.sampling_schema import sglang_params
from tests.cluster import ROOM_EVENTS, SLACK_S, LogWatch, free_pages, metric, post


class NotifySocket:
    """The supervisor's end of sd_notify: an AF_UNIX datagram socket, one state per datagram."""

    def __init__(self) -> None:
        # A short folder: AF_UNIX paths are limited to 107 bytes.
        self.folder = tempfile.mkdtemp(prefix="kvferry-notify-", dir="/tmp")
        self.path = os.path.join(self.folder, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.states: list[str] = []

    def wait_for(self, state: str, timeout_s: float) -> None:
        """Return as soon as a datagram carrying ``state`` (e.g. ``READY=1``) arrives."""
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            self.sock.settimeout(remaining)
            try:
                lines = self.sock.recv(4096).decode().splitlines()
            except socket.timeout:
                break
            self.states.extend(lines)
            if state in lines:
                return
        raise AssertionError(f"{state} not received within {timeout_s}s; received {self.states}")

    def close(self) -> None:
        self.sock.close()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def notify():
    sockets: list[NotifySocket] = []

    def make() -> NotifySocket:
        sockets.append(NotifySocket())
        return sockets[-1]

    yield make
    for s in sockets:
        s.close()


def start_ready(proc: Proc, listener: NotifySocket, timeout_s: float = 180.0) -> None:
    """Start ``proc`` and check /health the moment READY=1 arrives. A start that lost a port
    ``free_port`` picked to another process is retried on new ports (as ``Proc.wait_ready`` does)."""
    proc.start()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            listener.wait_for("READY=1", timeout_s=1.0)
            break
        except AssertionError:
            if not proc.is_alive() and proc.lost_port_race():
                proc.repick_ports()
                proc.start()
            assert proc.is_alive(), f"{proc.name} exited before READY=1:\n{proc.tail()}"
            assert time.monotonic() < deadline, f"{proc.name}: no READY=1 within {timeout_s}s"
    status, body = http_json(proc.url + "/health", timeout_s=5)
    assert status == 200, f"{proc.name} sent READY=1 while /health answered {status} {body}"


def wait_exit(proc: Proc, timeout_s: float) -> int:
    proc.popen.wait(timeout_s)
    return proc.popen.returncode


def wait_free_pages(proc: Proc, expected: dict, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and free_pages(proc) != expected:
        time.sleep(0.2)
    assert free_pages(proc) == expected


@dataclass
class Leg:
    """One HTTP leg's outcome: status (None when the connection failed), body text, end time."""

    status: int | None = None
    text: str = ""
    ended_at: float = 0.0


def send_leg(url: str, body: dict, timeout_s: float, out: Leg) -> None:
    try:
        answer = post(url, body, timeout_s=timeout_s)
        out.status, out.text = answer.status, answer.raw
    except OSError as exc:  # refused or reset: the daemon is gone, which the client is told
        out.text = f"{type(exc).__name__}: {exc}"
    out.ended_at = time.monotonic()


def boot(bootstrap_port: int) -> dict:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}


# -- readiness, STOPPING=1 and the forced exit ------------------------------------------------------

@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_ready_stopping_and_second_sigterm(cluster, notify, role):
    """READY=1 once serving; a request that would keep the drain busy for a minute; SIGTERM gives
    STOPPING=1 and a drain (the daemon stays up); a second SIGTERM exits at once with status 1."""
    listener = notify()
    env = {"NOTIFY_SOCKET": listener.path}
    if role == "prefill":
        # A prefill leg whose decode never asks: its room waits up to the transfer wait.
        proc = cluster.prefill(extra=["--transfer-wait-timeout-s", "60", "--drain-timeout-s", "60"],
                               env=env, start=False)
    else:
        # A decode leg naming a bootstrap port where nobody answers: it waits to register.
        proc = cluster.decode(extra=["--register-timeout-s", "60", "--kv-wait-timeout-s", "60",
                                     "--drain-timeout-s", "60"], env=env, start=False)
    start_ready(proc, listener)
    port = proc.bootstrap_port if role == "prefill" else free_port()
    watch = LogWatch(proc)
    leg = Leg()
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 2}, **boot(port)}
    thread = threading.Thread(target=send_leg, args=(proc.url + "/generate", body, 120.0, leg))
    thread.start()
    # The request is in flight: the prefill's room waits for its transfer request; the decode
    # tries to reach the bootstrap port it was given.
    in_flight = ROOM_EVENTS["prefilled_waiting"].format(room=body["bootstrap_room"]) if role == "prefill" \
        else rf"bootstrap DEALER connecting peer=127\.0\.0\.1:{port}\b"
    watch.wait(in_flight, f"{role} request in flight", unless=thread)

    proc.signal(signal.SIGTERM)
    listener.wait_for("STOPPING=1", timeout_s=10)
    # Draining, not gone: it still answers, /health says it no longer admits.
    status, answer = http_json(proc.url + "/health", timeout_s=5)
    assert status == 503 and proc.is_alive(), (status, answer)
    assert leg.ended_at == 0.0, leg
    proc.signal(signal.SIGTERM)
    # Status 1 is the forced exit (a drain ends with 0, after up to --drain-timeout-s 60): at once.
    assert wait_exit(proc, timeout_s=SLACK_S) == 1
    thread.join(30)
    assert not thread.is_alive() and leg.status != 200, leg  # the client is not left hanging


# -- SIGTERM mid-load ----------------------------------------------------------------------------

def run_pair(prefill: Proc, decode: Proc, body: dict, go: threading.Event | None = None) -> tuple[Leg, Leg]:
    """Both legs of one request (``body`` names its room); the decode leg is sent once ``go`` is
    set (at once without it)."""
    legs = Leg(), Leg()
    threads = [threading.Thread(target=send_leg, args=(p.url + "/generate", body, 90.0, leg))
               for p, leg in zip((prefill, decode), legs)]
    threads[0].start()
    if go is not None:
        assert go.wait(120), "the decode legs were never released"
    threads[1].start()
    for t in threads:
        t.join(120)
    return legs


def check_answer(decode_leg: Leg, expected_ids: list[int]) -> bool:
    """True for a finished request with the right tokens; a failure must say what happened."""
    if decode_leg.status == 200:
        assert json.loads(decode_leg.text)["output_ids"] == expected_ids
        return True
    assert decode_leg.text, decode_leg
    if decode_leg.status is not None:
        assert decode_leg.status >= 400 and '"message"' in decode_leg.text, decode_leg
    return False


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_sigterm_mid_load_drains(cluster, notify, colocated, victim):
    listener = notify()
    env = {"NOTIFY_SOCKET": listener.path}
    common = ["--xfer-timeout-s", "1", "--drain-timeout-s", "30"]
    prefill = cluster.prefill(extra=common + ["--transfer-wait-timeout-s", "10"], start=False,
                              env=env if victim == "prefill" else None)
    decode = cluster.decode(extra=common + ["--kv-wait-timeout-s", "10"], start=False,
                            env=env if victim == "decode" else None)
    target, survivor = (decode, prefill) if victim == "decode" else (prefill, decode)
    survivor.start()
    start_ready(target, listener)
    survivor.wait_ready(180)
    before = free_pages(survivor)

    rng = random.Random(11)
    prompts = [[rng.randrange(5, 512) for _ in range(rng.randrange(20, 120))] for _ in range(8)]
    # Decode: long generations keep it busy at the signal. Prefill: the decode legs are sent only
    # after the signal, so every room is prefilled and waiting for its transfer when it arrives.
    max_new = 160 if victim == "decode" else 8
    sampling = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    refs = colocated(False).generate(prompts, sglang_params(sampling))
    bodies = [{"input_ids": p, "sampling_params": sampling, **boot(prefill.bootstrap_port)} for p in prompts]
    go = threading.Event() if victim == "prefill" else None
    watch = LogWatch(prefill)

    with ThreadPoolExecutor(len(prompts)) as pool:
        started = time.monotonic()
        futures = [pool.submit(run_pair, prefill, decode, b, go) for b in bodies]
        if victim == "decode":
            deadline = time.monotonic() + 60
            while metric(decode, "kvferry_generated_tokens_total") == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            for b in bodies:
                watch.wait(ROOM_EVENTS["prefilled_waiting"].format(room=b["bootstrap_room"]), "room waiting")
        assert not any(f.done() for f in futures), "the load ended before the signal"
        signaled_at = time.monotonic()
        target.signal(signal.SIGTERM)
        listener.wait_for("STOPPING=1", timeout_s=10)
        if go is not None:
            go.set()
        results = [f.result(timeout=150) for f in futures]

    finished_after_signal = 0
    for (prefill_leg, decode_leg), ref in zip(results, refs):
        for leg in (prefill_leg, decode_leg):
            assert leg.ended_at - started < 30 + SLACK_S, leg  # drain timeout: nothing hangs past it
        if check_answer(decode_leg, ref.output_ids):
            finished_after_signal += decode_leg.ended_at > signaled_at
    assert finished_after_signal >= 1, [r[1] for r in results]  # the drain let in-flight work finish
    assert wait_exit(target, timeout_s=30 + SLACK_S) == 0, target.tail()
    assert survivor.is_alive()
    # The decode may hold a failed room's pages for max(2 * xfer timeout, 5 s) before freeing them.
    wait_free_pages(survivor, before, timeout_s=10 + 5 + SLACK_S)
