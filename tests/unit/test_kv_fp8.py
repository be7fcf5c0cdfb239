"""The FP8 (e4m3) KV pool on the torch path: quantize/dequantize within one e4m3 rounding at scales
other than 1, saturation at +-448 * scale, the paged attention of an FP8 pool equal to that of a
full-precision pool holding the round-tripped K/V, the per-layer scales of ``KvCache`` and where
they come from (the checkpoint's ``k_scale``/``v_scale``), and the auto pool size in FP8."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvferry.common.cache.kv_cache import KvCache
from kvferry.common.daemon import start
from kvferry.common.daemon.flags import parse_config
from kvferry.common.engine.factory import build_runner
from kvferry.common.errors import ConfigError, ModelLoadError
from kvferry.common.kernels.kv_quant import FP8_E4M3_MAX, dequantize, pool_dtype, quantize, round_trip
from kvferry.common.layers.attention import build_plan, paged_attention, write_kv
from kvferry.common.models.config import ModelConfig
from kvferry.common.models.loader import read_kv_scales
from kvferry.prefill_worker.config import PrefillConfig
from tests.cluster import tiny_model_dirs

FP8 = torch.float8_e4m3fn
SCALES = [0.01, 0.3, 1.0, 3.7]


@pytest.mark.parametrize("scale", SCALES)
def test_round_trip_is_within_one_e4m3_rounding(scale):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 100 * scale  # up to ~400 * scale
    x = x[(x / scale).abs() < FP8_E4M3_MAX]
    stored = quantize(x, scale, FP8)
    assert stored.dtype == FP8
    read = dequantize(stored, scale, torch.float32)
    # 3 mantissa bits: half an ulp is 2**-4 of the value for normals; subnormals step by 2**-9
    bound = torch.maximum(x.abs() * 2**-4, torch.full_like(x, 2**-10 * scale)) * (1 + 1e-5)
    assert bool(((read - x).abs() <= bound).all())
    assert torch.equal(round_trip(x, scale, FP8), read)
    assert (read != x).any()  # the pool really rounds (the test would pass on a no-op otherwise)


@pytest.mark.parametrize("scale", SCALES)
def test_saturates_at_448_times_the_scale(scale):
    x = torch.tensor([1e6, 449.0, 448.0, -448.0, -460.0, -1e9]) * scale
    read = dequantize(quantize(x, scale, FP8), scale, torch.float32)
    want = torch.tensor([448.0, 448.0, 448.0, -448.0, -448.0, -448.0]) * scale
    torch.testing.assert_close(read, want, rtol=1e-6, atol=0)
    assert torch.isfinite(read).all()


def test_an_unquantized_pool_is_stored_and_read_as_it_is():
    x = torch.randn(64).to(torch.bfloat16)
    assert torch.equal(quantize(x, 1.0, torch.bfloat16), x) and round_trip(x, 1.0, torch.bfloat16) is x
    assert pool_dtype("auto", torch.bfloat16) == torch.bfloat16 and pool_dtype("fp8_e4m3", torch.float32) == FP8
    with pytest.raises(ValueError, match="'fp8_e5m2'"):
        pool_dtype("fp8_e5m2", torch.float32)


def _config() -> ModelConfig:
    return ModelConfig.from_dir(tiny_model_dirs()[0])


def test_kv_cache_scales_and_kv_dtype():
    c = _config()
    layers = c.num_hidden_layers
    plain = KvCache(c, 4, 16, torch.bfloat16, "cpu")
    assert plain.kv_dtype == "bfloat16" and plain.k_scales == plain.v_scales == (1.0,) * layers
    fp8 = KvCache(c, 4, 16, FP8, "cpu", k_scales=(0.5,) * layers, v_scales=tuple(range(1, layers + 1)))
    assert fp8.kv_dtype == "float8_e4m3fn" and fp8.buffer.dtype == FP8
    assert fp8.k_scales == (0.5,) * layers and fp8.v_scales == tuple(float(i) for i in range(1, layers + 1))
    assert fp8.page_bytes * 2 == plain.page_bytes and fp8.num_bytes * 2 == plain.num_bytes
    with pytest.raises(ValueError, match=f"k_scales has 1 values, the model has {layers} layers"):
        KvCache(c, 4, 16, FP8, "cpu", k_scales=(0.5,))
    with pytest.raises(ValueError, match="v_scales: layer 0 has scale -1.0"):
        KvCache(c, 4, 16, FP8, "cpu", v_scales=(-1.0,) * layers)
    with pytest.raises(ValueError, match="need an FP8 pool, this pool is torch.bfloat16"):
        KvCache(c, 4, 16, torch.bfloat16, "cpu", k_scales=(0.5,) * layers)


def _pools(k_scale: float, v_scale: float, page_size: int = 4, num_pages: int = 24):
    """An FP8 pool and an fp32 pool of the same shape, over the tiny config."""
    c = dataclasses.replace(_config(), num_hidden_layers=1)
    fp8 = KvCache(c, num_pages, page_size, FP8, "cpu", k_scales=(k_scale,), v_scales=(v_scale,))
    ref = KvCache(c, num_pages, page_size, torch.float32, "cpu")
    return c, fp8, ref


@pytest.mark.parametrize("query_lens, starts", [([21], [0]), ([9, 4], [5, 0]), ([1, 3, 2], [10, 0, 17])])
def test_fp8_paged_attention_equals_attention_over_the_round_tripped_kv(query_lens, starts):
    """Per-chunk (prefill, extend over cached pages) and padded (decode, verify) paths: an FP8 pool
    attends exactly as a full-precision pool holding round_trip(K), round_trip(V)."""
    k_scale, v_scale = 0.02, 0.37
    c, fp8, ref = _pools(k_scale, v_scale)
    gen = torch.Generator().manual_seed(1)
    kv_lens = [s + n for s, n in zip(starts, query_lens)]
    tables, at = [], 0
    for n in kv_lens:
        tables.append(list(range(at + 5, at + 5 + -(-n // fp8.page_size)))[::-1])  # scattered, descending
        at += -(-n // fp8.page_size)
    # every token of every context is written first (the cached prefix and the new tokens)
    whole = build_plan(kv_lens, [0] * len(kv_lens), tables, fp8.page_size, torch.device("cpu"))
    k = torch.randn(sum(kv_lens), fp8.num_kv_heads, c.head_dim, generator=gen) * 3
    v = torch.randn(sum(kv_lens), fp8.num_kv_heads, c.head_dim, generator=gen)
    write_kv(fp8.k[0], fp8.v[0], k, v, whole, k_scale, v_scale)
    write_kv(ref.k[0], ref.v[0], round_trip(k, k_scale, FP8), round_trip(v, v_scale, FP8), whole)
    stored_k = fp8.k[0][whole.write_pages, whole.write_rows]
    assert torch.equal(dequantize(stored_k, k_scale, torch.float32), ref.k[0][whole.write_pages, whole.write_rows])
    plan = build_plan(query_lens, starts, tables, fp8.page_size, torch.device("cpu"))
    q = torch.randn(sum(query_lens), c.num_attention_heads, c.head_dim, generator=gen)
    got = paged_attention(q, fp8.k[0], fp8.v[0], plan, None, c.head_dim**-0.5, k_scale, v_scale)
    want = paged_attention(q, ref.k[0], ref.v[0], plan, None, c.head_dim**-0.5)
    assert torch.equal(got, want)
    unquantized = paged_attention(q, *_filled(ref, k, v, whole), plan, None, c.head_dim**-0.5)
    assert not torch.equal(got, unquantized)  # FP8 changed the values it attends over


def _filled(pool: KvCache, k, v, plan):
    pool.buffer.zero_()
    write_kv(pool.k[0], pool.v[0], k, v, plan)
    return pool.k[0], pool.v[0]


def _with_scales(src: str, dst: Path, k_scales: list[float], v_scales: list[float]) -> str:
    """A copy of checkpoint ``src`` whose model.safetensors also holds per-layer k_scale/v_scale."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for i, scale in enumerate(k_scales):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(scale)  # 0-d, as vLLM's checkpoints
    for i, scale in enumerate(v_scales):
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([scale])
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def test_scales_load_from_the_checkpoint_and_each_pool_has_its_own(tmp_path):
    target, draft = tiny_model_dirs()
    layers = ModelConfig.from_dir(target).num_hidden_layers
    draft_layers = ModelConfig.from_dir(draft).num_hidden_layers
    k_scales, v_scales = [0.5 + i for i in range(layers)], [0.25] * (layers - 1)  # last layer: none
    scaled = _with_scales(target, tmp_path / "target", k_scales, v_scales)
    assert read_kv_scales(scaled, layers) == (tuple(k_scales), tuple(v_scales) + (1.0,))
    assert read_kv_scales(target, layers) == ((1.0,) * layers, (1.0,) * layers)
    scaled_draft = _with_scales(draft, tmp_path / "draft", [2.0] * draft_layers, [4.0] * draft_layers)
    runner = build_runner(scaled, scaled_draft, page_size=16, max_total_tokens=256, kv_cache_dtype="fp8_e4m3")
    assert runner.target.kv.kv_dtype == runner.draft.kv.kv_dtype == "float8_e4m3fn"
    assert runner.target.kv.k_scales == tuple(k_scales) and runner.target.kv.v_scales[-1] == 1.0
    assert runner.draft.kv.k_scales == (2.0,) * draft_layers and runner.draft.kv.v_scales == (4.0,) * draft_layers
    auto = build_runner(scaled, None, page_size=16, max_total_tokens=256)  # auto: the scales are not applied
    assert auto.target.kv.kv_dtype == "float32" and auto.target.kv.k_scales == (1.0,) * layers


