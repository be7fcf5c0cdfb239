"""Properties of the TP transfer plan (common/plan/tp_feed.py) on simulated memory: every rank of both
sides is one byte array; the prefill's pools hold a logical [tokens, heads, head bytes] array per
region, each rank its heads; applying every feed's descriptors as copies leaves each decode head of
each token holding the source's bytes, written exactly once, and nothing outside the room's pages
touched. Refusals name both sides' values."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.common.wire.aux_record import AUX_RECORD_BYTES
from kvferry.common.errors import GeometryMismatchError
from kvferry.common.plan.layout import KvLayout
from kvferry.common.plan.tp import HeadRange, rank_heads
from kvferry.common.plan.tp_feed import MAX_ROOM_DESCS, build_tp_plan, check_room_descs, feed_descs, room_descs
from kvferry.common.wire.messages import AuxInfo, Region

BASE = 0x1000  # every rank's memory starts here; its device number is its rank
MAX_TOKENS = 130
HEADS = (1, 2, 4, 8)
TPS = (1, 2, 4, 8)


def _fits(heads: int, tp: int) -> bool:
    return heads % tp == 0 or tp % heads == 0


TP_CASES = [(h, p, d) for h in HEADS for p in TPS for d in TPS if _fits(h, p) and _fits(h, d)]


def side(tp, page_size, models, *, page_major=False, num_pages=None, model="m", kv_dtype="bf16"):
    """``tp`` layouts; ``models`` maps "target"/"draft" to (num_kv_heads, layers, token_bytes)."""
    num_pages = num_pages or -(-MAX_TOKENS // page_size) + 3
    layouts = []
    for rank in range(tp):
        specs = []  # (model, layer, kind, heads, item_len)
        for name, (heads, layers, token_bytes) in models.items():
            held = rank_heads(heads, tp, rank)
            specs += [(name, layer, kind, held, page_size * held.count * token_bytes)
                      for layer in range(layers) for kind in ("k", "v")]
        stride = sum(s[4] for s in specs) if page_major else 0
        regions, cursor = [], BASE
        for name, layer, kind, held, item_len in specs:
            regions.append(Region(name, layer, kind, "VRAM", rank, cursor, item_len, num_pages, held.start,
                                  held.count, stride))
            cursor += item_len if page_major else item_len * num_pages
        if page_major:
            cursor = BASE + stride * num_pages
        aux = AuxInfo("VRAM", rank, cursor, AUX_RECORD_BYTES, 1)
        layouts.append(KvLayout(model, page_size, kv_dtype, tp, rank, tuple(regions), aux))
    return layouts


def memory_size(layout: KvLayout) -> int:
    return layout.aux.addr + layout.aux.item_len - BASE


def byte_index(region: Region, page_size: int, page_ids, num_tokens: int, heads: HeadRange, token_bytes: int):
    """[tokens, heads, token_bytes] indices into the region's rank memory."""
    t = np.arange(num_tokens)
    pages = np.asarray(page_ids, dtype=np.int64)[t // page_size]
    h = np.arange(heads.start, heads.stop) - region.head_start
    offset = (h[None, :] * page_size + (t % page_size)[:, None]) * token_bytes
    start = region.addr - BASE + pages[:, None] * region.page_stride + offset
    return start[..., None] + np.arange(token_bytes)


def own_heads(region: Region) -> HeadRange:
    return HeadRange(region.head_start, region.num_heads)


@st.composite
def setups(draw):
    heads, prefill_tp, decode_tp = draw(st.sampled_from(TP_CASES))
    sizes = draw(st.tuples(st.sampled_from([1, 2, 4, 16, 64]), st.sampled_from([1, 2, 4, 16, 64])))
    target = (heads, draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4, 6])))
    draft_mode = draw(st.sampled_from(["none", "decode_only", "both"]))
    draft_heads = draw(st.sampled_from([h for h in HEADS if _fits(h, prefill_tp) and _fits(h, decode_tp)]))
    draft = (draft_heads, 1, draw(st.sampled_from([2, 4])))
    majors = draw(st.tuples(st.booleans(), st.booleans()))
    p_models = {"target": target} | ({"draft": draft} if draft_mode == "both" else {})
    d_models = {"target": target} | ({"draft": draft} if draft_mode != "none" else {})
    prefill = side(prefill_tp, sizes[0], p_models, page_major=majors[0])
    decode = side(decode_tp, sizes[1], d_models, page_major=majors[1])
    num_tokens = draw(st.integers(1, MAX_TOKENS))
    return prefill, decode, num_tokens, draft_mode, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=100, deadline=None)
