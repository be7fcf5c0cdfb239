"""Faults on real daemons with the prefix cache on (issue 26): cached pages that a room's WRITE
reads while the pool is under pressure, and a partial hit whose transfer is aborted mid-WRITE.

A WRITE is held in flight by freezing (SIGSTOP) the decode it writes into, once its transfer
request is held at the prefill: the prefill posts the WRITE as soon as the room's forward ends
("prefilled: transfer request here") and it stays outstanding until the decode runs again (or
``--xfer-timeout-s``, longer here than any freeze). Heartbeat limits are long so that a frozen
decode is not declared lost while it is stopped. A second decode serves the other requests.

Checked: every answer equals the colocated engine's greedy output; the prefill evicted cached
leaves while the hitting room's WRITE was outstanding (``/server_info`` and
``kvferry_prefix_evicted_pages``); no error; afterwards every page of every pool is free or held
by the prefix cache alone; an aborted partial hit leaves its cached prefix in both caches (the
next turn hits on both sides) and leaks no page.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from kvferry.common.api.sampling_schema import sglang_params
from kvferry.common.daemon.procs import http_json
from tests.cluster import Cluster, LogWatch, room_event
from tests.faults.harness import Leg, Pending, abandon, assert_clear_error, body, boot, counter, metrics, new_room, \
    prompt
from tests.integration.test_prefix_cache import ON, _pages_accounted

PAGE = 16
MAX_NEW = 4
PARAMS = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
XFER_S = 15.0      # a WRITE into a frozen decode stays outstanding this long at most
FREEZE_MAX_S = 8.0  # every freeze here ends well before it
COMMON = ["--xfer-timeout-s", str(XFER_S), "--register-timeout-s", "5", "--heartbeat-interval-s", "0.5",
          "--heartbeat-misses", "60", "--request-timeout-s", "60", "--drain-timeout-s", "2"]
PREFILL_POOL = 1024  # tokens: 64 pages, a few prompts' worth
PREFILL = COMMON + ["--transfer-wait-timeout-s", "30", "--max-total-tokens", str(PREFILL_POOL), "--xfer-threads", "4"]
DECODE = COMMON + ["--kv-wait-timeout-s", "30", "--max-total-tokens", "8192"]
PAGES_WAIT_S = 2 * XFER_S + 10.0  # a decode may hold an aborted room's pages for a while


@pytest.fixture(scope="module")
def trio(tmp_path_factory, tiny_models):
    """(prefill with a small pool, decode to freeze, decode that keeps serving), the cache on everywhere."""
    c = Cluster(tmp_path_factory.mktemp("prefix-faults") / "logs", *tiny_models)
    try:
        procs = [c.prefill(env=ON, extra=PREFILL, start=False), c.decode(env=ON, extra=DECODE, start=False),
                 c.decode(env=ON, extra=DECODE, start=False)]
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready(180)
        yield c, *procs
    finally:
        for p in c.procs:
            if p.is_alive():
                p.signal(signal.SIGCONT)  # an assertion may have left one frozen
        c.stop_all()


@pytest.fixture
def healthy_trio(request, trio):
    _, prefill, frozen, other = trio
    for d in (frozen, other):  # registered with the prefill before any freeze
        p, d_leg = send(prefill, d, prompt(8, seed=1)).results()
        assert p.is_ok and d_leg.is_ok, (p, d_leg)
    yield trio
    if getattr(request.node, "call_failed", False):
        for proc in trio[0].procs:
            print(f"----- {proc.name} ({proc.log_path}) -----\n{proc.tail(6000)}")


class Request:
    """Both legs of one room, sent from threads; ``results()`` joins them (bounded)."""

    def __init__(self, prefill, decode, ids: list[int], room: int, *, decode_first: bool = False,
                 watch: LogWatch | None = None, between=None):
        """``decode_first``: the prefill leg goes once the decode's transfer request is held at the
        prefill (read from ``watch``), after ``between()`` (a freeze of the decode) returned."""
        payload = {**body(ids, MAX_NEW), **boot(prefill.bootstrap_port, room)}
        self.ids, self.room = ids, room
        self.decode_leg = Pending("decode", decode.url + "/generate", payload) if decode_first else None
        if decode_first:
            room_event(watch, room, "held", unless=self.decode_leg.thread)
            if between is not None:
                between()
        self.prefill_leg = Pending("prefill", prefill.url + "/generate", payload)
        if not decode_first:
            self.decode_leg = Pending("decode", decode.url + "/generate", payload)

    def results(self, timeout_s: float = 90.0) -> tuple[Leg, Leg]:
        return self.prefill_leg.result(timeout_s), self.decode_leg.result(timeout_s)


def send(prefill, decode, ids: list[int]) -> Request:
    return Request(prefill, decode, ids, new_room())


def reference(colocated, ids: list[int]) -> list[int]:
    return colocated(False).generate([ids], sglang_params(PARAMS))[0].output_ids


def assert_ok_and_equal(req: Request, want: list[int]) -> tuple[Leg, Leg]:
    p, d = req.results()
    assert p.is_ok, f"prefill leg of room {req.room}: {p}"
    assert d.is_ok, f"decode leg of room {req.room}: {d}"
    assert d.answer["output_ids"] == want, f"room {req.room}: output differs from the colocated engine's"
    return p, d


def info(proc) -> dict:
    status, answer = http_json(proc.url + "/server_info", timeout_s=10)
    assert status == 200, answer
    return answer


def freeze(proc) -> float:
    proc.signal(signal.SIGSTOP)
    return time.monotonic()


def thaw(proc, since: float) -> None:
    proc.signal(signal.SIGCONT)
    assert time.monotonic() - since < FREEZE_MAX_S, "the freeze lasted past its bound: the WRITE may have timed out"


def write_outstanding(watch: LogWatch, room: int, legs: Request) -> None:
    """The room's forward ended with its transfer request here (the WRITE is posted at once) and
    neither leg has answered: the WRITE into the frozen decode is outstanding."""
    room_event(watch, room, "prefilled_with_transfer", timeout_s=60, unless=legs.prefill_leg.thread)
    time.sleep(0.3)  # from the log line to the post: microseconds of the event loop
    assert legs.prefill_leg.thread.is_alive() and legs.decode_leg.thread.is_alive(), "the WRITE is not outstanding"


def writes_longer_than(values: dict[str, float], seconds: float) -> tuple[float, float]:
    """(WRITEs that took longer than the largest ``kvferry_transfer_seconds`` bucket bound not over
    ``seconds``, that bound), from one /metrics snapshot."""
    bounds = {}
    for key, value in values.items():
        m = re.match(r'kvferry_transfer_seconds_bucket\{.*le="([^"]+)"', key)
        if m and m.group(1) != "+Inf":
            bounds[float(m.group(1))] = value
    bound = max(b for b in bounds if b <= seconds)
    return counter(values, "kvferry_transfer_seconds_count") - bounds[bound], bound


def evicted_metric(proc) -> float:
    """The counter as Prometheus text names it (``prometheus_client`` adds ``_total``)."""
    return counter(metrics(proc), "kvferry_prefix_evicted_pages_total")


def test_eviction_under_pool_pressure_while_a_hitting_write_is_outstanding(healthy_trio, colocated):
    """Three prompts fill the small prefill pool's cache. A fourth extends the first (a hit on its
    pages); its WRITE into the frozen decode reads those cached pages. While it is outstanding, a
    burst of long distinct prompts through the other decode needs more pages than are free: the
    prefill evicts cached leaves (never the hit's, which the room holds). Every answer, the
    hitting room's last, equals the colocated engine's."""
    _, prefill, frozen, other = healthy_trio
    total = PREFILL_POOL // PAGE
    fills = [prompt(8 * PAGE, seed=300 + i) for i in range(3)]
    hitting = fills[0] + prompt(40, seed=310)
    burst = [prompt(10 * PAGE + 5, seed=320 + i) for i in range(4)]
    want = {tuple(ids): reference(colocated, ids) for ids in fills + [hitting] + burst}
    for ids in fills:
        assert_ok_and_equal(send(prefill, other, ids), want[tuple(ids)])
    cached = info(prefill)["prefix_cache"]["cached_pages"]
    assert cached >= 3 * 8, cached
    metric_before, metrics_before = evicted_metric(prefill), metrics(prefill)

    watch, room = LogWatch(prefill), new_room()
    frozen_at: list[float] = []  # the decode freezes once its transfer request is held, before the prefill leg
    hit_req = Request(prefill, frozen, hitting, room, decode_first=True, watch=watch,
                      between=lambda: frozen_at.append(freeze(frozen)))
    try:
        write_outstanding(watch, room, hit_req)
        evicted_before = info(prefill)["prefix_cache"]["evicted_pages"]
        free_before = min(info(prefill)["free_pages"].values())
        need = sum(-(-len(ids) // PAGE) for ids in burst)
        assert need > free_before, f"the burst ({need} pages) fits the {free_before} free pages: no pressure"
        burst_started = time.monotonic()
        reqs = [send(prefill, other, ids) for ids in burst]
        for req in reqs:
            assert_ok_and_equal(req, want[tuple(req.ids)])
        evicted_during = info(prefill)["prefix_cache"]["evicted_pages"] - evicted_before
        # the hitting room's WRITE is still outstanding: the eviction happened under it
        assert hit_req.prefill_leg.thread.is_alive() and hit_req.decode_leg.thread.is_alive()
        assert evicted_during > 0, "the burst evicted nothing while the hitting room's WRITE was outstanding"
        time.sleep(0.6)  # the window the hitting WRITE must outlast, past the 0.5 s bucket of its histogram
    finally:
        thaw(frozen, frozen_at[0])
    window_s = time.monotonic() - burst_started
    p, _ = assert_ok_and_equal(hit_req, want[tuple(hitting)])
    assert p.answer["meta_info"]["cached_tokens"] == 8 * PAGE, p.answer["meta_info"]  # read from cached pages
    # The hitting room's WRITE was posted before the burst and ended after the thaw: one WRITE
    # (the burst's go to a decode that runs: milliseconds) lasted longer than the whole window.
    before, bound = writes_longer_than(metrics_before, window_s)
    after, _ = writes_longer_than(metrics(prefill), window_s)
    assert bound >= 0.5 and after - before >= 1, (window_s, bound, before, after)
    print(f"burst window {window_s:.2f}s; WRITEs over {bound}s: {after - before:g}")
    deadline = time.monotonic() + 10.0  # the counter follows the cache at the next sweep
    while evicted_metric(prefill) <= metric_before:
        assert time.monotonic() < deadline, "kvferry_prefix_evicted_pages did not rise"
        time.sleep(0.2)
    assert info(prefill)["prefix_cache"]["cached_pages"] <= total
    _pages_accounted([prefill, frozen, other], timeout_s=PAGES_WAIT_S)


def test_abort_mid_transfer_of_a_partial_hit_leaks_nothing(healthy_trio, colocated):
    """Turn 2 of a conversation hits on both sides (the prefill's cached prompt, the decode's
    cached turn 1); its WRITE into the frozen decode is outstanding when the prefill's client
    leaves, and the prefill cancels it. Then every page is free or cached on both sides, and the
    cached prefix is still there: turn 2 sent again hits on both sides and equals the reference."""
    _, prefill, frozen, _ = healthy_trio
    turn1 = prompt(6 * PAGE + 4, seed=400)
    out1 = assert_ok_and_equal(send(prefill, frozen, turn1), reference(colocated, turn1))[1].answer["output_ids"]
    turn2 = turn1 + out1 + prompt(30, seed=401)
    want2 = reference(colocated, turn2)
    _pages_accounted([prefill, frozen], timeout_s=PAGES_WAIT_S)
    cached = {p.name: info(p)["prefix_cache"]["cached_pages"] for p in (prefill, frozen)}
    assert all(n >= 6 for n in cached.values()), cached

    watch, room = LogWatch(prefill), new_room()
    payload = {**body(turn2, MAX_NEW), **boot(prefill.bootstrap_port, room)}
    d_leg = Pending("decode", frozen.url + "/generate", payload)
    room_event(watch, room, "held", unless=d_leg.thread)  # the decode admitted turn 2 with its hit
    frozen_at = freeze(frozen)
    try:
        def until_writing() -> None:
            room_event(watch, room, "prefilled_with_transfer", timeout_s=60)
            time.sleep(0.3)
            assert d_leg.thread.is_alive()

        abandon(prefill.url + "/generate", payload, until=until_writing)
        # The prefill cancelled the outstanding WRITE (it logs the WRITE's end after the cancel).
        watch.wait(rf"room={room} request_id=\S+: WRITE ended after cancel", "the WRITE cancelled", timeout_s=XFER_S)
    finally:
        thaw(frozen, frozen_at)
    d = d_leg.result(60)
    assert_clear_error(d, "room")
    assert not watch.has(rf"request_id=\S+: \d+ KV pages quarantined"), "the cancel failed: pages quarantined"
    _pages_accounted([prefill, frozen], timeout_s=PAGES_WAIT_S)
    assert info(prefill)["prefix_cache"]["cached_pages"] >= cached[prefill.name]
    assert info(frozen)["prefix_cache"]["cached_pages"] >= cached[frozen.name]

    again = Request(prefill, frozen, turn2, new_room())
    _, d = assert_ok_and_equal(again, want2)
    meta = d.answer["meta_info"]
    assert meta["cached_tokens_prefill"] >= 6 * PAGE, meta
    assert meta["cached_tokens_decode"] >= 6 * PAGE and meta["local_prefill"] is False, meta
    _pages_accounted([prefill, frozen], timeout_s=PAGES_WAIT_S)