def test_a_scale_that_is_not_one_positive_number_is_refused(tmp_path):
    target = tiny_model_dirs()[0]
    layers = ModelConfig.from_dir(target).num_hidden_layers
    bad = _with_scales(target, tmp_path / "bad", [1.0] * layers, [1.0] * layers)
    tensors = load_file(str(Path(bad) / "model.safetensors"))
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor([0.0])
    save_file(tensors, str(Path(bad) / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.self_attn.v_scale' must be one positive finite "
                                             r"number, got shape \(1,\) values \[0.0\]"):
        read_kv_scales(bad, layers)


def test_kv_cache_dtype_flag_defaults_to_auto_and_refuses_others():
    target = tiny_model_dirs()[0]
    default = parse_config(PrefillConfig, ["--model", target], env={})
    assert default.kv_cache_dtype == "auto" and default.kv_torch_dtype_name == default.torch_dtype_name
    fp8 = parse_config(PrefillConfig, ["--model", target], env={"KVFERRY_KV_CACHE_DTYPE": "fp8_e4m3"})
    assert fp8.kv_torch_dtype_name == "float8_e4m3fn" and fp8.engine_options["kv_cache_dtype"] == "fp8_e4m3"
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype='int8' is not one of \['auto', 'fp8_e4m3'\]"):
        parse_config(PrefillConfig, ["--model", target], env={"KVFERRY_KV_CACHE_DTYPE": "int8"})


def test_auto_tokens_doubles_for_fp8_at_the_same_budget(monkeypatch):
    target = tiny_model_dirs()[0]
    configs = [ModelConfig.from_dir(target)]
    per_token_bf16 = start.kv_bytes_per_token(configs, 1, "bfloat16")
    assert start.kv_bytes_per_token(configs, 1, "float8_e4m3fn") * 2 == per_token_bf16
    # MemAvailable fixed so that half of it is 1,024 bf16 tokens: both counts stay below the caps
    monkeypatch.setattr(start, "_mem_available", lambda: 2 * 1024 * per_token_bf16)
    tokens = {}
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        c = parse_config(PrefillConfig, ["--model", target, "--dtype", "bfloat16", "--kv-mem-fraction", "0.5",
                                         "--kv-cache-dtype", kv_cache_dtype], env={})
        tokens[kv_cache_dtype] = start.auto_tokens(c, Path(target), configs)
    assert tokens == {"auto": 1024, "fp8_e4m3": 2048}
