"""DeepSeek-V2/V3 under tensor parallelism, on the tiny presets (4 heads, fp32, CPU): greedy tokens
at TP 2 and TP 4 (ranks as threads, tests/tp_threads.py) equal TP 1 and the prefill logits agree,
the TP 2 process engine (rank 0 here, rank 1 a ``tp_worker``, each with its whole latent pool)
decodes what TP 1 decodes, each rank's shards concatenate back to the checkpoint's weights, the
routed experts through ``fused_moe`` equal the expert-by-expert loop they replaced, and the
refusals name the valid TP sizes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from kvferry.common.cache.mla_cache import LatentCache
from kvferry.common.engine.colocated import ColocatedEngine
from kvferry.common.engine.factory import build_runner
from kvferry.common.layers.attn_backend import TorchBackend
from kvferry.common.layers.tp_layers import TpConfigError, TpShard, valid_tp_sizes
from kvferry.common.models.config import ModelConfig
from kvferry.common.models.deepseek import MoeBlock, route
from kvferry.common.models.loader import load_model
from kvferry.common.models.tiny import make_tiny_model
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.text.tokenizer import Tokenizer
from tests.tp_threads import PROMPTS, greedy_in_threads, prefill_logits_in_threads

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)
NUM_STEPS = 8
REL_TOL = 1e-5


@pytest.fixture(scope="module", params=["deepseek-v2-tiny", "deepseek-v3-tiny"])
def model_dir(request, tmp_path_factory) -> str:
    target, _ = make_tiny_model(tmp_path_factory.mktemp(request.param), seed=3, preset=request.param)
    return str(target)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_greedy_in_threads_equals_tp1(model_dir, tp_size):
    assert greedy_in_threads(model_dir, tp_size, num_steps=NUM_STEPS) == greedy_in_threads(
        model_dir, 1, num_steps=NUM_STEPS)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_prefill_logits_close_to_tp1(model_dir, tp_size):
    reference = prefill_logits_in_threads(model_dir, 1)
    for prompt, got, ref in zip(PROMPTS, prefill_logits_in_threads(model_dir, tp_size), reference):
        assert got.shape == ref.shape == (len(prompt), ref.shape[1])
        assert float((got - ref).abs().max() / ref.abs().max()) <= REL_TOL, f"prompt of {len(prompt)} tokens"


def _with_attention_bias(model_dir: str, out: Path) -> str:
    """A copy of the checkpoint with ``attention_bias``: random q_a / kv_a / o_proj biases."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["attention_bias"] = True
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(4)
    for name, weight in list(tensors.items()):
        if name.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "o_proj.weight")):
            bias = torch.randn(weight.shape[0], generator=gen) * 0.5
            tensors[name.removesuffix("weight") + "bias"] = bias.to(weight.dtype)
    save_file(tensors, out / "model.safetensors")
    return str(out)


def test_o_proj_bias_is_added_once(model_dir, tmp_path):
    """Row-parallel o_proj: rank 0 alone adds its bias (every rank adding it would count it TP times)."""
    biased = _with_attention_bias(model_dir, tmp_path / "biased")
    assert load_model(biased).config.deepseek.has_attention_bias
    reference = prefill_logits_in_threads(biased, 1)
    assert not torch.allclose(reference[1], prefill_logits_in_threads(model_dir, 1)[1])  # the biases count
    for got, ref in zip(prefill_logits_in_threads(biased, 2), reference):
        assert float((got - ref).abs().max() / ref.abs().max()) <= REL_TOL


