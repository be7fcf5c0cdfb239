"""A prefill and a decode whose KV dtypes differ, behind the real sglang-router: an fp32 or bf16
prefill feeding an FP8 (e4m3) decode, each room converted by the prefill's gather with the decode's
per-layer scales (common/plan/convert.py). Greedy tokens equal a reference built here from the model
itself (``greedy``): the prompt prefilled into a pool of the prefill's dtype, every page quantised as the decode's
own store would (``kv_quant.quantize`` with the checkpoint's scales), then decoded over the FP8 pool.
The room moves in the decode's dtype (a quarter or half of the prefill's bytes), into the decode's
staging slot when it offers one and straight into its pages when it does not; every page and slot
comes back. A prefill that stages nothing refuses such a decode at registration, naming both dtypes.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvferry.common.cache.kv_cache import KvCache
from kvferry.common.daemon.procs import http_json
from kvferry.common.kernels.kv_quant import quantize
from kvferry.common.models.config import ModelConfig
from kvferry.common.models.llama import SeqChunk
from kvferry.common.models.loader import load_model, read_kv_scales
from tests.cluster import Cluster, assert_pages_return, free_pages, metric, ok, post, with_kv_scales

MAX_NEW = 6
LENGTHS = [1, 16, 17, 100]
FP8 = ["--kv-cache-dtype", "fp8_e4m3", "--max-total-tokens", "4096"]
STAGING = ["--staging-bytes", str(1 << 20), "--staging-chunk-bytes", str(64 << 10), "--staging-crossover-runs", "1"]
# Scales that make FP8 visibly change the tiny model's tokens (test_fp8_kv.py explains the choice).
K_SCALE, V_SCALE = 128.0, 96.0


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def scaled(tmp_path_factory, tiny_models) -> str:
    return with_kv_scales(tiny_models[0], tmp_path_factory.mktemp("convert-ckpt") / "target", K_SCALE, V_SCALE)


def greedy(model, model_dir: str, prompt: list[int], converted: bool) -> list[int]:
    """Greedy tokens of ``model``: prefilled into a pool of its dtype, then decoded over that pool or,
    ``converted``, over an e4m3 pool holding every page quantised with the checkpoint's scales."""
    pages = math.ceil((len(prompt) + MAX_NEW) / 16)
    ids = list(range(pages))
    kv = KvCache(model.config, pages, 16, model.dtype, "cpu")
    out = [int(model.forward([SeqChunk(prompt, 0, ids)], kv).argmax(-1)[0])]
    if converted:
        k_scales, v_scales = read_kv_scales(model_dir, model.config.num_hidden_layers)
        fp8 = KvCache(model.config, pages, 16, torch.float8_e4m3fn, "cpu", k_scales=k_scales, v_scales=v_scales)
        for layer in range(model.config.num_hidden_layers):
            fp8.k[layer].copy_(quantize(kv.k[layer], k_scales[layer], fp8.dtype))
            fp8.v[layer].copy_(quantize(kv.v[layer], v_scales[layer], fp8.dtype))
        kv = fp8
    while len(out) < MAX_NEW:
        logits = model.forward([SeqChunk([out[-1]], len(prompt) + len(out) - 1, ids)], kv)
        out.append(int(logits.argmax(-1)[0]))
    return out


def _generate(router, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
    return ok(post(router.url + "/generate", body)).json()["output_ids"]


@pytest.mark.parametrize("dtype,decode_staging,reason", [
    ("float32", ["--staging-bytes", "0"], "converted_to_pages"),  # no slot offered: into the decode's pages
    ("bfloat16", ["--staging-bytes", str(8 << 20)], ""),         # into the decode's slot, scattered there
])
def test_a_wider_prefill_feeds_an_fp8_decode(tmp_path, scaled, tiny_models, dtype, decode_staging, reason):
    c = Cluster(tmp_path / "logs", scaled, tiny_models[1])
    try:
        prefill = c.prefill(extra=["--dtype", dtype, "--max-total-tokens", "4096", *STAGING])
        decode = c.decode(extra=["--dtype", dtype, *FP8, *decode_staging])
        router = c.router([prefill], [decode])
        before = {p.name: free_pages(p) for p in (prefill, decode)}
        torch.set_num_threads(1)
        model = load_model(scaled, dtype=dtype, device="cpu")
        want = [greedy(model, scaled, ids, converted=True) for ids in prompts()]
        assert [_generate(router, ids) for ids in prompts()] == want
        # FP8 with the checkpoint's scales is what the decode read: the unconverted model answers otherwise
        assert want != [greedy(model, scaled, ids, converted=False) for ids in prompts()]
        assert metric(prefill, "kvferry_staging_rooms_total", path="staged", reason=reason) == len(LENGTHS)
        cfg = ModelConfig.from_dir(scaled)
        fp8_page = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 16  # one byte each
        moved = metric(prefill, "kvferry_transfer_bytes_total")
        kv_bytes = sum(math.ceil(n / 16) for n in LENGTHS) * fp8_page
        assert kv_bytes <= moved <= kv_bytes + len(LENGTHS) * 4096, (moved, kv_bytes)  # the decode's dtype, + aux
        assert_pages_return([prefill, decode], before)
        status, info = http_json(prefill.url + "/server_info", timeout_s=10)
        assert status == 200 and info["staging"]["slots_free"] == info["staging"]["slots"], info
    finally:
        c.stop_all()


def test_a_prefill_that_stages_nothing_refuses_an_fp8_decode_naming_both_dtypes(tmp_path, scaled, tiny_models):
    c = Cluster(tmp_path / "logs", scaled, tiny_models[1])
    try:
        prefill = c.prefill(extra=["--max-total-tokens", "4096", "--staging-bytes", "0"])
        decode = c.decode(extra=FP8)
        router = c.router([prefill], [decode])
        body = {"input_ids": prompts()[1], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        answer = post(router.url + "/generate", body, timeout_s=60)
        assert answer.status >= 400, answer.raw[:500]
        assert "kv_dtype 'float8_e4m3fn' differs from this prefill's 'float32'" in answer.raw, answer.raw[:1000]
        assert "--staging-bytes" in answer.raw, answer.raw[:1000]
        status, _ = http_json(prefill.url + "/health", timeout_s=10)
        assert status == 200  # still serving
    finally:
        c.stop_all()