@given(setup=setups())
def test_feeds_move_every_decode_head_of_every_token_once(setup):
    prefill, decode, num_tokens, draft_mode, seed = setup
    rng = np.random.default_rng(seed)
    plan = build_tp_plan(prefill, decode)
    p_size, d_size = prefill[0].page_size, decode[0].page_size
    assert plan.ignored == (tuple(r.key for r in decode[0].regions if r.model == "draft")
                            if draft_mode == "decode_only" else ())
    written = set(plan.written)
    p_ids = rng.permutation(prefill[0].regions[0].num_pages)[: -(-num_tokens // p_size)]
    d_ids = rng.permutation(decode[0].regions[0].num_pages)[: -(-num_tokens // d_size)]

    # the logical KV of the room, and each prefill rank holding its heads of it
    by_key = {r.key: r for r in prefill[0].regions}
    logical = {k: rng.integers(0, 256, (num_tokens, plan.num_kv_heads if k[0] == "target"
                                        else plan.draft_num_kv_heads, by_key[k].item_len
                                        // (p_size * by_key[k].num_heads)), dtype=np.uint8) for k in written}
    p_mem = [rng.integers(0, 256, memory_size(lay), dtype=np.uint8) for lay in prefill]
    for lay, mem in zip(prefill, p_mem):
        for r in lay.regions:
            held = own_heads(r)
            mem[byte_index(r, p_size, p_ids, num_tokens, held, logical[r.key].shape[2])] = \
                logical[r.key][:, held.start:held.stop]
    d_mem = [rng.integers(0, 256, memory_size(lay), dtype=np.uint8) for lay in decode]
    before = [m.copy() for m in d_mem]
    count = [np.zeros(m.shape, np.int64) for m in d_mem]

    for f in plan.feeds:
        for pair in f.pairs:  # only heads both ranks hold
            assert pair.heads.overlap(own_heads(pair.src)) == pair.heads == pair.heads.overlap(own_heads(pair.dst))
            assert pair.src.device == f.prefill_rank and pair.dst.device == f.decode_rank
        assert [p.key for p in f.pairs] == [k for k in plan.written if f.heads_of(k[0]) is not None]
        src, dst = feed_descs(f, num_tokens, p_ids.tolist(), d_ids)
        raw_src, raw_dst = feed_descs(f, num_tokens, p_ids, d_ids, merge=False)
        assert src.dtype == dst.dtype == np.int64 and src.shape == dst.shape and src.shape[1] == 3
        assert src[:, 1].sum() == raw_src[:, 1].sum() and (src[:, 1] == dst[:, 1]).all()
        touches = [(d[:-1, 0] + d[:-1, 1] == d[1:, 0]) & (d[:-1, 2] == d[1:, 2]) for d in (src, dst)]
        assert not (touches[0] & touches[1]).any(), "two rows left unmerged"
        ends = {(sa + n, sd, da + n, dd) for (sa, n, sd), (da, _, dd) in zip(src.tolist(), dst.tolist())}
        assert not ends & {(sa, sd, da, dd) for (sa, _, sd), (da, _, dd) in zip(src.tolist(), dst.tolist())}, \
            "a row that continues another on both sides, in any order, is merged into it"
        if p_size == d_size:  # one descriptor per page per region
            assert len(raw_src) == len(p_ids) * len(f.pairs)
        assert (src[:, 2] == f.prefill_rank).all() and (dst[:, 2] == f.decode_rank).all()
        for (sa, n, _), (da, _, _) in zip(src.tolist(), dst.tolist()):
            d_mem[f.decode_rank][da - BASE:da - BASE + n] = p_mem[f.prefill_rank][sa - BASE:sa - BASE + n]
            count[f.decode_rank][da - BASE:da - BASE + n] += 1

    for d, lay in enumerate(decode):
        assert plan.feeders(d) == tuple(sorted({f.prefill_rank for f in plan.feeds if f.decode_rank == d}))
        assert plan.feeders(d)
        room = np.zeros(d_mem[d].shape, bool)
        expected_bytes = 0
        for r in lay.regions:
            if r.key not in written:
                continue
            for p in d_ids:
                room[r.addr - BASE + p * r.page_stride:r.addr - BASE + p * r.page_stride + r.item_len] = True
            held = own_heads(r)
            idx = byte_index(r, d_size, d_ids, num_tokens, held, logical[r.key].shape[2])
            assert (d_mem[d][idx] == logical[r.key][:, held.start:held.stop]).all(), r.key
            assert (count[d][idx] == 1).all(), f"{r.key}: a byte of a token not written exactly once"
            expected_bytes += idx.size
        assert count[d].max() <= 1, "a decode byte written twice"
        assert (d_mem[d][~room] == before[d][~room]).all() and not count[d][~room].any()
        if p_size != d_size:  # only the tokens' bytes; equal sizes also move the last page's tail
            assert count[d].sum() == expected_bytes


def test_page_sizes_may_differ_and_equal_sizes_move_whole_pages():
    prefill = side(2, 16, {"target": (8, 2, 4)}, page_major=True)
    decode = side(4, 64, {"target": (8, 2, 4)})
    plan = build_tp_plan(prefill, decode)
    assert [(f.prefill_rank, f.decode_rank, f.heads_of()) for f in plan.feeds] == [
        (0, 0, HeadRange(0, 2)), (0, 1, HeadRange(2, 2)), (1, 2, HeadRange(4, 2)), (1, 3, HeadRange(6, 2))]
    assert plan.feeders(1) == (0,) and plan.num_kv_heads == 8 and plan.draft_num_kv_heads == 0
    assert build_tp_plan(decode, prefill).feeders(0) == (0, 1)
    # 100 tokens at 16 vs 64: 7 segments x 2 heads x 4 regions
    assert len(feed_descs(plan.feeds[0], 100, range(7), range(2), merge=False)[0]) == 7 * 2 * 4
    one = {"target": (8, 1, 4)}
    same = build_tp_plan(side(1, 16, one, num_pages=9), side(1, 16, one, num_pages=9))
    src, dst = feed_descs(same.feeds[0], 40, [0, 1, 2], [5, 6, 7])  # layer-major, consecutive pages: one run each
    assert src.tolist() == [[BASE, 3 * 512, 0], [BASE + 9 * 512, 3 * 512, 0]]
    assert dst.tolist() == [[BASE + 5 * 512, 3 * 512, 0], [BASE + 14 * 512, 3 * 512, 0]]


def test_a_draft_with_fewer_heads_is_fed_by_its_own_writers():
    models = {"target": (8, 1, 4), "draft": (1, 1, 4)}
    plan = build_tp_plan(side(2, 16, models), side(2, 16, models))
    assert [(f.prefill_rank, f.decode_rank, f.heads_of("target"), f.heads_of("draft")) for f in plan.feeds] == [
        (0, 0, HeadRange(0, 4), HeadRange(0, 1)), (0, 1, None, HeadRange(0, 1)), (1, 1, HeadRange(4, 4), None)]
    assert plan.feeders(1) == (0, 1) and plan.draft_num_kv_heads == 1


def one_region(tp, rank, head_start, num_heads, page_size=16, token_bytes=4):
    item_len = page_size * num_heads * token_bytes
    region = Region("target", 0, "k", "VRAM", 0, BASE, item_len, 4, head_start, num_heads)
    return KvLayout("m", page_size, "bf16", tp, rank, (region,), AuxInfo("VRAM", 0, BASE + 4 * item_len,
                                                                           AUX_RECORD_BYTES, 1))


def _replace_region(layout: KvLayout, index: int, **changes) -> KvLayout:
    regions = list(layout.regions)
    regions[index] = replace(regions[index], **changes)
    return replace(layout, regions=tuple(regions))


def _with(layouts, rank, **changes):
    return [replace(lay, **changes) if i == rank else lay for i, lay in enumerate(layouts)]


T8 = {"target": (8, 2, 4)}


@pytest.mark.parametrize("prefill,decode,match", [
    (side(2, 16, {"target": (8, 1, 4)}), side(1, 16, {"target": (8, 1, 4)}, kv_dtype="fp8"),
     "kv_dtype mismatch: prefill has 'bf16', decode has 'fp8'"),
    (side(2, 16, T8, model="a"), side(2, 16, T8, model="b"),
     "model fingerprint mismatch: prefill has 'a', decode has 'b'"),
    (side(2, 16, T8)[:1], side(2, 16, T8),
     r"prefill: tp_size 2 needs one layout per rank 0..1, got 1 with tp_rank \[0\]; missing rank\(s\) \[1\]"),
    (side(2, 16, T8)[::-1], side(2, 16, T8), r"the layout at index 0 is tp_rank 1's"),
    (side(2, 16, T8), _with(side(2, 16, T8), 1, page_size=64),
     "decode ranks disagree on page_size: rank 0 has 16, rank 1 has 64"),
    (side(2, 16, {"target": (8, 1, 4)}), side(2, 16, {"target": (8, 1, 8)}),
     r"one head of one token is 4 bytes where prefill rank 0 has item_len 256 .* but 8 where decode rank 0 has "
     r"item_len 512"),
    (side(2, 16, {"target": (8, 1, 4)}), side(2, 16, {"target": (4, 1, 4)}),
     "target num_kv_heads mismatch .*prefill has 8 over tp_size 2, decode has 4 over tp_size 2"),
    (side(2, 16, T8), side(2, 16, {"target": (8, 1, 4)}),
     r"decode registered fewer KV regions than prefill \(prefill 4, decode 2\): missing target layer 1 k"),
    (side(2, 16, {"target": (8, 1, 4), "draft": (2, 1, 4)}), side(2, 16, {"target": (8, 1, 4)}),
     "missing draft layer 0 k"),
    (side(2, 16, {"target": (8, 1, 4)}), side(2, 16, T8), "decode registered target regions the prefill does not"),
])
def test_refusals_name_both_sides(prefill, decode, match):
    with pytest.raises(GeometryMismatchError, match=match):
        build_tp_plan(prefill, decode)


def test_refusals_of_heads_a_rank_cannot_hold():
    # 3 KV heads over 2 prefill ranks: 2 + 1
    prefill = [one_region(2, 0, 0, 2), one_region(2, 1, 2, 1)]
    with pytest.raises(GeometryMismatchError, match=r"prefill target: 3 KV heads cannot be spread over tp_size=2 "
                                                    r"ranks.*\(prefill tp_size 2, decode tp_size 1\)"):
        build_tp_plan(prefill, [one_region(1, 0, 0, 3)])
    wrong = side(2, 16, T8)
    wrong[1] = _replace_region(wrong[1], 0, head_start=2)
    with pytest.raises(GeometryMismatchError, match="prefill rank 1 region target layer 0 k: holds heads head_start 2, "
                                                    "num_heads 4; .* must hold head_start 4, num_heads 4"):
        build_tp_plan(wrong, side(1, 16, T8))
    odd = side(1, 16, T8)
    odd[0] = _replace_region(odd[0], 0, item_len=16 * 8 * 4 - 8)
    with pytest.raises(GeometryMismatchError, match="prefill rank 0 has item_len 504 for page_size 16 x 8 heads, "
                                                    "not a whole number"):
        build_tp_plan(odd, side(1, 16, T8))


def test_feed_descs_refuse_short_out_of_range_and_repeated_pages():
    plan = build_tp_plan(side(1, 16, T8, num_pages=4), side(2, 64, T8, num_pages=2))
    feed = plan.feeds[1]
    with pytest.raises(GeometryMismatchError, match="prefill rank 0 -> decode rank 1: prefill: 2 page ids of 16 tokens "
                                                    "cannot hold 40 tokens; 3 are needed"):
        feed_descs(feed, 40, [0, 1], [0])
    with pytest.raises(GeometryMismatchError, match=r"decode page id 2 outside region target layer 0 k's pages \[0, 2\)"):
        feed_descs(feed, 40, [0, 1, 2], [2])
    with pytest.raises(GeometryMismatchError, match="prefill page id 1 appears more than once"):
        feed_descs(feed, 40, [0, 1, 1], [0])
    assert feed_descs(feed, 0, [], [])[0].shape == (0, 3)


@settings(max_examples=60, deadline=None)
@given(setup=setups())
def test_room_descs_is_the_count_of_unmerged_rows_over_every_feed(setup):
    """The registration bound counts exactly what a room of scattered pages builds (fails if
    ``room_descs`` under-counts a page-size mix, and so lets a costlier layout in)."""
    prefill, decode, num_tokens, _, seed = setup
    rng = np.random.default_rng(seed)
    plan = build_tp_plan(prefill, decode)
    p_ids = rng.permutation(prefill[0].regions[0].num_pages)[: -(-num_tokens // prefill[0].page_size)]
    d_ids = rng.permutation(decode[0].regions[0].num_pages)[: -(-num_tokens // decode[0].page_size)]
    rows = sum(len(feed_descs(f, num_tokens, p_ids, d_ids, merge=False)[0]) for f in plan.feeds)
    assert room_descs(plan, num_tokens) == rows
    assert room_descs(plan, num_tokens) <= room_descs(plan, num_tokens + 1)  # the longest room bounds all


def test_a_layout_whose_rooms_need_too_many_descriptors_is_refused_at_registration():
    """A decode with 1-token pages against 16-token prefill pages, 8 KV heads and 32 layers: an
    8k-token room is 8192 segments x 8 heads x 64 regions (~4M descriptors), refused naming the count,
    the bound and the fix; the same model with equal page sizes (one per page and region) is served."""
    target = {"target": (8, 32, 4)}
    prefill = side(1, 16, target, num_pages=512)
    plan = build_tp_plan(prefill, side(2, 1, target, num_pages=8192))
    with pytest.raises(GeometryMismatchError, match=rf"8192 tokens .* {8192 * 8 * 64} NIXL descriptors .* page_size "
                                                    rf"16, decode page_size 1.* bound of {MAX_ROOM_DESCS}"):
        check_room_descs(plan, 8192)
    check_room_descs(build_tp_plan(prefill, side(2, 16, target, num_pages=512)), 8192)
    check_room_descs(plan, 8192, limit=8192 * 8 * 64)  # exactly at the bound: served


def test_the_prefill_refuses_such_a_decode_when_it_registers():
    """``build_peer_plan`` (the registrar's check of a decode's ranks) applies the bound at the
    prefill's longest room, and by default at its whole pool (fails if registration plans such a
    decode and leaves the cost to each room)."""
    from kvferry.common.wire import messages as wire
    from kvferry.prefill_worker.tp_transfer import build_peer_plan

    target = {"target": (8, 32, 4)}
    prefill = side(1, 16, target, num_pages=512)
    decode = side(2, 1, target, num_pages=8192)
    parts = [wire.Register(decode_id="d", agent_name=f"d{lay.tp_rank}", agent_metadata=b"", model=lay.model,
                           page_size=lay.page_size, kv_dtype=lay.kv_dtype, tp_size=lay.tp_size, tp_rank=lay.tp_rank,
                           regions=list(lay.regions), aux=lay.aux) for lay in decode]
    for max_room_tokens in (8192, None):
        with pytest.raises(GeometryMismatchError, match="NIXL descriptors .* bound .*decode peer d"):
            build_peer_plan(prefill, parts, "d", max_room_tokens)
    assert build_peer_plan(prefill, parts, "d", 64).tp.decode_tp == 2  # short rooms only: served
