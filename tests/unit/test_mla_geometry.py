"""MLA's one-buffer KV geometry (issue 29): a latent region per layer, whole on every TP rank, matched
by key like K and V. On simulated memory (every rank one byte array), every decode rank receives
every latent byte of the room exactly once at any pair of TP and page sizes, the layers' writers
spread over the prefill ranks; a decode-only dense draft next to an MLA target is ignored as
today; a K/V decode against an MLA prefill is refused naming both forms."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.common.errors import GeometryMismatchError
from kvferry.common.plan import geometry
from kvferry.common.plan.layout import KvLayout, cache_form, check_layout
from kvferry.common.plan.tp import latent_writer, rank_heads
from kvferry.common.plan.tp_feed import build_tp_plan, feed_descs
from kvferry.common.wire.aux_record import AUX_RECORD_BYTES
from kvferry.common.wire.messages import LATENT_KIND, AuxInfo, Region

BASE = 0x1000
MAX_TOKENS = 100
LATENT_BYTES = 2 * (32 + 16)  # bf16 latent of kv_lora_rank 32 plus a rope part of 16, per token


def side(tp, page_size, layers, *, page_major=False, draft_heads=0, num_pages=None):
    """``tp`` rank layouts of an MLA target (one latent region per layer, whole on every rank) and,
    with ``draft_heads``, a dense one-layer draft sharded by heads."""
    num_pages = num_pages or -(-MAX_TOKENS // page_size) + 3
    out = []
    for rank in range(tp):
        specs = [("target", layer, LATENT_KIND, 0, 1, page_size * LATENT_BYTES) for layer in range(layers)]
        if draft_heads:
            held = rank_heads(draft_heads, tp, rank)
            specs += [("draft", 0, kind, held.start, held.count, page_size * held.count * 4) for kind in "kv"]
        stride = sum(s[5] for s in specs) if page_major else 0
        regions, cursor = [], BASE
        for model, layer, kind, start, count, item_len in specs:
            regions.append(Region(model, layer, kind, "VRAM", rank, cursor, item_len, num_pages, start, count, stride))
            cursor += item_len if page_major else item_len * num_pages
        if page_major:
            cursor = BASE + stride * num_pages
        out.append(KvLayout("deepseek", page_size, "bfloat16", tp, rank, tuple(regions),
                            AuxInfo("VRAM", rank, cursor, AUX_RECORD_BYTES, 1)))
    return out


def _latent_index(region: Region, page_size: int, page_ids, num_tokens: int) -> np.ndarray:
    t = np.arange(num_tokens)
    pages = np.asarray(page_ids, dtype=np.int64)[t // page_size]
    start = region.addr - BASE + pages * region.page_stride + (t % page_size) * LATENT_BYTES
    return start[:, None] + np.arange(LATENT_BYTES)


@settings(max_examples=100, deadline=None)
@given(tps=st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8])),
       sizes=st.tuples(st.sampled_from([1, 4, 16, 64]), st.sampled_from([1, 4, 16, 64])),
       layers=st.integers(1, 9), majors=st.tuples(st.booleans(), st.booleans()),
       num_tokens=st.integers(1, MAX_TOKENS), start_page=st.integers(0, 3), seed=st.integers(0, 2**32 - 1))
def test_every_decode_rank_gets_every_latent_byte_once_from_balanced_writers(tps, sizes, layers, majors, num_tokens,
                                                                             start_page, seed):
    rng = np.random.default_rng(seed)
    prefill = side(tps[0], sizes[0], layers, page_major=majors[0])
    decode = side(tps[1], sizes[1], layers, page_major=majors[1])
    plan = build_tp_plan(prefill, decode)
    # the decode's prefix hit: whole pages of both sides (tp.copies starts there)
    start = min(start_page * max(sizes), num_tokens) // np.lcm(*sizes) * np.lcm(*sizes)
    p_ids = rng.permutation(prefill[0].regions[0].num_pages)[: -(-num_tokens // sizes[0])]
    d_ids = rng.permutation(decode[0].regions[0].num_pages)[: -(-num_tokens // sizes[1])]
    latent = {layer: rng.integers(0, 256, (num_tokens, LATENT_BYTES), dtype=np.uint8) for layer in range(layers)}
    size = prefill[0].aux.addr - BASE + AUX_RECORD_BYTES
    p_mem = []
    for lay in prefill:  # every prefill rank holds the same latent (replicated)
        mem = rng.integers(0, 256, size, dtype=np.uint8)
        for r in lay.regions:
            mem[_latent_index(r, sizes[0], p_ids, num_tokens)] = latent[r.layer]
        p_mem.append(mem)
    d_size = decode[0].aux.addr - BASE + AUX_RECORD_BYTES
    d_mem = [rng.integers(0, 256, d_size, dtype=np.uint8) for _ in decode]
    before = [m.copy() for m in d_mem]
    count = [np.zeros(d_size, np.int64) for _ in decode]
    writers: Counter = Counter()
    for f in plan.feeds:
        for pair in f.pairs:
            writers[(f.decode_rank, f.prefill_rank)] += 1
            assert f.prefill_rank == latent_writer(pair.src.layer, f.decode_rank, tps[0])
        src, dst = feed_descs(f, num_tokens, p_ids, d_ids, start=int(start))
        for (sa, n, _), (da, _, _) in zip(src.tolist(), dst.tolist()):
            d_mem[f.decode_rank][da - BASE:da - BASE + n] = p_mem[f.prefill_rank][sa - BASE:sa - BASE + n]
            count[f.decode_rank][da - BASE:da - BASE + n] += 1
    for d, lay in enumerate(decode):
        room = np.zeros(d_size, bool)
        for r in lay.regions:
            for p in d_ids:
                room[r.addr - BASE + p * r.page_stride:r.addr - BASE + p * r.page_stride + r.item_len] = True
            idx = _latent_index(r, sizes[1], d_ids, num_tokens)[start:]
            assert (d_mem[d][idx] == latent[r.layer][start:]).all(), (d, r.key)
            assert (count[d][idx] == 1).all(), f"decode rank {d} {r.key}: a latent byte not written exactly once"
            held = _latent_index(r, sizes[1], d_ids, num_tokens)[:start]  # the prefix hit: never written
            assert not count[d][held].any()
        assert count[d].max() <= 1 and not count[d][~room].any()
        assert (d_mem[d][~room] == before[d][~room]).all()
        shares = [writers[(d, p)] for p in range(tps[0])]
        assert sum(shares) == layers and max(shares) - min(shares) <= 1, shares  # each writer a fair share
    for layer in range(layers):  # one layer's copies, over the decode ranks, spread alike
        per = Counter(latent_writer(layer, d, tps[0]) for d in range(tps[1]))
        counts = [per.get(p, 0) for p in range(tps[0])]
        assert max(counts) - min(counts) <= 1, counts


def test_equal_tp_and_page_sizes_match_latent_regions_by_key():
    plan = geometry.build_plan(side(1, 16, 3)[0], side(1, 16, 3, page_major=True)[0])
    assert plan.written == tuple(("target", layer, LATENT_KIND) for layer in range(3))
    assert cache_form(plan.prefill, "target") == "mla"


def test_a_decode_only_dense_draft_next_to_an_mla_target_is_ignored():
    plan = build_tp_plan(side(2, 16, 2), side(2, 16, 2, draft_heads=2))
    assert plan.ignored == (("draft", 0, "k"), ("draft", 0, "v"))
    assert {p.key for f in plan.feeds for p in f.pairs} == {("target", 0, LATENT_KIND), ("target", 1, LATENT_KIND)}
    same = geometry.build_plan(side(1, 16, 2)[0], side(1, 16, 2, draft_heads=2)[0])
    assert same.decode_only_spec_dec and len(same.written) == 2


def _dense(layout: KvLayout) -> KvLayout:
    """The same layout as a K/V model: each latent region becomes a K and a V region of half the bytes."""
    regions = []
    for r in layout.regions:
        half = r.item_len // 2
        regions += [replace(r, kind="k", item_len=half), replace(r, kind="v", addr=r.addr + half * r.num_pages,
                                                                  item_len=half)]
    return replace(layout, regions=tuple(regions))


@pytest.mark.parametrize("mla_side", ["prefill", "decode"])
def test_a_kv_side_against_an_mla_side_is_refused_naming_both_forms(mla_side):
    mla, dense = side(1, 16, 2, num_pages=4)[0], _dense(side(1, 16, 2, num_pages=4)[0])
    pair = (mla, dense) if mla_side == "prefill" else (dense, mla)
    want = ("prefill caches one MLA latent per layer, decode caches K and V" if mla_side == "prefill"
            else "prefill caches K and V per layer, decode caches one MLA latent")
    with pytest.raises(GeometryMismatchError, match=want):
        geometry.build_plan(*pair)
    with pytest.raises(GeometryMismatchError, match=want):
        build_tp_plan([pair[0]], [pair[1]])


def test_a_dense_model_against_an_mla_model_is_refused_by_form_before_fingerprint():
    """Two different checkpoints (as a Llama decode against a DeepSeek prefill): the refusal names
    both forms and both fingerprints, in both planners."""
    mla = side(1, 16, 2, num_pages=4)[0]
    dense = replace(_dense(mla), model="llama-fingerprint")
    want = (r"prefill caches one MLA latent per layer, decode caches K and V per layer; .*fingerprint: "
            rf"prefill '{mla.model}', decode 'llama-fingerprint'")
    with pytest.raises(GeometryMismatchError, match=want):
        geometry.build_plan(mla, dense)
    with pytest.raises(GeometryMismatchError, match=want):
        build_tp_plan([mla], [dense])


def test_a_latent_region_must_be_whole_and_never_mixed_with_kv():
    lay = side(2, 16, 2)[1]
    sharded = replace(lay, regions=(replace(lay.regions[0], head_start=1),) + lay.regions[1:])
    with pytest.raises(GeometryMismatchError, match="whole on every rank.*head_start 1"):
        check_layout(sharded, "decode")
    mixed = replace(lay, regions=(replace(lay.regions[0], kind="k"),) + lay.regions[1:])
    with pytest.raises(GeometryMismatchError, match="both MLA latent and K/V"):
        check_layout(mixed, "decode")
