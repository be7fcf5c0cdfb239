"""MLA's two forms (``common/layers/mla.py``) give the same attention: the expanded prefill (k, v
expanded through kv_b_proj, causal SDPA with the prefix's offset) equals the absorbed MQA over the
latent rows, fp32 on CPU, for a plain prefill, an extend over a cached prefix, a batch of chunks of
different lengths and prefixes (per-chunk and padded torch plans), at TP 1 and on each TP 2 rank
(whose partial outputs add up to TP 1's); the whole tiny model's logits agree across forms; and
``attends_expanded`` picks expanded for prompts and long chunks, absorbed for decode, verify, short
extends over a long prefix and CUDA graph plans."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from kvferry.common.cache.kv_cache import KV_LAYOUTS, PageAllocator
from kvferry.common.layers import mla
from kvferry.common.layers.attn_backend import TorchBackend
from kvferry.common.models.llama import SeqChunk
from kvferry.common.models.loader import load_model
from kvferry.common.models.tiny import make_tiny_model

torch.set_num_threads(1)
PAGE_SIZE = 4
REL_TOL = 1e-5
CPU = torch.device("cpu")
# DeepSeek-V2-Lite's (and V3's) attention widths: kv_lora_rank, rope, nope, v
REAL = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


@pytest.fixture(scope="module", params=["deepseek-v2-tiny", "deepseek-v3-tiny"])
def model_dir(request, tmp_path_factory) -> str:
    target, _ = make_tiny_model(tmp_path_factory.mktemp(request.param), seed=4, preset=request.param)
    return str(target)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, dtype=torch.float32)


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def _set_form(model, form: str) -> None:
    for layer in model.layers:
        layer.self_attn.form = form


def _layer_outputs(model, layer: int, history: list[int], steps: list[list[tuple[int, int]]], form: str,
                   layout: str = "page-major", seed: int = 0) -> list[torch.Tensor]:
    """One layer's attention output for each step, over one latent pool: sequence i first fills its
    ``history[i]`` cached rows (absorbed, one prefill), then each step runs chunks (sequence, new
    tokens) in ``form`` from where that sequence stands. The hidden states are seeded, so two calls
    with the same arguments see the same inputs."""
    attn, backend = model.layers[layer].self_attn, TorchBackend()
    kv = type(model).make_kv_cache(model.config, 96, PAGE_SIZE, torch.float32, "cpu", layout=layout)
    alloc = PageAllocator(96)
    pages = [alloc.allocate(-(-(n + 60) // PAGE_SIZE)) for n in history]
    for table in pages:
        random.Random(len(table)).shuffle(table)  # scattered pages, as a long-lived pool hands out
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    at = list(history)

    def run(chunks: list[SeqChunk], which: str) -> torch.Tensor:
        _, plan = backend.plan(chunks, PAGE_SIZE, CPU)
        h = torch.randn(len(plan.positions), hidden, generator=gen)
        attn.form = which
        try:
            return attn(h, model.rotary, model.rotary.cos_sin(plan.positions), kv.latent[layer], plan, backend)
        finally:
            attn.form = "auto"

    if any(history):
        run([SeqChunk([0] * n, 0, pages[i]) for i, n in enumerate(history) if n], "absorbed")
    outs = []
    for step in steps:
        chunks = [SeqChunk([0] * n, at[i], pages[i]) for i, n in step]
        outs.append(run(chunks, form))
        for i, n in step:
            at[i] += n
    return outs


def _check_forms(model, history, steps, layout="page-major") -> None:
    for layer in range(model.config.num_hidden_layers):
        absorbed = _layer_outputs(model, layer, history, steps, "absorbed", layout)
        expanded = _layer_outputs(model, layer, history, steps, "expanded", layout)
        for i, (got, want) in enumerate(zip(expanded, absorbed)):
            assert got.shape == want.shape
            assert _rel_err(got, want) <= REL_TOL, f"layer {layer} step {i}"


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_plain_prefill(model, layout):
    _check_forms(model, [0], [[(0, 23)]], layout)


def test_chunked_extend_over_a_cached_prefix(model):
    # a prefix that ends inside a page, then chunks that straddle pages, and a 1-token tail
    _check_forms(model, [9], [[(0, 14)], [(0, 17)], [(0, 1)]])


def test_a_batch_of_sequences_of_different_lengths(model):
    # per-chunk torch plans (a chunk over 16 tokens), then a padded one (every chunk short, several chunks)
    history = [0, 5, 12, 3]
    _check_forms(model, history, [[(0, 19), (1, 1), (2, 7), (3, 30)], [(0, 3), (1, 6), (2, 1)]])


@pytest.mark.parametrize("tp_size", [2])
def test_tp_ranks_expand_their_own_heads(model_dir, model, tp_size):
    """Each rank's two forms agree, and the ranks' partial outputs add up to TP 1's."""
    history, steps = [0, 6], [[(0, 21), (1, 18)]]
    whole = _layer_outputs(model, 1, history, steps, "expanded")[0]
    parts = []
    for rank in range(tp_size):
        ranked = load_model(model_dir, dtype=torch.float32, tp_size=tp_size, tp_rank=rank)
        assert ranked.layers[1].self_attn.shard.q_heads.count == model.config.num_attention_heads // tp_size
        expanded = _layer_outputs(ranked, 1, history, steps, "expanded")[0]
        assert _rel_err(expanded, _layer_outputs(ranked, 1, history, steps, "absorbed")[0]) <= REL_TOL
        parts.append(expanded)
    assert _rel_err(sum(parts), whole) <= REL_TOL


