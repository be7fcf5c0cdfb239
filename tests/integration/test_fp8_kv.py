"""An FP8 (e4m3) KV pair, ``--kv-cache-dtype fp8_e4m3`` on both sides, behind the real sglang-router:
greedy tokens equal a colocated engine with an FP8 pool, token for token (prefill from scratch,
chunked prefill, decode), and with the prefix cache on, a later turn that hits both sides' caches
equals it too. The checkpoint carries per-layer ``k_scale``/``v_scale`` tensors, so both daemons
and the reference must read them. A pair whose sides differ (fp8 against auto) is refused at
registration, naming both dtypes.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvferry.common.daemon.procs import http_json
from kvferry.common.sampling.sampler import SamplingParams
from tests.cluster import Cluster, metric, ok, post, with_kv_scales

FP8 = ["--kv-cache-dtype", "fp8_e4m3", "--max-total-tokens", "4096"]
ON = {"KVFERRY_DISABLE_PREFIX_CACHE": "false"}
MAX_NEW = 8
LENGTHS = [1, 15, 16, 17, 40, 100, 250]  # 250: three chunks of --chunked-prefill-size 100
# K and V divided by these land in e4m3's coarse subnormal range: FP8 changes greedy tokens of the
# tiny model on one of these prompts (with scales near 1 it gives the fp32 tokens on every one of
# them, and equality with the FP8 reference would not show that the pair used FP8 and the scales).
K_SCALE, V_SCALE = 128.0, 96.0


def prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in LENGTHS]


def params() -> SamplingParams:
    return SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def body(ids: list[int]) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def scaled(tmp_path_factory, tiny_models) -> str:
    """The tiny target with k_scale/v_scale tensors in every layer."""
    return with_kv_scales(tiny_models[0], tmp_path_factory.mktemp("fp8-ckpt") / "target", K_SCALE, V_SCALE)


@pytest.fixture(scope="module")
def reference(scaled):
    """Colocated engines over the scaled checkpoint: ``{"fp8_e4m3": ..., "auto": ...}``."""
    from kvferry.common.engine.colocated import ColocatedEngine
    from kvferry.common.engine.factory import build_runner
    from kvferry.common.text.tokenizer import Tokenizer

    torch.set_num_threads(1)
    return {kind: ColocatedEngine(build_runner(scaled, None, page_size=16, max_total_tokens=4096,
                                               kv_cache_dtype=kind), Tokenizer.from_dir(scaled))
            for kind in ("fp8_e4m3", "auto")}


@pytest.fixture(scope="module")
def pd(tmp_path_factory, scaled, tiny_models):
    c = Cluster(tmp_path_factory.mktemp("fp8-kv") / "logs", scaled, tiny_models[1])
    try:
        prefill = c.prefill(env=ON, extra=FP8 + ["--chunked-prefill-size", "100"])
        decode = c.decode(env=ON, extra=FP8)
        yield c, prefill, decode, c.router([prefill], [decode])
    finally:
        c.stop_all()


def _generate(router, ids: list[int]) -> list[int]:
    return ok(post(router.url + "/generate", body(ids))).json()["output_ids"]


def test_pair_equals_colocated_fp8(pd, reference):
    _, prefill, decode, router = pd
    for proc in (prefill, decode):
        status, info = http_json(proc.url + "/server_info", timeout_s=10)
        assert status == 200 and info["kv_layout"]["kv_dtype"] == "float8_e4m3fn", info
        assert metric(proc, "kvferry_kv_pool_info", kv_dtype="float8_e4m3fn", model="target") == 1.0
    want = [r.output_ids for r in reference["fp8_e4m3"].generate(prompts(), params())]
    assert [_generate(router, ids) for ids in prompts()] == want
    # the pool really is FP8 with the checkpoint's scales: the full-precision pool answers otherwise
    assert want != [r.output_ids for r in reference["auto"].generate(prompts(), params())]


def test_prefix_cache_hits_give_the_tokens_of_a_cold_run(pd, reference):
    """A repeated prompt (a full hit) and a second turn (the first turn and its answer cached on
    both sides, only the new question computed and moved) equal the colocated engine with no cache."""
    _, prefill, decode, router = pd
    hits = {side: metric(proc, "kvferry_prefix_hit_tokens_total") for side, proc in
            (("prefill", prefill), ("decode", decode))}
    first = prompts(seed=7)[5]  # 100 tokens
    answer = _generate(router, first)
    assert answer == reference["fp8_e4m3"].generate([first], params())[0].output_ids
    assert _generate(router, first) == answer
    second = first + answer + prompts(seed=8)[3]  # + 40 new tokens
    assert _generate(router, second) == reference["fp8_e4m3"].generate([second], params())[0].output_ids
    for side, proc in (("prefill", prefill), ("decode", decode)):
        assert metric(proc, "kvferry_prefix_hit_tokens_total") - hits[side] >= 2 * 96, side  # whole pages


def test_sides_with_different_kv_dtypes_are_refused_naming_both(tmp_path, scaled, tiny_models):
    c = Cluster(tmp_path / "logs", scaled, tiny_models[1])
    try:
        prefill = c.prefill(extra=FP8)
        decode = c.decode(extra=["--max-total-tokens", "4096"])
        router = c.router([prefill], [decode])
        answer = post(router.url + "/generate", body(prompts()[2]), timeout_s=60)
        assert answer.status >= 400, answer.raw[:500]
        assert "kv_dtype mismatch: prefill has 'float8_e4m3fn', decode has 'float32'" in answer.raw, answer.raw[:1000]
        assert "--kv-cache-dtype" in answer.raw, answer.raw[:1000]
    finally:
        c.stop_all()
