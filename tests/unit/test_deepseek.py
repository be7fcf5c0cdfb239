"""DeepSeek-V2/V3 (MLA + MoE) against transformers on the tiny presets (fp32, CPU), and the latent pool."""

from __future__ import annotations

import dataclasses
import inspect
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvferry.common.cache.kv_cache import KV_LAYOUTS, PageAllocator  # noqa: E402
from kvferry.common.cache.mla_cache import LatentCache  # noqa: E402
from kvferry.common.errors import ModelLoadError  # noqa: E402
from kvferry.common.layers import rope  # noqa: E402
from kvferry.common.layers.attn_backend import TorchBackend  # noqa: E402
from kvferry.common.layers.norm import rms_norm  # noqa: E402
from kvferry.common.layers.tp_layers import TpConfigError, TpShard  # noqa: E402
from kvferry.common.models.config import ModelConfig  # noqa: E402
from kvferry.common.models.deepseek import DeepseekForCausalLM, route  # noqa: E402
from kvferry.common.models.llama import SeqChunk  # noqa: E402
from kvferry.common.models.loader import load_model  # noqa: E402
from kvferry.common.models.tiny import make_tiny_model  # noqa: E402
from kvferry.common.wire.messages import LATENT_KIND  # noqa: E402

torch.set_num_threads(1)
PAGE_SIZE = 4
REL_TOL = 1e-4
PRESETS = ["deepseek-v2-tiny", "deepseek-v3-tiny"]


@pytest.fixture(scope="module", params=PRESETS)
def pair(request, tmp_path_factory):
    """(transformers model, our model) on one tiny preset's target checkpoint."""
    target, _ = make_tiny_model(tmp_path_factory.mktemp(request.param), seed=1, preset=request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # greedy runs its full length, as ours does (no EOS masking)
    return hf, load_model(target, dtype=torch.float32)


def _kv(model, layout: str = "page-major", num_pages: int = 64) -> tuple[LatentCache, PageAllocator]:
    kv = type(model).make_kv_cache(model.config, num_pages, PAGE_SIZE, torch.float32, "cpu", layout=layout)
    return kv, PageAllocator(num_pages)


def _pages(alloc: PageAllocator, num_tokens: int) -> list[int]:
    """Scattered, out-of-order pages, as a long-lived pool hands out."""
    pages = alloc.allocate(-(-num_tokens // PAGE_SIZE))
    random.Random(num_tokens).shuffle(pages)
    return pages


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 500) for _ in range(n)]


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def test_the_presets_parse_as_deepseek(pair):
    hf, ours = pair
    s, c = ours.config.deepseek, ours.config
    assert isinstance(ours, DeepseekForCausalLM) and c.architecture == hf.config.architectures[0]
    assert s.version == (3 if "V3" in c.architecture else 2)
    assert (s.q_lora_rank is None) == (s.version == 2)
    assert s.latent_width == s.kv_lora_rank + s.qk_rope_head_dim == 48
    assert c.head_dim == s.qk_rope_head_dim and c.rope_scaling.rope_type == "yarn"
    assert [s.is_moe_layer(i) for i in range(c.num_hidden_layers)] == [False, True, True]


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_prefill_logits_match(pair, layout):
    hf, ours = pair
    prompt = _prompt(random.Random(1), 13)
    kv, alloc = _kv(ours, layout)
    logits = ours.forward([SeqChunk(prompt, 0, _pages(alloc, 13))], kv, all_logits=True)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert logits.shape == ref.shape and _rel_err(logits, ref) <= REL_TOL


def test_paged_decode_matches_transformers_cache(pair):
    """Prefill 7 tokens, then 9 one-token steps over pages of 4: every step's logits."""
    hf, ours = pair
    cache_kwarg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    rng = random.Random(2)
    prompt, steps = _prompt(rng, 7), _prompt(rng, 9)
    kv, alloc = _kv(ours)
    pages = _pages(alloc, 16)
    ours.forward([SeqChunk(prompt, 0, pages)], kv)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for i, token in enumerate(steps):
            mine = ours.forward([SeqChunk([token], 7 + i, pages)], kv)[0]
            out = hf(torch.tensor([[token]]), **{cache_kwarg: out.past_key_values}, use_cache=True)
            assert _rel_err(mine, out.logits[0, -1].float()) <= REL_TOL, f"step {i}"


def test_batched_greedy_equals_generate(pair):
    """Batched prefill, then batched one-token steps (the padded path) across page boundaries."""
    hf, ours = pair
    rng = random.Random(3)
    prompts = [_prompt(rng, n) for n in (1, 4, 6, 11)]
    max_new = 7
    kv, alloc = _kv(ours)
    pages = [_pages(alloc, len(p) + max_new) for p in prompts]
    outs = [[int(row.argmax())] for row in ours.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], kv)]
    for _ in range(max_new - 1):
        chunks = [SeqChunk([o[-1]], len(p) + len(o) - 1, pg) for p, o, pg in zip(prompts, outs, pages)]
        for o, row in zip(outs, ours.forward(chunks, kv)):
            o.append(int(row.argmax()))
    for prompt, got in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new)
        assert got == ref[0, len(prompt):].tolist(), f"prompt length {len(prompt)}"