def test_model_logits_agree_across_forms(model):
    """The whole model: a batched prefill (long and short prompts) then an extend beside a decode
    step, auto (expanded where it pays) against forced absorbed."""
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (37, 4, 20)]
    runs = {}
    for form in ("absorbed", "auto"):
        _set_form(model, form)
        try:
            kv = type(model).make_kv_cache(model.config, 64, PAGE_SIZE, torch.float32, "cpu")
            pages = [list(range(i * 20, i * 20 + 20)) for i in range(3)]
            first = model.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], kv, all_logits=True)
            then = model.forward([SeqChunk(prompts[1][:3] * 7, 4, pages[1]), SeqChunk([9], 37, pages[0])], kv,
                                 all_logits=True)
            runs[form] = torch.cat(first + then)
        finally:
            _set_form(model, "auto")
    assert _rel_err(runs["auto"], runs["absorbed"]) <= REL_TOL


def test_the_choice_per_step():
    choose = mla.attends_expanded
    assert choose([8192], [0], REAL) and choose([1000, 300, 17], [0, 0, 0], REAL)  # prompts
    assert choose([2048], [6144], REAL)  # a long chunk of a chunked prefill
    assert not choose([1] * 64, [5000] * 64, REAL)  # decode
    assert not choose([4] * 8, [100] * 8, REAL) and not choose([16], [0], REAL)  # verify-sized
    assert not choose([50], [8000], REAL)  # a short extend over a long cached prefix (a prefix-cache hit)
    assert choose([400], [8000], REAL)  # past the ~170-token break-even
    assert not choose([8192], None, REAL)  # a CUDA graph's static plan: no host starts


def test_forced_forms_are_checked(model):
    attn = model.layers[0].self_attn
    graph_plan = SimpleNamespace(query_lens=[4, 4], starts=None)
    try:
        attn.form = "expanded"
        with pytest.raises(ValueError, match="needs a plan with host starts"):
            attn.uses_expanded(graph_plan)
        attn.form = "absorbed"
        assert not attn.uses_expanded(SimpleNamespace(query_lens=[4096], starts=[0]))
        attn.form = "mha"
        with pytest.raises(ValueError, match="MLA form is 'mha', expected one of"):
            attn.uses_expanded(graph_plan)
    finally:
        attn.form = "auto"
    assert not attn.uses_expanded(graph_plan)


def test_causal_attention_refuses_mismatched_rows():
    q, k = torch.randn(5, 2, 8), torch.randn(9, 2, 8)
    with pytest.raises(ValueError, match="k and v need prefix \\+ 5 rows"):
        mla.causal_attention(q, k, torch.randn(9, 2, 4), 3, 0.5)
