"""Staging on CPU between real daemons: a scattered room gathered into one WRITE per chunk,
scattered back on the decode before the scheduler sees it.

CPU staging does not pay (copies cost more than descriptors: the start-up measurement turns it off
by default), so these tests force it with ``--staging-crossover-runs 1`` and small chunks, so that
every room takes the staged path in several chunks. Greedy output equals the colocated engine, every
page and every staging slot comes back, and the metrics count each room's path.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.daemon.procs import http_json
from tests.cluster import assert_pages_return, free_pages, metric, send_pair

LENGTHS = [1, 17, 100, 700, 2000]
PREFILL = ["--staging-bytes", str(1 << 20), "--staging-chunk-bytes", str(128 << 10), "--staging-crossover-runs", "1"]
DECODE = ["--staging-bytes", str(64 << 20)]


def _prompts() -> list[list[int]]:
    rng = random.Random(17)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in LENGTHS]


def _run(prefill, decode, colocated) -> None:
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [r.output_ids for r in colocated(False).generate(_prompts(), params)]

    def one(ids):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
        (ps, pa), (ds, da) = send_pair(prefill, decode, body)
        assert (ps, ds) == (200, 200), (pa, da)
        return da["output_ids"]

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(one, _prompts())) == expected


def test_staged_rooms_equal_colocated(cluster, colocated):
    prefill = cluster.prefill(extra=PREFILL)
    decode = cluster.decode(extra=DECODE)
    before = {p.name: free_pages(p) for p in (prefill, decode)}
    _run(prefill, decode, colocated)
    assert metric(prefill, "kvferry_staging_rooms_total", path="staged", reason="") == len(LENGTHS)
    assert_pages_return([prefill, decode], before)
    for proc in (prefill, decode):
        status, info = http_json(proc.url + "/server_info", timeout_s=10)
        assert status == 200 and info["staging"]["slots_free"] == info["staging"]["slots"] > 0, info


def test_a_decode_without_staging_gets_direct_rooms(cluster, colocated):
    prefill = cluster.prefill(extra=PREFILL)
    decode = cluster.decode(extra=["--staging-bytes", "0"])
    _run(prefill, decode, colocated)
    assert metric(prefill, "kvferry_staging_rooms_total", path="direct", reason="staging_off") == len(LENGTHS)
    assert metric(prefill, "kvferry_staging_rooms_total", path="staged", reason="") == 0


def test_crossover_measured_at_start_up_is_logged(cluster, colocated):
    """``--staging-crossover-runs -1`` (the default): the prefill measures a descriptor's cost and a
    copy's on this machine at start-up, logs them and the crossover they give, and serves."""
    prefill = cluster.prefill(extra=["--staging-bytes", str(1 << 20), "--staging-chunk-bytes", str(128 << 10)])
    decode = cluster.decode(extra=DECODE)
    _run(prefill, decode, colocated)
    log = prefill.log_path.read_text()
    assert "staging costs measured at start-up" in log and "stage a room at or above" in log
    assert "us per WRITE" in log  # the per-WRITE cost each chunk pays is measured too
    staged = metric(prefill, "kvferry_staging_rooms_total", path="staged", reason="")
    few = metric(prefill, "kvferry_staging_rooms_total", path="direct", reason="few_runs")
    assert staged + few == len(LENGTHS)  # small rooms of contiguous pages: direct, as the costs say
