"""The daemons on CUDA: VRAM KV pools registered with NIXL, the disaggregated output equal to the
colocated engine's, and the mixed layout (target KV in VRAM, draft KV in DRAM, decode-only
speculative decoding) that upstream SGLang refuses."""

from __future__ import annotations

import random

import pytest
import torch

from kvferry.common.engine.colocated import ColocatedEngine
from kvferry.common.engine.factory import build_runner
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.text.tokenizer import Tokenizer
from kvferry.common.daemon.procs import http_json
from tests.cluster import free_pages, metric, send_pair

pytestmark = pytest.mark.gpu

LENGTHS = [1, 15, 16, 17, 64, 100, 255, 256, 1000, 1024, 2000]
CUDA = ["--device", "cuda:0", "--dtype", "float32"]


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in LENGTHS]


def _reference(target: str, draft: str | None, draft_device: str | None = None) -> list[list[int]]:
    runner = build_runner(target, draft, device="cuda:0", dtype="float32", max_total_tokens=65536,
                          draft_device=draft_device)
    engine = ColocatedEngine(runner, Tokenizer.from_dir(target))
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    return [r.output_ids for r in engine.generate(_prompts(), params)]


def _disagg(prefill, decode) -> list[list[int]]:
    out = []
    for ids in _prompts():
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
        (ps, pa), (ds, da) = send_pair(prefill, decode, body)
        assert ps == 200 and ds == 200, (pa, da)
        out.append(da["output_ids"])
    return out


def test_vram_pools_disagg_equals_colocated(cluster, tiny_models):
    target, _ = tiny_models
    prefill, decode = cluster.prefill(extra=CUDA), cluster.decode(extra=CUDA)
    before = free_pages(prefill), free_pages(decode)
    assert _disagg(prefill, decode) == _reference(target, None)
    assert (free_pages(prefill), free_pages(decode)) == before


def test_mixed_layout_vram_target_dram_draft(cluster, tiny_models):
    """Decode: target KV in VRAM, draft model and KV on the CPU (DRAM); the prefill has no draft,
    so the plan writes the VRAM target regions and ignores the DRAM draft regions."""
    target, draft = tiny_models
    prefill = cluster.prefill(extra=CUDA)
    decode = cluster.decode(draft=True, extra=CUDA + ["--draft-device", "cpu"])
    got = _disagg(prefill, decode)
    assert got == _reference(target, None)
    assert got == _reference(target, draft, draft_device="cpu")


def test_draft_on_both_sides_vram(cluster, tiny_models):
    target, draft = tiny_models
    prefill, decode = cluster.prefill(draft=True, extra=CUDA), cluster.decode(draft=True, extra=CUDA)
    assert _disagg(prefill, decode) == _reference(target, draft)


def test_bf16_default_on_cuda(cluster, tiny_models):
    """--dtype auto means bf16 on CUDA: both daemons report bf16 KV in VRAM (/server_info), and the
    pair serves. Fails if ``auto`` resolves to float32 on CUDA (the answer's length alone did not)."""
    prefill = cluster.prefill(extra=["--device", "cuda:0"])
    decode = cluster.decode(extra=["--device", "cuda:0"])
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                             "ignore_eos": True}}
    (_, _), (ds, da) = send_pair(prefill, decode, body)
    assert ds == 200, da
    assert len(da["output_ids"]) == 8
    assert torch.cuda.is_available()
    for proc in (prefill, decode):
        status, info = http_json(proc.url + "/server_info", timeout_s=10)
        assert status == 200, info
        layout = info["kv_layout"]
        assert (layout["kv_dtype"], layout["target"]["mem"]) == ("bfloat16", ["VRAM"]), (proc.name, layout)


@pytest.mark.parametrize("prefill_page,decode_page", [(16, 64), (64, 16)])
def test_page_sizes_differ_in_vram(cluster, tiny_models, prefill_page, decode_page):
    """A decode with another page size than the prefill's: the transfer maps token ranges (one
    descriptor per head per segment of VRAM pages), greedy output as colocated, pages back."""
    target, _ = tiny_models
    prefill = cluster.prefill(extra=CUDA + ["--page-size", str(prefill_page)])
    decode = cluster.decode(extra=CUDA + ["--page-size", str(decode_page)])
    before = free_pages(prefill), free_pages(decode)
    assert _disagg(prefill, decode) == _reference(target, None)
    assert (free_pages(prefill), free_pages(decode)) == before


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="TP 2 -> TP 2 on CUDA needs 4 GPUs (one per rank)")
def test_tp2_to_tp2_on_four_gpus(cluster, tiny_models):
    """Prefill ranks on cuda:0-1, decode ranks on cuda:2-3 (NCCL; eager steps)."""
    target, _ = tiny_models
    tp = ["--tp-size", "2", "--disable-cuda-graph", "--dtype", "float32"]
    prefill = cluster.prefill(extra=tp + ["--device", "cuda:0"])
    decode = cluster.decode(extra=tp + ["--device", "cuda:2"])
    before = free_pages(prefill), free_pages(decode)
    assert _disagg(prefill, decode) == _reference(target, None)
    assert (free_pages(prefill), free_pages(decode)) == before


def test_staged_rooms_in_vram(cluster, tiny_models):
    """Every room staged (crossover 1, 1 MiB chunks): the Triton gather on the prefill, one WRITE per
    chunk over cuda_ipc into the decode's slot, the Triton scatter into the decode's pages; greedy
    output as colocated, every page and slot back."""
    from kvferry.common.daemon.procs import http_json

    target, _ = tiny_models
    prefill = cluster.prefill(extra=CUDA + ["--staging-bytes", str(64 << 20), "--staging-chunk-bytes", str(1 << 20),
                                            "--staging-crossover-runs", "1"])
    decode = cluster.decode(extra=CUDA + ["--staging-bytes", str(64 << 20)])
    before = free_pages(prefill), free_pages(decode)
    assert _disagg(prefill, decode) == _reference(target, None)
    assert (free_pages(prefill), free_pages(decode)) == before
    for proc in (prefill, decode):
        status, info = http_json(proc.url + "/server_info", timeout_s=10)
        assert status == 200 and info["staging"]["slots_free"] == info["staging"]["slots"] > 0, info
    assert metric(prefill, "kvferry_staging_rooms_total", path="staged", reason="") == len(LENGTHS)
