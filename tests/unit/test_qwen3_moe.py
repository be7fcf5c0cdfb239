"""Qwen3-MoE (``common/models/qwen3_moe.py``) against transformers' ``Qwen3MoeForCausalLM`` on the
``tiny-moe`` preset (fp32, CPU): prefill logits, paged decode, greedy tokens at TP 1, 2 and 4 (ranks
as threads), the checkpoint names of the Hub and of transformers 5's ``save_pretrained``, the
config fields and their refusals."""

from __future__ import annotations

import inspect
import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvferry.common.cache.kv_cache import KvCache, PageAllocator  # noqa: E402
from kvferry.common.errors import ModelLoadError  # noqa: E402
from kvferry.common.layers.tp_layers import TpConfigError, TpShard, valid_tp_sizes  # noqa: E402
from kvferry.common.models.config import ModelConfig  # noqa: E402
from kvferry.common.models.llama import DecoderLayer, SeqChunk  # noqa: E402
from kvferry.common.models.loader import load_model  # noqa: E402
from kvferry.common.models.qwen3_moe import MoeDecoderLayer, Qwen3MoeForCausalLM  # noqa: E402
from kvferry.common.models.tiny import make_tiny_model  # noqa: E402
from kvferry.common.plan.tp import HeadRange  # noqa: E402
from tests.tp_threads import PROMPTS, greedy_in_threads  # noqa: E402

torch.set_num_threads(1)
PAGE_SIZE = 4
REL_TOL = 1e-4
NUM_STEPS = 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    target, _ = make_tiny_model(tmp_path_factory.mktemp("tiny-moe"), seed=2, preset="tiny-moe")
    return target


@pytest.fixture(scope="module")
def pair(tiny_dir, tmp_path_factory):
    """(transformers model, our model, checkpoint dir): the preset read by transformers, its norms
    perturbed (the preset's are ones), written back by its save_pretrained, and loaded by us."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp("saved")
    hf.save_pretrained(out)
    return hf, load_model(out, dtype=torch.float32), out


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 512) for _ in range(n)]


def test_the_preset_is_what_transformers_builds(tiny_dir):
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(hf.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"  # mlp_only_layers=[1]
    assert [type(hf.model.layers[i].mlp).__name__ for i in (0, 2, 3)] == ["Qwen3MoeSparseMoeBlock"] * 3
    ours = load_model(tiny_dir)
    assert isinstance(ours, Qwen3MoeForCausalLM)
    assert [type(layer) for layer in ours.layers] == [MoeDecoderLayer, DecoderLayer, MoeDecoderLayer, MoeDecoderLayer]
    assert ours.config.moe.sparse_layers == (True, False, True, True)


def test_save_pretrained_names_load_the_same_weights(pair, tiny_dir):
    """transformers 5 holds experts fused ([E, 2I, H]) but writes one tensor per expert: both load."""
    hf, ours, _ = pair
    fused = hf.model.layers[2].mlp.experts
    torch.testing.assert_close(ours.layers[2].moe.w13, fused.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(ours.layers[2].moe.w2, fused.down_proj, rtol=0, atol=0)
    torch.testing.assert_close(ours.layers[2].moe.gate_weight, hf.model.layers[2].mlp.gate.weight, rtol=0, atol=0)
    original = load_model(tiny_dir)
    assert torch.equal(original.layers[3].moe.w13, ours.layers[3].moe.w13)


def _kv(model, num_pages: int = 128):
    return KvCache(model.config, num_pages, PAGE_SIZE, torch.float32, "cpu"), PageAllocator(num_pages)


def test_prefill_logits_match(pair):
    hf, ours, _ = pair
    prompt = _prompt(random.Random(1), 21)
    kv, alloc = _kv(ours)
    logits = ours.forward([SeqChunk(prompt, 0, alloc.allocate(6))], kv, all_logits=True)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert logits.shape == ref.shape
    assert _rel_err(logits, ref) <= REL_TOL


def test_paged_decode_matches_transformers_cache(pair):
    hf, ours, _ = pair
    cache_kwarg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    rng = random.Random(2)
    prompt, steps = _prompt(rng, 9), _prompt(rng, 6)
    kv, alloc = _kv(ours)
    pages = alloc.allocate(4)
    ours.forward([SeqChunk(prompt, 0, pages)], kv)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for i, token in enumerate(steps):
            mine = ours.forward([SeqChunk([token], 9 + i, pages)], kv)[0]
            out = hf(torch.tensor([[token]]), **{cache_kwarg: out.past_key_values}, use_cache=True)
            assert _rel_err(mine, out.logits[0, -1].float()) <= REL_TOL, f"step {i}"


@pytest.fixture(scope="module")
def reference(pair) -> list[list[int]]:
    """transformers' greedy tokens of tests/tp_threads.PROMPTS."""
    hf = pair[0]
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NUM_STEPS,
                            min_new_tokens=NUM_STEPS)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_greedy_equals_generate_at_every_tp_size(pair, reference, tp_size):
    """Batched paged prefill then batched decode; at TP > 1 each rank holds its block of every
    expert's intermediate dim and the MoE output is summed once per layer."""
    assert greedy_in_threads(str(pair[2]), tp_size, num_steps=NUM_STEPS) == reference


