"""The embedded tiny checkpoint pair: real, deterministic, loadable by transformers, with a useful draft."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from kvferry.common.errors import RequestError
from kvferry.common.cache.kv_cache import KvCache, PageAllocator
from kvferry.common.models.llama import SeqChunk
from kvferry.common.text.tokenizer import Tokenizer
from kvferry.common.models.loader import load_model
from kvferry.common.models.tiny import make_tiny_model, presets
from kvferry.common.models.config import ModelConfig
from kvferry.common.models.tiny import _config_json

torch.set_num_threads(1)
PAGE_SIZE = 16
TEXTS = [
    "The ferry leaves", "What is the capital of", "Once upon a time", "Hello! How are", "To make bread, mix",
    "The weather today", "A computer stores numbers", "Please write a short letter", "Numbers: one, two",
    "The library opens at",
]
# Measured 0.91 (seed 0: 30 prompts x 32 greedy tokens); the assertion leaves margin for other seeds.
MIN_DRAFT_AGREEMENT = 0.75


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def models(tiny):
    return load_model(tiny[0]), load_model(tiny[1])


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_folders_hold_a_real_checkpoint(tiny):
    for folder in tiny:
        names = {p.name for p in folder.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json"} <= names
    target, draft = (ModelConfig.from_dir(d) for d in tiny)
    spec = presets["tiny"]
    assert (target.num_hidden_layers, draft.num_hidden_layers) == (spec.num_layers, spec.draft_layers) == (10, 2)
    assert target.vocab_size == draft.vocab_size == Tokenizer.from_dir(tiny[0]).vocab_size == 512
    assert (target.hidden_size, target.num_key_value_heads, target.head_dim) == (128, 2, 32)
    assert target.fingerprint != draft.fingerprint


def test_same_seed_same_bytes_other_seed_other_weights(tiny, tmp_path):
    again = make_tiny_model(tmp_path / "again", seed=0)
    assert _files(tiny[0].parent) == _files(again[0].parent)
    other = make_tiny_model(tmp_path / "other", seed=1)
    assert (other[0] / "model.safetensors").read_bytes() != (tiny[0] / "model.safetensors").read_bytes()
    assert (other[0] / "tokenizer.json").read_bytes() == (tiny[0] / "tokenizer.json").read_bytes()


def test_draft_is_the_targets_first_layers(tiny):
    from safetensors.torch import load_file

    target = load_file(tiny[0] / "model.safetensors")
    draft = load_file(tiny[1] / "model.safetensors")
    assert set(draft) < set(target)
    assert all(torch.equal(draft[name], target[name]) for name in draft)
    assert "model.layers.1.mlp.down_proj.weight" in draft and "model.layers.2.mlp.down_proj.weight" not in draft


def test_logits_match_transformers(tiny, models):
    transformers = pytest.importorskip("transformers")
    prompt = Tokenizer.from_dir(tiny[0]).encode("The ferry leaves the north pier at seven")
    for folder, ours in zip(tiny, models):
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        kv = KvCache(ours.config, 4, PAGE_SIZE, torch.float32, "cpu")
        mine = ours.forward([SeqChunk(prompt, 0, [0, 1])], kv, all_logits=True)[0]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert float((mine - ref).abs().max() / ref.abs().max()) <= 1e-4


def test_tokenizer_round_trip_and_matches_transformers(tiny):
    tok = Tokenizer.from_dir(tiny[0])
    texts = TEXTS + ["Zebras eat 123 apples, café! \n\ttabs", "<|eot_id|> is special", ""]
    try:
        import transformers

        hf = transformers.AutoTokenizer.from_pretrained(tiny[0])
    except ImportError:
        hf = None
    for text in texts:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids) == text.replace("<|eot_id|>", "")
        assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text
        if hf is not None:
            assert ids == hf(text)["input_ids"]
    assert tok.eos_token_ids == (tok.backend.token_to_id("<|eot_id|>"), tok.backend.token_to_id("<|end_of_text|>"))


def test_chat_template_renders_like_transformers(tiny):
    tok = Tokenizer.from_dir(tiny[0])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there \n"}]
    text = tok.apply_chat_template(messages)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("\n\n")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny[0])
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with pytest.raises(RequestError, match="unknown role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def _greedy(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    kv = KvCache(model.config, 256, PAGE_SIZE, torch.float32, "cpu")
    alloc = PageAllocator(256)
    pages = [alloc.allocate(-(-(len(p) + max_new) // PAGE_SIZE)) for p in prompts]
    logits = model.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], kv)
    outs = [[int(row.argmax())] for row in logits]
    for _ in range(max_new - 1):
        chunks = [SeqChunk([o[-1]], len(p) + len(o) - 1, pg) for p, o, pg in zip(prompts, outs, pages)]
        for o, row in zip(outs, model.forward(chunks, kv)):
            o.append(int(row.argmax()))
    return outs


def _prompts(tiny) -> list[list[int]]:
    tok = Tokenizer.from_dir(tiny[0])
    rng = random.Random(0)
    randoms = [[rng.randrange(5, 512) for _ in range(rng.randrange(3, 40))] for _ in range(20)]
    return [tok.encode(t) for t in TEXTS] + randoms


def test_draft_agrees_with_target_greedy(tiny, models):
    target, draft = models
    prompts = _prompts(tiny)
    outs = _greedy(target, prompts, max_new=32)
    kv = KvCache(draft.config, 256, PAGE_SIZE, torch.float32, "cpu")
    num_agree = num_total = 0
    for prompt, out in zip(prompts, outs):
        seq = prompt + out
        pages = list(range(-(-len(seq) // PAGE_SIZE)))
        logits = draft.forward([SeqChunk(seq[:-1], 0, pages)], kv, all_logits=True)[0]
        predicted = logits[len(prompt) - 1:].argmax(-1).tolist()
        num_agree += sum(p == t for p, t in zip(predicted, out, strict=True))
        num_total += len(out)
    assert num_agree / num_total >= MIN_DRAFT_AGREEMENT
    assert num_agree < num_total  # the late layers matter: the draft is not the target


def test_greedy_text_varies_with_the_prompt(tiny, models):
    tok = Tokenizer.from_dir(tiny[0])
    outs = _greedy(models[0], [tok.encode(t) for t in TEXTS], max_new=16)
    assert len({tuple(o) for o in outs}) == len(TEXTS)
    assert len({t for o in outs for t in o}) >= 40
    logits = models[0].forward([SeqChunk(tok.encode(TEXTS[0]), 0, [0])],
                               KvCache(models[0].config, 1, PAGE_SIZE, torch.float32, "cpu"))[0]
    assert logits.std() > 1.0  # not flat


def test_sharded_preset_path_loads_the_same_weights(tiny, models, tmp_path):
    spec = dataclasses.replace(presets["tiny"], max_shard_bytes=1 << 20)
    target_dir, _ = make_tiny_model(tmp_path, seed=0, preset=spec)
    index = json.loads((target_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 4 and not (target_dir / "model.safetensors").exists()
    sharded = load_model(target_dir)
    assert all(torch.equal(a, b) for a, b in zip(sharded.parameters(), models[0].parameters(), strict=True))


def test_8b_preset_config_parses_with_real_shapes():
    spec = presets["llama-3.1-8b"]
    config = ModelConfig.from_dict(_config_json(spec, spec.num_layers, 512, 0, [1, 4]))
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3"
    assert config.torch_dtype == "bfloat16"


def test_bos_rules_follow_transformers_5(tiny, tmp_path):
    """tokenizer.json's post-processor decides; add_bos_token applies only where there is none."""
    import shutil

    folder = tmp_path / "flags"
    shutil.copytree(tiny[0], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    tok = Tokenizer.from_dir(folder)
    assert tok.encode("Hello there")[0] == tok.bos_token_id
    transformers = pytest.importorskip("transformers")
    assert tok.encode("Hello there") == transformers.AutoTokenizer.from_pretrained(folder)("Hello there")["input_ids"]
    backend = json.loads((folder / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps({**backend, "post_processor": None}))
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True, "add_eos_token": True}))
    ids = Tokenizer.from_dir(folder).encode("Hello there")
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.backend.token_to_id("<|eot_id|>")
    assert ids[1:-1] == tok.encode("Hello there", add_special_tokens=False)
