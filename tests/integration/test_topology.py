"""Two prefills and two decodes behind one sglang-router: 200 requests, 8 at a time, every answer
equal to the colocated engine's, every decode registered with (and fed by) both prefills, and no
page left allocated anywhere afterwards."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvferry.common.daemon.procs import http_json
from kvferry.common.api.sampling_schema import sglang_params
from tests.cluster import Cluster, assert_pages_return, free_pages, metric, post

NUM_REQUESTS = 200
CONCURRENCY = 8


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models):
    c = Cluster(tmp_path_factory.mktemp("topology") / "logs", *tiny_models)
    try:
        prefills = [c.prefill(start=False) for _ in range(2)]
        decodes = [c.decode(start=False) for _ in range(2)]
        for p in prefills + decodes:
            p.start()
        for p in prefills + decodes:
            p.wait_ready(180)
        yield c, prefills, decodes
    finally:
        c.stop_all()


def workload(seed: int = 7) -> list[tuple[list[int], dict]]:
    rng = random.Random(seed)
    return [([rng.randrange(5, 512) for _ in range(rng.randrange(1, 40))],
             {"max_new_tokens": rng.randrange(4, 9), "temperature": 0, "ignore_eos": True})
            for _ in range(NUM_REQUESTS)]


def test_two_by_two_round_robin(mesh, colocated):
    c, prefills, decodes = mesh
    before = {p.name: free_pages(p) for p in prefills + decodes}
    # round_robin picks the prefill and the decode with two counters that advance together, which
    # would pair them for good (p0 with d0, p1 with d1); a random decode choice mixes the pairs.
    router = c.router(prefills, decodes, extra=["--decode-policy", "random"])
    jobs = workload()
    refs = colocated(False).generate([ids for ids, _ in jobs], [sglang_params(s) for _, s in jobs])

    def one(job):
        ids, sampling = job
        answer = post(router.url + "/generate", {"input_ids": ids, "sampling_params": sampling}, timeout_s=60)
        assert answer.status == 200, answer
        return answer.json()["output_ids"]

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        outs = list(pool.map(one, jobs))
    assert outs == [r.output_ids for r in refs]

    bootstrap = {f"127.0.0.1:{p.bootstrap_port}" for p in prefills}
    for d in decodes:
        status, info = http_json(d.url + "/server_info", timeout_s=10)
        assert status == 200, info
        assert set(info["prefills"]) == bootstrap, info["prefills"]
        assert set(info["prefills"].values()) == {"registered"}, info["prefills"]
    for p in prefills:  # each decode registered once with each prefill
        assert metric(p, "kvferry_registrations_total", result="accepted") == len(decodes)
        assert metric(p, "kvferry_transfer_bytes_total") > 0
    served = [metric(d, "kvferry_ttft_seconds_count") for d in decodes]  # one per request that got its KV
    assert sum(served) == NUM_REQUESTS and min(served) > NUM_REQUESTS // 4, served

    # No limit on the total time: each request is bounded by its own answer (post's timeout), and
    # a figure for the whole run on a shared machine says nothing about correctness.
    assert_pages_return(prefills + decodes, before)