def test_chunked_extend_equals_one_prefill(pair):
    """Prefill in pieces, with a mixed batch (a 5-token extend beside a decode step), gives the
    logits of one prefill."""
    _, ours = pair
    rng = random.Random(5)
    prompt, other = _prompt(rng, 17), _prompt(rng, 6)
    kv, alloc = _kv(ours)
    whole = ours.forward([SeqChunk(prompt, 0, _pages(alloc, 17))], kv, all_logits=True)[0]
    kv2, alloc2 = _kv(ours)
    pages, pages_other = _pages(alloc2, 17), _pages(alloc2, 7)
    first = ours.forward([SeqChunk(prompt[:6], 0, pages), SeqChunk(other, 0, pages_other)], kv2, all_logits=True)[0]
    mid, _ = ours.forward([SeqChunk(prompt[6:11], 6, pages), SeqChunk([3], 6, pages_other)], kv2, all_logits=True)
    last = ours.forward([SeqChunk(prompt[11:], 11, pages)], kv2, all_logits=True)[0]
    assert _rel_err(torch.cat([first, mid, last]), whole) <= REL_TOL


def _expanded_attention(attn, h: torch.Tensor, rotary) -> torch.Tensor:
    """Transformers' form over the same projections: per-head k = [W_UK c | k_pe], v = W_UV c, causal SDPA."""
    s, heads = attn.spec, attn.config.num_attention_heads
    positions = torch.arange(h.shape[0])
    q_nope, q_pe, rows = attn.project(h, rotary, rotary.cos_sin(positions), TorchBackend())
    latent, k_pe = rows.split([s.kv_lora_rank, s.qk_rope_head_dim], -1)
    kv = torch.nn.functional.linear(latent, attn.kv_b_weight).view(-1, heads, s.qk_nope_head_dim + s.v_head_dim)
    k_nope, v = kv.split([s.qk_nope_head_dim, s.v_head_dim], -1)
    k = torch.cat((k_nope, k_pe[:, None].expand(-1, heads, -1)), -1)
    q = torch.cat((q_nope, q_pe), -1)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                         is_causal=True, scale=attn.scale)
    return torch.nn.functional.linear(o.transpose(0, 1).reshape(h.shape[0], -1), attn.o_weight)


def test_absorbed_attention_equals_the_expanded_form(pair):
    """Prefill (per-chunk path) and a batch of decode steps (padded path) of one layer's absorbed
    MLA equal the expanded attention over the same rows."""
    _, ours = pair
    layer = ours.layers[1].self_attn
    torch.manual_seed(0)
    h = torch.randn(10, ours.config.hidden_size)
    expanded = _expanded_attention(layer, h, ours.rotary)
    kv, alloc = _kv(ours)
    pages, backend = _pages(alloc, 10), ours.attn
    _, plan = backend.plan([SeqChunk([0] * 7, 0, pages)], PAGE_SIZE, torch.device("cpu"))
    assert plan.chunk_pages is not None  # the per-chunk path
    prefill = layer(h[:7], ours.rotary, ours.rotary.cos_sin(plan.positions), kv.latent[1], plan, backend)
    decoded = []
    for pos in range(7, 10):  # beside a second one-token sequence, so the batch takes the padded path
        _, plan = backend.plan([SeqChunk([0], pos, pages), SeqChunk([0], 0, [alloc.allocate(1)[0]])], PAGE_SIZE,
                               torch.device("cpu"))
        out = layer(torch.stack([h[pos], h[0]]), ours.rotary, ours.rotary.cos_sin(plan.positions), kv.latent[1],
                    plan, backend)
        assert plan.padded is not None
        decoded.append(out[0])
    assert _rel_err(torch.cat([prefill, torch.stack(decoded)]), expanded) <= REL_TOL


