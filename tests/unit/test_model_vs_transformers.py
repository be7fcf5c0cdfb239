"""Our paged Llama-family model against transformers on tiny random checkpoints (fp32, CPU)."""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvferry.common.errors import ModelLoadError  # noqa: E402
from kvferry.common.models.config import ModelConfig  # noqa: E402
from kvferry.common.cache.kv_cache import KV_LAYOUTS, KvCache, PageAllocator  # noqa: E402
from kvferry.common.models.llama import LlamaForCausalLM, SeqChunk  # noqa: E402
from kvferry.common.models.loader import load_model  # noqa: E402

torch.set_num_threads(1)
VOCAB = 97
PAGE_SIZE = 4
REL_TOL = 1e-4
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=0,
)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}


def _hf_config(arch: str):
    if arch == "llama":
        return transformers.LlamaConfig(num_hidden_layers=3, rope_parameters=LLAMA3_ROPE, **SMALL)
    if arch == "qwen2":
        return transformers.Qwen2Config(num_hidden_layers=2, **SMALL)
    if arch == "qwen3":
        return transformers.Qwen3Config(num_hidden_layers=2, head_dim=32, tie_word_embeddings=True, **SMALL)
    if arch == "mistral":
        return transformers.MistralConfig(num_hidden_layers=2, sliding_window=6, **SMALL)
    raise AssertionError(arch)


ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    """(transformers model, our model, checkpoint dir) for one architecture."""
    torch.manual_seed(ARCHS.index(request.param))
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(request.param)).eval()
    with torch.no_grad():  # transformers inits biases and norms to constants: perturb to test them
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp(request.param)
    # Llama is written in shards to exercise the index path of the loader.
    hf.save_pretrained(out, max_shard_size="40KB" if request.param == "llama" else "50GB")
    ours = load_model(out, dtype=torch.float32)
    return hf, ours, out


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.fixture(params=KV_LAYOUTS)
def layout(request) -> str:
    return request.param


def _kv(model: LlamaForCausalLM, layout: str, num_pages: int = 256) -> tuple[KvCache, PageAllocator]:
    return KvCache(model.config, num_pages, PAGE_SIZE, torch.float32, "cpu", layout=layout), PageAllocator(num_pages)


def _pages_for(alloc: PageAllocator, num_tokens: int) -> list[int]:
    """Pages for ``num_tokens``, shuffled: a sequence's pages are scattered and out of order in a
    long-lived pool, and the gather must not depend on their order."""
    pages = alloc.allocate(-(-num_tokens // PAGE_SIZE))
    random.Random(num_tokens).shuffle(pages)
    return pages


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def test_sharded_checkpoint_was_written(pair):
    hf, ours, path = pair
    if hf.config.model_type == "llama":
        assert (path / "model.safetensors.index.json").is_file()
    assert ours.config.fingerprint == ModelConfig.from_dir(path).fingerprint


def test_prefill_logits_match(pair, layout):
    hf, ours, _ = pair
    prompt = _prompt(random.Random(1), 13)
    kv, alloc = _kv(ours, layout)
    logits = ours.forward([SeqChunk(prompt, 0, _pages_for(alloc, 13))], kv, all_logits=True)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert logits.shape == (13, VOCAB) and logits.dtype == torch.float32
    assert _rel_err(logits, ref) <= REL_TOL


def test_paged_decode_matches_transformers_cache(pair, layout):
    hf, ours, _ = pair
    # transformers 5 renamed past_key_values to cache
    cache_kwarg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    rng = random.Random(2)
    prompt, steps = _prompt(rng, 7), _prompt(rng, 16)
    kv, alloc = _kv(ours, layout)
    pages = _pages_for(alloc, 7 + 16)
    ours.forward([SeqChunk(prompt, 0, pages)], kv)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        cache = out.past_key_values
        for i, token in enumerate(steps):
            mine = ours.forward([SeqChunk([token], 7 + i, pages)], kv)[0]
            out = hf(torch.tensor([[token]]), **{cache_kwarg: cache}, use_cache=True)
            cache = out.past_key_values
            assert _rel_err(mine, out.logits[0, -1].float()) <= REL_TOL, f"step {i}"


def _greedy(model: LlamaForCausalLM, prompts: list[list[int]], max_new: int, layout: str) -> list[list[int]]:
    """Batched prefill, then batched one-token decode steps (the padded attention path)."""
    kv, alloc = _kv(model, layout)
    pages = [_pages_for(alloc, len(p) + max_new) for p in prompts]
    logits = model.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], kv)
    outs = [[int(row.argmax())] for row in logits]
    for _ in range(max_new - 1):
        chunks = [SeqChunk([o[-1]], len(p) + len(o) - 1, pg) for p, o, pg in zip(prompts, outs, pages)]
        for o, row in zip(outs, model.forward(chunks, kv)):
            o.append(int(row.argmax()))
    return outs


def test_greedy_equals_generate(pair):
    hf, ours, _ = pair
    rng = random.Random(3)
    # Lengths include exact page boundaries (4, 8, 12, 16, 24) and a single token.
    lengths = [1, 2, 3, 4, 5, 7, 8, 9, 11, 12, 13, 15, 16, 17, 19, 21, 23, 24, 25, 30]
    prompts = [_prompt(rng, n) for n in lengths]
    mine = {layout: _greedy(ours, prompts, max_new=10, layout=layout) for layout in KV_LAYOUTS}
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, min_new_tokens=10)
        for layout, outs in mine.items():
            assert outs[i] == ref[0, len(prompt):].tolist(), f"{layout}, prompt length {len(prompt)}"