def test_rank_shards_concatenate_to_the_experts(pair):
    _, whole, path = pair
    ranks = [load_model(path, dtype=torch.float32, tp_size=2, tp_rank=r) for r in range(2)]
    inter = whole.config.moe.moe_intermediate_size
    parts = [m.layers[0].moe for m in ranks]
    assert all(p.w13.shape == (8, inter, 64) and p.w2.shape == (8, 64, inter // 2) for p in parts)
    gate_up = [p.w13.split(inter // 2, dim=1) for p in parts]
    assert torch.equal(torch.cat([g for g, _ in gate_up], dim=1), whole.layers[0].moe.w13[:, :inter])
    assert torch.equal(torch.cat([u for _, u in gate_up], dim=1), whole.layers[0].moe.w13[:, inter:])
    assert torch.equal(torch.cat([p.w2 for p in parts], dim=2), whole.layers[0].moe.w2)
    assert all(torch.equal(p.gate_weight, whole.layers[0].moe.gate_weight) for p in parts)


def _raw(tiny_dir, **overrides) -> dict:
    raw = json.loads((tiny_dir / "config.json").read_text())
    raw.update(overrides)
    return raw


def test_config_fields_of_the_hub_and_of_transformers5(tiny_dir):
    hub = ModelConfig.from_dict(_raw(tiny_dir))  # "num_experts", as Qwen3-30B-A3B's config.json
    v5 = _raw(tiny_dir, num_local_experts=8)
    del v5["num_experts"]
    assert ModelConfig.from_dict(v5).moe == hub.moe
    assert hub.has_qk_norm and hub.moe.num_experts_per_tok == 2 and hub.moe.norm_topk_prob
    every_other = ModelConfig.from_dict(_raw(tiny_dir, decoder_sparse_step=2, mlp_only_layers=[]))
    hf_config = transformers.Qwen3MoeConfig(**_raw(tiny_dir, decoder_sparse_step=2, mlp_only_layers=[]))
    hf_sparse = [i not in hf_config.mlp_only_layers and (i + 1) % hf_config.decoder_sparse_step == 0
                 for i in range(4)]
    assert list(every_other.moe.sparse_layers) == hf_sparse == [False, True, False, True]
    assert hub.fingerprint != ModelConfig.from_dict(_raw(tiny_dir, num_experts=16)).fingerprint


@pytest.mark.parametrize("overrides, field", [
    ({"mlp_only_layers": [4]}, "mlp_only_layers"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size"),
    ({"num_experts": 0}, "num_experts"),
])
def test_config_errors_name_the_field(tiny_dir, overrides, field):
    with pytest.raises(ModelLoadError, match=field):
        ModelConfig.from_dict(_raw(tiny_dir, **overrides), source="x/config.json")


def test_tp_size_must_divide_the_experts_intermediate_size(tiny_dir):
    config = ModelConfig.from_dict(_raw(tiny_dir, moe_intermediate_size=26), source="x/config.json")
    with pytest.raises(TpConfigError, match=r"MoE intermediate size 26 does not divide by 4.*valid sizes.*1, 2"):
        TpShard.of(config, 4, 0)
    assert TpShard.of(config, 2, 1).moe_inter == HeadRange(13, 13)
    # the rule binds MoE models only: a dense config keeps its sizes and holds no expert block
    dense = ModelConfig.from_dict({**_raw(tiny_dir), "architectures": ["Qwen3ForCausalLM"]})
    assert valid_tp_sizes(dense) == [1, 2, 4] and TpShard.of(dense, 4, 3).moe_inter is None


def test_fused_experts_checkpoint_loads_the_same_weights(pair, tmp_path):
    """save_pretrained(save_original_format=False) writes transformers 5's fused expert tensors
    (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]): they load into
    the same weights, at TP 2 too."""
    from safetensors import safe_open

    hf, ours, per_expert = pair
    hf.save_pretrained(tmp_path, save_original_format=False)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    fused = load_model(tmp_path, dtype=torch.float32)
    for a, b in zip(fused.state_dict().values(), ours.state_dict().values()):
        assert torch.equal(a, b)
    for rank in range(2):
        want = load_model(per_expert, dtype=torch.float32, tp_size=2, tp_rank=rank)
        got = load_model(tmp_path, dtype=torch.float32, tp_size=2, tp_rank=rank)
        assert torch.equal(got.layers[3].moe.w13, want.layers[3].moe.w13)
        assert torch.equal(got.layers[3].moe.w2, want.layers[3].moe.w2)


def test_a_fused_experts_tensor_of_the_wrong_shape_names_it(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    pair[0].save_pretrained(tmp_path, save_original_format=False)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.2.mlp.experts.down_proj"
    tensors[name] = tensors[name][:, :, :-1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.mlp\.experts\.0\.down_proj\.weight.*shape"):
        load_model(tmp_path)
