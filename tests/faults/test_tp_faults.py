"""A lost rank of a tensor-parallel prefill: every request it touches fails with a clear error on
both sides, nothing leaks, and the prefill reports unhealthy until it is restarted.

The pair runs at TP 2 on both sides (the tiny model has 2 KV heads: prefill rank K writes head K
into decode rank K). To get a WRITE truly in flight without a hook in the product, decode rank 1
is frozen (SIGSTOP): on CPU loopback a NIXL WRITE completes only while its target agent makes
progress, so prefill rank 1's WRITE of the room stays posted while rank 0's lands. Prefill rank 1
is then killed (SIGKILL) and decode rank 1 thawed.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvferry.common.daemon.procs import http_json
from tests.cluster import LogWatch, room_event
from tests.faults.harness import (
    DECODE_FLAGS, PREFILL_FLAGS, SLACK_S, Pair, Pending, assert_clear_error, body, boot, new_room,
    prompt, wait_pages,
)

TP = ["--tp-size", "2"]
# Long enough that the kill, not a deadline, ends the room: the WRITE waits (--xfer-timeout-s),
# the decode's wait for the KV (--kv-wait-timeout-s) and the prefill's wait for the decode's
# transfer request outlast the test's steps by far.
PATIENT = ["--xfer-timeout-s", "20", "--kv-wait-timeout-s", "20"]
PREFILL_PATIENT = ["--xfer-timeout-s", "20", "--transfer-wait-timeout-s", "20"]
IN_FLIGHT_S = 1.0  # after the room's forward: its WRITEs are posted (microseconds) and rank 1's is stuck
REFUSED_S = 5.0   # a refusal that reaches the decode leg through the prefill's bootstrap port
GONE_S = 10.0      # a lost rank is noticed (the prefill polls its ranks every 10 ms while a room writes)


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of each live child process of ``pid`` (from /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid ...
        if fields[0] != "Z" and int(fields[1]) == pid:
            out[int(entry)] = cmdline
    return out


def _rank_pid(daemon, rank: int) -> int:
    """The pid of TP worker ``rank`` of ``daemon``."""
    ranks = [pid for pid, cmd in _children(daemon.pid).items()
             if "kvferry.common.engine.tp_worker" in cmd and f"--rank {rank} " in cmd + " "]
    assert len(ranks) == 1, f"{daemon.name}: TP worker rank {rank} not found among {_children(daemon.pid)}"
    return ranks[0]


def _workers(daemon) -> set[int]:
    return {pid for pid, cmd in _children(daemon.pid).items() if "kvferry.common.engine.tp_worker" in cmd}


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie has exited
    except OSError:
        return True


def _wait_gone(pids, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, f"orphan TP worker processes left: {[p for p in pids if not _gone(p)]}"
        time.sleep(0.1)


def _registered(decode, prefill) -> bool:
    """Whether ``decode`` has registered with ``prefill`` (its link to the bootstrap port)."""
    links = http_json(decode.url + "/server_info", timeout_s=10)[1]["prefills"]
    return links.get(f"127.0.0.1:{prefill.bootstrap_port}") == "registered"


def _is_5xx(leg) -> bool:
    return leg.status is not None and 500 <= leg.status < 600


def _health(proc) -> int:
    return http_json(proc.url + "/health", timeout_s=5)[0]


def _wait_health(proc, status: int, timeout_s: float = GONE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := _health(proc)) != status:
        assert time.monotonic() < deadline, f"{proc.name}: /health stayed {got}, expected {status}"
        time.sleep(0.1)


def _leg(name: str, proc, ids, room, bootstrap_port, max_new_tokens=4, timeout_s=60.0) -> Pending:
    payload = {**body(ids, max_new_tokens), **boot(bootstrap_port, room)}
    return Pending(name, proc.url + "/generate", payload, timeout_s)


@pytest.fixture(scope="module")
def tp_pair(cluster_module):
    """A prefill and a decode at TP 2, patient deadlines, warmed up (registered once); a second
    prefill at TP 2 (``pair.spare``), which takes over once the first has lost its rank; and a
    decode at TP 1 (``pair.newcomer``) that registers with the spare only after it lost its rank.
    All start together, so that their start-ups overlap."""
    prefill, spare = (cluster_module.prefill(extra=PREFILL_FLAGS + TP + PREFILL_PATIENT, start=False)
                      for _ in range(2))
    decode = cluster_module.decode(extra=DECODE_FLAGS + TP + PATIENT, start=False)
    newcomer = cluster_module.decode(extra=DECODE_FLAGS + PATIENT, start=False)
    Pair.start(prefill, decode, spare, newcomer)
    pair = Pair(cluster_module, prefill, decode)
    pair.spare, pair.newcomer = Pair(cluster_module, spare, newcomer), newcomer
    pair.warm_up()
    return pair


@pytest.fixture(scope="module")
def cluster_module(tmp_path_factory, tiny_models):
    from tests.cluster import Cluster

    c = Cluster(tmp_path_factory.mktemp("tp-faults") / "logs", *tiny_models)
    try:
        yield c
    finally:
        for proc in c.procs:  # never leave a frozen rank behind
            for pid in (_workers(proc) if proc.is_alive() else ()):
                os.kill(pid, signal.SIGCONT)
        c.stop_all()


def _refused_at_once(pair, ids, order: str = "concurrent") -> None:
    """A request to a prefill that lost rank 1: both legs fail at once (far within the 20 s
    deadlines), each naming the lost rank."""
    p, d = pair.send(ids, order=order, timeout_s=30)
    assert p.status == 503, p
    assert_clear_error(p, "rank 1", "exited", "restarted")
    assert p.elapsed_s <= SLACK_S, p
    assert _is_5xx(d), d
    assert_clear_error(d, "rank 1", "exited")
    assert d.elapsed_s <= REFUSED_S, d


def _stop(proc, ranks: set[int]) -> None:
    """Stop a daemon and check that its rank processes (``ranks``, recorded while they all ran)
    ended before it did (it closes its TP group on the way out): no orphan is left behind."""
    ranks = ranks | _workers(proc)
    assert proc.stop(30) is not None
    _wait_gone(ranks, timeout_s=1.0)


def _stop_prefill(pair, ranks: set[int]) -> None:
    _stop(pair.prefill, ranks)


def _serves(pair, ids, want, timeout_s: float = 30.0) -> None:
    """The pair serves ``ids`` with the output ``want`` it had before the fault; single requests are
    retried while the decode's link to the restarted prefill heals (it registers again)."""
    deadline = time.monotonic() + timeout_s
    while True:
        p, d = pair.send(ids, timeout_s=30)
        if p.is_ok and d.is_ok:
            break
        assert time.monotonic() < deadline, f"no success within {timeout_s}s after the restart: {p} {d}"
        time.sleep(0.5)
    assert d.answer["output_ids"] == want


