"""A page-major side talks to a layer-major side: geometry is matched by key and each region says
its own page stride, so the KV lands right whatever the pool layouts (only merging is lost)."""

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvferry.common.sampling.sampler import SamplingParams
from tests.cluster import free_pages, send_pair

LENGTHS = [1, 16, 17, 100, 256, 1000]


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("prefill_layout,decode_layout", [("page-major", "layer-major"), ("layer-major", "page-major")])
@pytest.mark.parametrize("draft", ["none", "decode", "both"])
def test_mixed_layouts(cluster, colocated, prefill_layout, decode_layout, draft):
    prefill = cluster.prefill(draft=draft == "both", extra=["--kv-layout", prefill_layout])
    decode = cluster.decode(draft=draft != "none", extra=["--kv-layout", decode_layout])
    before = free_pages(prefill), free_pages(decode)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [r.output_ids for r in colocated(draft != "none").generate(_prompts(), params)]

    def one(ids):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
        (ps, pa), (ds, da) = send_pair(prefill, decode, body)
        assert (ps, ds) == (200, 200), (pa, da)
        return da["output_ids"]

    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(one, _prompts())) == expected
    assert (free_pages(prefill), free_pages(decode)) == before
