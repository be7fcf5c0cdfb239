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
  (``common.lifecycle``: the forced exit skips the drain, so it does not report success).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from common.model.sampling import SamplingParams
from common.procs import Proc, free_port, http_json
from tests.cluster import free_pages, post

SLACK_S = 5.0


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


def start_ready(proc: Proc, listener: NotifySocket) -> None:
    """Start ``proc`` and check /health the moment READY=1 arrives."""
    proc.start()
    listener.wait_for("READY=1", timeout_s=180)
    status, body = http_json(proc.url + "/health", timeout_s=5)
    assert status == 200, f"{proc.name} sent READY=1 while /health answered {status} {body}"


def wait_exit(proc: Proc, timeout_s: float) -> int:
    proc.popen.wait(timeout_s)
    return proc.popen.returncode


def metric(proc: Proc, name: str) -> float:
    status, text = http_json(proc.url + "/metrics", timeout_s=5)
    assert status == 200
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


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
        url, port = proc.url, proc.bootstrap_port
    else:
        # A decode leg naming a bootstrap port where nobody answers: it waits to register.
        proc = cluster.decode(extra=["--register-timeout-s", "60", "--kv-wait-timeout-s", "60",
                                     "--drain-timeout-s", "60"], env=env, start=False)
        url, port = proc.url, free_port()
    start_ready(proc, listener)
    leg = Leg()
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 2}, **boot(port)}
    thread = threading.Thread(target=send_leg, args=(url + "/generate", body, 120.0, leg))
    thread.start()
    time.sleep(1.0)  # the request is in flight
    assert leg.ended_at == 0.0, leg

    proc.signal(signal.SIGTERM)
    listener.wait_for("STOPPING=1", timeout_s=10)
    time.sleep(1.0)
    assert proc.is_alive(), "the first SIGTERM must drain, not exit, while a request is in flight"
    forced_at = time.monotonic()
    proc.signal(signal.SIGTERM)
    assert wait_exit(proc, timeout_s=10) == 1
    assert time.monotonic() - forced_at < 5.0
    thread.join(30)
    assert not thread.is_alive() and leg.status != 200, leg  # the client is not left hanging


# -- SIGTERM mid-load ----------------------------------------------------------------------------

def run_pair(prefill: Proc, decode: Proc, body: dict, gap_s: float) -> tuple[Leg, Leg]:
    """Both legs with one room; the decode leg follows the prefill leg after ``gap_s``."""
    full = {**body, **boot(prefill.bootstrap_port)}
    legs = Leg(), Leg()
    threads = [threading.Thread(target=send_leg, args=(p.url + "/generate", full, 90.0, leg))
               for p, leg in zip((prefill, decode), legs)]
    threads[0].start()
    time.sleep(gap_s)
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
    # Decode: long generations keep it busy at the signal. Prefill: the decode legs follow 1.5 s
    # later, so every room is still waiting for its transfer when the prefill gets the signal.
    max_new, gap_s = (160, 0.0) if victim == "decode" else (8, 1.5)
    sampling = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    refs = colocated(False).generate(prompts, SamplingParams.from_sglang(sampling))

    with ThreadPoolExecutor(len(prompts)) as pool:
        started = time.monotonic()
        futures = [pool.submit(run_pair, prefill, decode, {"input_ids": p, "sampling_params": sampling}, gap_s)
                   for p in prompts]
        if victim == "decode":
            deadline = time.monotonic() + 60
            while metric(decode, "kvferry_generated_tokens_total") == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            time.sleep(0.7)
        assert not any(f.done() for f in futures), "the load ended before the signal"
        signaled_at = time.monotonic()
        target.signal(signal.SIGTERM)
        listener.wait_for("STOPPING=1", timeout_s=10)
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