def test_kill_prefill_rank_mid_write(tp_pair):
    pair = tp_pair
    ids = prompt(200, seed=31)
    want = pair.reference(ids)
    pair.wait_pages()
    frozen = _rank_pid(pair.decode, 1)
    victim = _rank_pid(pair.prefill, 1)
    ranks = _workers(pair.prefill)
    os.kill(frozen, signal.SIGSTOP)
    try:
        room, watch = new_room(), LogWatch(pair.prefill)
        # the decode's transfer request first, so that the room's WRITEs start as its forward ends
        d_leg = _leg("decode", pair.decode, ids, room, pair.prefill.bootstrap_port)
        room_event(watch, room, "held", unless=d_leg.thread, timeout_s=30)
        p_leg = _leg("prefill", pair.prefill, ids, room, pair.prefill.bootstrap_port)
        room_event(watch, room, "prefilled_with_transfer", unless=p_leg.thread, timeout_s=30)
        time.sleep(IN_FLIGHT_S)
        # rank 0's WRITE has landed, rank 1's cannot: both legs still wait for the room
        assert p_leg.thread.is_alive() and d_leg.thread.is_alive(), (p_leg._leg, d_leg._leg)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        p = p_leg.result(GONE_S + SLACK_S)
    finally:
        os.kill(frozen, signal.SIGCONT)
    d = d_leg.result(GONE_S + SLACK_S)
    assert time.monotonic() - killed_at <= GONE_S, "the legs did not end soon after the rank was lost"
    assert _is_5xx(p) and _is_5xx(d), (p, d)
    assert_clear_error(p, f"room={room}", "rank 1", "exited")
    assert_clear_error(d, f"room={room}", "rank 1")
    # the decode frees the room's pages (the prefill confirmed its WRITEs ended); the prefill too
    wait_pages(pair.decode, pair.baseline["decode"], 10, "decode")
    wait_pages(pair.prefill, pair.baseline["prefill"], 10, "prefill")
    # the prefill is unhealthy until restarted, and refuses new work at once, naming the lost rank
    _wait_health(pair.prefill, 503)
    assert pair.prefill.is_alive()
    _refused_at_once(pair, prompt(16, seed=32))
    time.sleep(1.0)
    assert _health(pair.prefill) == 503
    _stop_prefill(pair, ranks)
    # the decode kept serving, nothing leaked there: another prefill at TP 2 serves it, same output
    assert _health(pair.decode) == 200
    pair.prefill = pair.spare.prefill
    pair.baseline["prefill"] = pair.spare.baseline["prefill"]
    _serves(pair, ids, want)
    pair.wait_pages()


def test_rank_lost_while_idle(tp_pair):
    """Rank 1 of the spare prefill dies between requests: /health turns 503 and the next request
    fails at once, naming the lost rank, on both legs: from the TP-2 decode registered with it (its
    transfer request sent after the refusal, or held before it) and from the TP-1 decode that
    registers only now (the registration is refused at once, not waited for); nothing leaks."""
    pair = tp_pair
    pair.prefill = pair.spare.prefill  # already so once the first case has run
    pair.baseline["prefill"] = pair.spare.baseline["prefill"]
    if not _registered(pair.decode, pair.prefill):
        pair.warm_up()  # the first case did not run: the TP-2 decode registers with the spare now
    pair.wait_pages()
    ranks = _workers(pair.prefill)
    os.kill(_rank_pid(pair.prefill, 1), signal.SIGKILL)
    _wait_health(pair.prefill, 503)
    for order in ("concurrent", "decode_first"):
        _refused_at_once(pair, prompt(40, seed=33), order)
    assert not _registered(pair.newcomer, pair.prefill)
    _refused_at_once(pair.spare, prompt(40, seed=34))
    for p in (pair, pair.spare):
        p.wait_pages()
    assert _health(pair.prefill) == 503
    assert (_health(pair.decode), _health(pair.newcomer)) == (200, 200)
    _stop_prefill(pair, ranks)
    decode_ranks = _workers(pair.decode)  # the decode's rank 1, frozen and thawed in the first case
    assert len(decode_ranks) == 1, decode_ranks
    _stop(pair.decode, decode_ranks)