def test_the_cache_holds_normed_latent_then_roped_key(pair):
    _, ours = pair
    s = ours.config.deepseek
    kv, alloc = _kv(ours, "layer-major")
    prompt = _prompt(random.Random(6), 6)
    pages = _pages(alloc, 6)
    ours.forward([SeqChunk(prompt, 0, pages)], kv)
    row = kv.latent[0][pages[5 // PAGE_SIZE], 5 % PAGE_SIZE]  # token 5 of layer 0
    assert row.shape == (s.kv_lora_rank + s.qk_rope_head_dim,)
    h = torch.nn.functional.embedding(torch.tensor(prompt), ours.embed)
    h = rms_norm(h, ours.layers[0].input_norm, ours.config.rms_norm_eps)
    _, _, rows = ours.layers[0].self_attn.project(h, ours.rotary, ours.rotary.cos_sin(torch.arange(6)), ours.attn)
    assert torch.equal(row, rows[5])


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_latent_pool_regions(pair, layout):
    """One region per layer, kind "latent", one page item = page_size * (kv_lora_rank + rope) * elem;
    page p of layer l starts at addr + p * page_stride and holds kv.latent[l][p]."""
    _, ours = pair
    c, width = ours.config, ours.config.deepseek.latent_width
    kv = LatentCache(c, 5, PAGE_SIZE, torch.bfloat16, "cpu", layout=layout)
    regions = kv.regions()
    item_len = PAGE_SIZE * width * 2
    assert [(r.layer, r.kind, r.item_len, r.num_pages, r.num_heads) for r in regions] == [
        (layer, LATENT_KIND, item_len, 5, 1) for layer in range(c.num_hidden_layers)]
    stride = item_len * c.num_hidden_layers if layout == "page-major" else 0
    assert {r.stride for r in regions} == {stride}
    assert kv.num_bytes == 5 * c.num_hidden_layers * item_len
    for r in regions:
        for page in (0, 3):
            assert kv.latent[r.layer][page].data_ptr() == r.addr + page * r.page_stride
            assert kv.latent[r.layer][page].is_contiguous()
    kv.latent[1][2].fill_(3.0)
    kv.copy_page(2, 4)
    assert torch.equal(kv.latent[1][4], kv.latent[1][2]) and kv.latent[0][4].abs().sum() == 0


def test_router_equals_transformers():
    """V2 greedy and group_limited_greedy, V3 noaux_tc: the same experts and weights per token."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    hidden, experts = 16, 8
    x = torch.randn(32, hidden)
    v2 = (transformers.DeepseekV2Config, DeepseekV2TopkRouter, "DeepseekV2ForCausalLM")
    v3 = (transformers.DeepseekV3Config, DeepseekV3TopkRouter, "DeepseekV3ForCausalLM")
    cases = [(v2, dict(topk_method="greedy", routed_scaling_factor=1.5)),
             (v2, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0)),
             (v3, dict(n_group=4, topk_group=2, routed_scaling_factor=2.5))]
    for (config_cls, router_cls, architecture), extra in cases:
        hf_config = config_cls(hidden_size=hidden, n_routed_experts=experts, num_experts_per_tok=3,
                               num_attention_heads=2, num_key_value_heads=2, **extra)
        router = router_cls(hf_config)
        bias = getattr(router, "e_score_correction_bias", None)
        with torch.no_grad():
            router.weight.normal_()
            if bias is not None:
                bias.normal_(std=0.1)
            _, ref_weights, ref_ids = router(x)
        spec = ModelConfig.from_dict(hf_config.to_dict() | {"architectures": [architecture]}).deepseek
        for backend in (None, TorchBackend()):  # V2 greedy: the backend's select_experts
            weights, ids = route(x @ router.weight.T, spec, bias, backend)
            order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
            assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order)), extra
            assert torch.allclose(weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=1e-5), extra
            assert weights.dtype == torch.float32
    # V2 greedy with norm_topk_prob (DeepSeek's reference normalises; transformers ignores the flag):
    # the backend's one-launch router against route's own composition
    spec = ModelConfig.from_dict(transformers.DeepseekV2Config(
        hidden_size=hidden, n_routed_experts=experts, num_experts_per_tok=3, num_attention_heads=2,
        num_key_value_heads=2, topk_method="greedy", norm_topk_prob=True).to_dict()
        | {"architectures": ["DeepseekV2ForCausalLM"]}).deepseek
    logits = torch.randn(32, experts)
    spec_plain = dataclasses.replace(spec, topk_method="group_limited_greedy", n_group=1, topk_group=1)
    want_w, want_ids = route(logits, spec_plain, None)  # the composition (one group: the same choice)
    got_w, got_ids = route(logits, spec, None, TorchBackend())
    order, want_order = got_ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(got_ids.gather(1, order), want_ids.gather(1, want_order))
    assert torch.allclose(got_w.gather(1, order), want_w.gather(1, want_order), rtol=1e-6)


def test_yarn_matches_transformers():
    params = {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0,
              "beta_slow": 1.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0}
    hf_config = transformers.DeepseekV2Config(qk_rope_head_dim=64, max_position_embeddings=163840,
                                              rope_parameters=params, hidden_size=64, num_attention_heads=2,
                                              num_experts_per_tok=2,
                                              num_key_value_heads=2)
    ref_freq, ref_factor = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    raw = hf_config.to_dict() | {"architectures": ["DeepseekV2ForCausalLM"]}
    config = ModelConfig.from_dict(raw)
    assert torch.allclose(rope.inv_frequencies(config), ref_freq, rtol=1e-6)
    assert rope.attention_factor(config) == pytest.approx(ref_factor)
    ref_scale = transformers.modeling_rope_utils.yarn_apply_mscale(params, 192 ** -0.5)
    assert rope.yarn_softmax_scale(config, 192 ** -0.5) == pytest.approx(ref_scale)


def test_a_shared_expert_tensor_of_another_shape_is_refused_by_name(tmp_path):
    """The checkpoint's shared experts are split into experts at load (``unfuse``): a tensor whose
    shape config.json does not imply is refused with its name, its shape and the expected one."""
    from safetensors.torch import load_file, save_file

    target, _ = make_tiny_model(tmp_path, seed=1, preset="deepseek-v2-tiny")
    path = target / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.shared_experts.up_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=rf"tensor '{name}' has shape \(63, 64\), config.json implies \(64, 64\) "
                                             r"\(n_shared_experts 2 x moe_intermediate_size 32\)"):
        load_model(target, dtype=torch.float32)


def test_refusals_name_the_setting():
    raw = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, n_group=4,
                                          topk_group=2).to_dict()
    config = ModelConfig.from_dict(raw | {"architectures": ["DeepseekV3ForCausalLM"]})
    with pytest.raises(TpConfigError, match=r"--tp-size 3: 4 attention heads .* DeepseekV3ForCausalLM .*: 1, 2, 4$"):
        TpShard.of(config, 3, 0)
    narrow = ModelConfig.from_dict(raw | {"architectures": ["DeepseekV3ForCausalLM"], "moe_intermediate_size": 6})
    with pytest.raises(TpConfigError, match=r"--tp-size 4: MoE intermediate size 6 does not divide by 4.*: 1, 2$"):
        TpShard.of(narrow, 4, 0)
    with pytest.raises(ModelLoadError, match="topk_method.*'greedy'.*noaux_tc"):
        ModelConfig.from_dict(raw | {"architectures": ["DeepseekV3ForCausalLM"], "topk_method": "greedy"})
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "vocab_size": 97,
             "num_hidden_layers": 1, "num_attention_heads": 4,
             "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}
    with pytest.raises(ModelLoadError, match="yarn.*DeepSeek only.*LlamaForCausalLM"):
        ModelConfig.from_dict(llama)


def test_v2_lite_preset_has_the_real_layer_shapes():
    """The GPU-sized preset, parsed from its config.json and counted from its tensor list (no weights
    written): DeepSeek-V2-Lite's attention and expert shapes, a 576-wide latent row."""
    from kvferry.common.models.tiny import _config_json, _tensor_specs, presets

    spec = presets["deepseek-v2-lite"]
    config = ModelConfig.from_dict(_config_json(spec, spec.num_layers, 512, 0, [1, 4]))
    s = config.deepseek
    assert (config.architecture, config.hidden_size, config.num_attention_heads) == ("DeepseekV2ForCausalLM", 2048, 16)
    assert (s.q_lora_rank, s.kv_lora_rank, s.qk_rope_head_dim, s.qk_nope_head_dim, s.v_head_dim) == (
        None, 512, 64, 128, 128)
    assert (s.n_routed_experts, s.n_shared_experts, s.num_experts_per_tok, s.moe_intermediate_size) == (64, 2, 6, 1408)
    assert s.latent_width == 576 and s.first_k_dense_replace == 1 and s.topk_method == "greedy"
    assert config.rope_scaling.factor == 40.0 and config.torch_dtype == "bfloat16"
    shapes = dict(_tensor_specs(spec, spec.num_layers))
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (16 * 192, 2048)
    assert shapes["model.layers.1.self_attn.kv_b_proj.weight"] == (16 * 256, 512)
    assert shapes["model.layers.1.mlp.experts.63.down_proj.weight"] == (2048, 1408)
    assert shapes["model.layers.1.mlp.shared_experts.gate_proj.weight"] == (2816, 2048)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (10944, 2048)


def test_make_tiny_model_help_lists_every_preset(capsys):
    from kvferry.common.cli import main
    from kvferry.common.models.tiny import presets

    with pytest.raises(SystemExit) as exit_info:
        main(["make-tiny-model", "--help"])
    assert exit_info.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps the list, at hyphens too
    assert all(name in text for name in presets) and "deepseek-v2-lite" in text


def test_pool_sizing_counts_the_latent_row(pair):
    """The daemons size the pool from kv_bytes_per_token: for MLA that is what a LatentCache takes."""
    from kvferry.common.daemon.start import kv_bytes_per_token

    _, ours = pair
    kv = LatentCache(ours.config, 6, PAGE_SIZE, torch.bfloat16, "cpu")
    assert kv_bytes_per_token([ours.config], 1, "bfloat16") == kv.num_bytes // (6 * PAGE_SIZE)
    assert kv_bytes_per_token([ours.config, ours.config], 1, "bfloat16") == 2 * kv.num_bytes // (6 * PAGE_SIZE)


# DeepSeek-V2-Lite's config.json as published (transformers 4 names: rope_scaling with "type", a
# top-level rope_theta, no head_dim); V3's adds fp8 block quantization.
V2_LITE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "bos_token_id": 100000,
    "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "v_head_dim": 128, "vocab_size": 102400,
}


def test_published_v2_lite_config_parses():
    config = ModelConfig.from_dict(V2_LITE_CONFIG)
    s = config.deepseek
    assert (config.head_dim, s.latent_width, s.qk_head_dim, s.version) == (64, 576, 192, 2)
    assert config.rope_scaling.rope_type == "yarn" and config.rope_scaling.factor == 40.0
    assert config.rope_scaling.original_max_position_embeddings == 4096 and config.rope_theta == 10000.0
    # softmax scale: 192 ** -0.5 times mscale(40, 0.707) ** 2, cos/sin unscaled (mscale == mscale_all_dim)
    assert rope.attention_factor(config) == pytest.approx(1.0)
    assert rope.yarn_softmax_scale(config, 1.0) == pytest.approx((0.1 * 0.707 * torch.log(torch.tensor(40.0)).item()
                                                                  + 1) ** 2)
    fp8 = V2_LITE_CONFIG | {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    with pytest.raises(ModelLoadError, match="quantization_config.*fp8.*bfloat16"):
        ModelConfig.from_dict(fp8)
    with pytest.raises(ModelLoadError, match="scoring_func.*'sigmoid'.*softmax"):
        ModelConfig.from_dict(V2_LITE_CONFIG | {"scoring_func": "sigmoid"})
    with pytest.raises(ModelLoadError, match="mlp_bias"):
        ModelConfig.from_dict(V2_LITE_CONFIG | {"mlp_bias": True})