def test_tp2_engine_decodes_like_tp1(model_dir):
    """The process engine: rank 1 is a worker process building its own latent pool (make_kv_cache)."""
    params = SamplingParams(max_new_tokens=NUM_STEPS, temperature=0, ignore_eos=True)
    prompts = [list(p) for p in PROMPTS]
    options = {"page_size": 16, "max_total_tokens": 2048, "dtype": "float32"}
    tp1 = ColocatedEngine(build_runner(model_dir, **options), Tokenizer.from_dir(model_dir)).generate(prompts, params)
    runner = build_runner(model_dir, tp_size=2, tp_num_threads=1, **options)
    try:
        kv = runner.target.kv
        assert isinstance(kv, LatentCache) and runner.target.tp is not None
        assert [(r.head_start, r.num_heads) for r in kv.regions()] == [(0, 1)] * kv.config.num_hidden_layers
        got = ColocatedEngine(runner, Tokenizer.from_dir(model_dir)).generate(prompts, params)
    finally:
        runner.close()
    assert [r.output_ids for r in got] == [r.output_ids for r in tp1]
    assert all(len(r.output_ids) == NUM_STEPS for r in got)


def _cat_halves(parts: list[torch.Tensor], dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused gate/up rows of each rank, split in two and concatenated over the ranks."""
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([g for g, _ in halves], dim=dim), torch.cat([u for _, u in halves], dim=dim)


def _assert_mlp_concatenates(parts, whole, dim: int) -> None:
    gate, up = _cat_halves([p.gate_up_weight if dim == 0 else p.w13 for p in parts], dim)
    full = whole.gate_up_weight if dim == 0 else whole.w13
    assert torch.equal(torch.cat((gate, up), dim=dim), full)
    down = [p.down_weight if dim == 0 else p.w2 for p in parts]
    assert torch.equal(torch.cat(down, dim=dim + 1), whole.down_weight if dim == 0 else whole.w2)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_rank_shards_concatenate_to_the_checkpoint(model_dir, tp_size):
    full = load_model(model_dir, dtype="float32")
    ranks = [load_model(model_dir, dtype="float32", tp_size=tp_size, tp_rank=r) for r in range(tp_size)]
    for i, whole in enumerate(full.layers):
        parts = [m.layers[i] for m in ranks]
        attn, rank_attn = whole.self_attn, [p.self_attn for p in parts]
        q_name = "q_weight" if full.config.deepseek.q_lora_rank is None else "q_b_weight"
        for name in (q_name, "kv_b_weight"):  # per-head rows
            assert torch.equal(torch.cat([getattr(a, name) for a in rank_attn]), getattr(attn, name)), name
        assert torch.equal(torch.cat([a.o_weight for a in rank_attn], dim=1), attn.o_weight)
        replicated = ["kv_a_weight", "kv_a_norm"] + ([] if q_name == "q_weight" else ["q_a_weight", "q_a_norm"])
        for a in rank_attn:
            assert all(torch.equal(getattr(a, n), getattr(attn, n)) for n in replicated)
        if isinstance(whole.mlp, MoeBlock):
            _assert_mlp_concatenates([p.mlp for p in parts], whole.mlp, 1)  # the shared experts after the routed
            assert whole.mlp.w13.shape[0] == full.config.deepseek.n_routed_experts + full.config.deepseek.n_shared_experts
            assert all(torch.equal(p.mlp.gate_weight, whole.mlp.gate_weight) for p in parts)
        else:
            _assert_mlp_concatenates([p.mlp for p in parts], whole.mlp, 0)
    for m in ranks:
        assert torch.equal(m.embed, full.embed) and torch.equal(m.norm, full.norm)


def _experts_one_by_one(block: MoeBlock, h: torch.Tensor) -> torch.Tensor:
    """The per-expert torch loop ``MoeBlock`` ran before ``fused_moe``, then the shared experts as
    the one dense SwiGLU of the checkpoint (their gate, up and down rows side by side)."""
    weights, ids = route(F.linear(h.float(), block.gate_weight), block.spec, block.score_bias)
    out = torch.zeros_like(h)
    for expert in ids.unique().tolist():
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(h[tokens], block.w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, block.w2[expert])
        out.index_add_(0, tokens, (y * weights[tokens, slots, None]).to(out.dtype))
    shared = range(block.experts.count, block.w13.shape[0])
    gate = torch.cat([block.w13[e].chunk(2)[0] for e in shared])
    up = torch.cat([block.w13[e].chunk(2)[1] for e in shared])
    down = torch.cat([block.w2[e] for e in shared], dim=1)
    return out + F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)


def test_fused_experts_equal_the_per_expert_loop(model_dir):
    """At TP 1 the block equals the loop; at TP 2 the ranks' partial sums add up to it."""
    whole = load_model(model_dir, dtype="float32").layers[1].mlp
    h = torch.randn(37, whole.gate_weight.shape[1], generator=torch.Generator().manual_seed(5))
    reference = _experts_one_by_one(whole, h)
    torch.testing.assert_close(whole(h, TorchBackend()), reference, rtol=1e-5, atol=1e-5)
    with pytest.MonkeyPatch.context() as patch:  # the shared experts in launches of their own (engine --shared-ab)
        patch.setattr(MoeBlock, "fold_shared", False)
        torch.testing.assert_close(whole(h, TorchBackend()), reference, rtol=1e-5, atol=1e-5)
    ranks = [load_model(model_dir, dtype="float32", tp_size=2, tp_rank=r).layers[1].mlp for r in range(2)]
    torch.testing.assert_close(sum(block(h, TorchBackend()) for block in ranks), reference, rtol=1e-5, atol=1e-5)


def test_refusals_name_the_valid_sizes(model_dir):
    with pytest.raises(TpConfigError, match=r"--tp-size 3: 4 attention heads do not divide by 3.*: 1, 2, 4$"):
        build_runner(model_dir, tp_size=3)
    model = load_model(model_dir, dtype="float32", tp_size=2, tp_rank=1)
    assert (model.shard.kv_heads.start, model.shard.kv_heads.count) == (0, 1)  # the latent, on every rank
    with pytest.raises(ValueError, match="head_start 2, num_kv_heads 2"):
        type(model).make_kv_cache(model.config, 8, 16, torch.float32, "cpu", head_start=2, num_kv_heads=2)


def _covers(blocks, full: int) -> bool:
    """Whether the ranks' blocks, in rank order, tile [0, full) exactly."""
    return [(b.start, b.stop) for b in blocks] == [(i * full // len(blocks), (i + 1) * full // len(blocks))
                                                   for i in range(len(blocks))]


@settings(max_examples=150, deadline=None)
@given(tp_size=st.integers(1, 8), sizes=st.tuples(*[st.integers(1, 6)] * 3), num_shared=st.integers(0, 3),
       offsets=st.tuples(*[st.sampled_from([0, 0, 1])] * 3))
def test_valid_sizes_tile_every_sharded_dim(tp_size, sizes, num_shared, offsets):
    """A valid TP size tiles the heads and every intermediate dim exactly, the latent on every
    rank; any other is refused with the valid sizes listed. (Dims are multiples of ``tp_size``,
    some plus one, so both sides are drawn often.)"""
    heads, inter, moe_inter = (tp_size * n + extra for n, extra in zip(sizes, offsets))
    raw = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64, "vocab_size": 97, "num_hidden_layers": 2,
           "num_attention_heads": heads, "num_key_value_heads": heads, "intermediate_size": inter,
           "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
           "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": moe_inter,
           "n_shared_experts": num_shared, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1}
    config = ModelConfig.from_dict(raw)
    valid = valid_tp_sizes(config)
    if tp_size not in valid:
        with pytest.raises(TpConfigError, match=f"--tp-size {tp_size}: .*: {', '.join(map(str, valid))}$"):
            TpShard.of(config, tp_size, 0)
        return
    shards = [TpShard.of(config, tp_size, r) for r in range(tp_size)]
    assert _covers([s.q_heads for s in shards], heads) and _covers([s.inter for s in shards], inter)
    assert _covers([s.moe_inter for s in shards], moe_inter)  # every expert's, the shared ones' too (stacked)
    assert all((s.kv_heads.start, s.kv_heads.count) == (0, 1) for s in shards)