def test_batched_prefill_equals_separate(pair, layout):
    _, ours, _ = pair
    rng = random.Random(4)
    prompts = [_prompt(rng, n) for n in (5, 12, 1, 9, 16)]
    kv, alloc = _kv(ours, layout)
    chunks = [SeqChunk(p, 0, _pages_for(alloc, len(p))) for p in prompts]
    batched = ours.forward(chunks, kv, all_logits=True)
    for chunk, got in zip(chunks, batched):
        kv_one, alloc_one = _kv(ours, layout)
        alone = ours.forward([SeqChunk(chunk.token_ids, 0, _pages_for(alloc_one, len(chunk.token_ids)))],
                             kv_one, all_logits=True)[0]
        assert got.shape == alone.shape
        assert _rel_err(got, alone) <= REL_TOL


def test_chunked_extend_equals_one_prefill(pair, layout):
    """Prefill in pieces, and a mixed batch (extend + decode), give the same logits as one prefill."""
    _, ours, _ = pair
    rng = random.Random(5)
    prompt, other = _prompt(rng, 19), _prompt(rng, 6)
    kv, alloc = _kv(ours, layout)
    pages = _pages_for(alloc, 19)
    whole = ours.forward([SeqChunk(prompt, 0, pages)], kv, all_logits=True)[0]
    kv2, alloc2 = _kv(ours, layout)
    pages2, pages_other = _pages_for(alloc2, 19), _pages_for(alloc2, 7)
    first = ours.forward([SeqChunk(prompt[:8], 0, pages2), SeqChunk(other, 0, pages_other)], kv2,
                         all_logits=True)[0]
    # Extend the first sequence by 5 (a verify-sized chunk) while the second decodes one token.
    mid, _ = ours.forward([SeqChunk(prompt[8:13], 8, pages2), SeqChunk([3], 6, pages_other)], kv2,
                          all_logits=True)
    last = ours.forward([SeqChunk(prompt[13:], 13, pages2)], kv2, all_logits=True)[0]
    assert _rel_err(torch.cat([first, mid, last]), whole) <= REL_TOL


def test_both_layouts_store_the_same_kv_bit_for_bit(pair):
    """The layout moves bytes, never values: a prefill then a batched decode step leave identical K/V
    in every (layer, page) of both pools, and identical logits."""
    _, ours, _ = pair
    rng = random.Random(6)
    prompts = [_prompt(rng, n) for n in (9, 3)]
    results = {}
    for layout in KV_LAYOUTS:
        kv, alloc = _kv(ours, layout, num_pages=16)
        pages = [_pages_for(alloc, len(p) + 1) for p in prompts]
        first = ours.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], kv)
        step = ours.forward([SeqChunk([1], len(p), pg) for p, pg in zip(prompts, pages)], kv)
        results[layout] = (torch.stack(kv.tensors()), first, step)
        # the page items as stored ([N, Hkv, P, D]) are one contiguous span per region only layer-major
        assert kv.layout == layout and kv.tensors()[0].transpose(1, 2).is_contiguous() == (layout == "layer-major")
    (kv_a, *logits_a), (kv_b, *logits_b) = results.values()
    assert kv_a.abs().sum() > 0 and torch.equal(kv_a, kv_b)
    assert all(torch.equal(a, b) for a, b in zip(logits_a, logits_b))


def _config_dict(**overrides) -> dict:
    raw = json.loads(_hf_config("llama").to_json_string())
    raw["architectures"] = ["LlamaForCausalLM"]
    raw.update(overrides)
    return raw


def test_config_reads_transformers4_and_5_rope_fields():
    v5 = ModelConfig.from_dict(_config_dict())
    legacy = _config_dict(rope_theta=500000.0, rope_scaling={**LLAMA3_ROPE, "type": "llama3"})
    del legacy["rope_parameters"], legacy["rope_scaling"]["rope_type"], legacy["rope_scaling"]["rope_theta"]
    v4 = ModelConfig.from_dict(legacy)
    assert v4.rope_scaling == v5.rope_scaling and v4.rope_theta == v5.rope_theta == 500000.0
    assert v4.fingerprint == v5.fingerprint
    assert ModelConfig.from_dict(_config_dict(num_hidden_layers=4)).fingerprint != v5.fingerprint


def test_config_sliding_windows_per_family():
    qwen2_v4 = {
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "rope_theta": 1e6,
        "rope_scaling": None, "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28,
    }
    config = ModelConfig.from_dict(qwen2_v4)
    assert config.sliding_windows == (None, None) and config.has_qkv_bias and not config.has_o_bias
    assert config.rope_theta == 1e6 and config.rope_scaling is None and config.head_dim == 4
    mistral = {**qwen2_v4, "architectures": ["MistralForCausalLM"]}
    assert ModelConfig.from_dict(mistral).sliding_windows == (4096, 4096)
    assert not ModelConfig.from_dict(mistral).has_qkv_bias


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"vocab_size": "97"}, "vocab_size"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ModelLoadError, match=field):
        ModelConfig.from_dict(_config_dict(**overrides), source="x/config.json")


def test_missing_tensor_names_tensor_and_file(tmp_path: Path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config("qwen2"))
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(tmp_path)
