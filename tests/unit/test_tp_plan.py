"""Properties of the TP and page-size slicing (common/plan/tp.py): every decode head of every token
is written exactly once, by a prefill rank that holds it, with the source's bytes; nothing else in
the destination pages is touched; equal page sizes move one copy per page."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.common.errors import GeometryMismatchError
from kvferry.common.plan.tp import (
    HeadRange, PageSide, copies, decode_feeders, feeds, num_copies, rank_heads, segments, writer_of,
)

TP_CASES = [(h, p, d) for h in (1, 2, 4, 8) for p in (1, 2, 4, 8) for d in (1, 2, 4, 8)
            if (h % p == 0 or p % h == 0) and (h % d == 0 or d % h == 0)]


@pytest.mark.parametrize("num_kv_heads,prefill_tp,decode_tp", TP_CASES)
def test_every_decode_head_is_fed_once_by_a_rank_that_holds_it(num_kv_heads, prefill_tp, decode_tp):
    plan = feeds(num_kv_heads, prefill_tp, decode_tp)
    for d in range(decode_tp):
        wanted = rank_heads(num_kv_heads, decode_tp, d)
        written = [h for f in plan if f.decode_rank == d for h in range(f.heads.start, f.heads.stop)]
        assert sorted(written) == list(range(wanted.start, wanted.stop)), (d, plan)
        for f in plan:
            held = rank_heads(num_kv_heads, prefill_tp, f.prefill_rank)
            assert f.heads.overlap(held) == f.heads and f.heads.overlap(rank_heads(num_kv_heads, decode_tp,
                                                                                  f.decode_rank)) == f.heads
            for h in range(f.heads.start, f.heads.stop):  # the lowest rank holding a head writes it
                holders = [r for r in range(prefill_tp) if h in rank_heads(num_kv_heads, prefill_tp, r)]
                assert writer_of(h, num_kv_heads, prefill_tp) == f.prefill_rank == holders[0]
        assert decode_feeders(plan, d)  # someone completes every decode rank's rooms


def test_ranks_split_or_replicate_heads_and_refuse_the_rest():
    assert [rank_heads(8, 2, r) for r in range(2)] == [HeadRange(0, 4), HeadRange(4, 4)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [HeadRange(0, 1)] * 2 + [HeadRange(1, 1)] * 2
    assert writer_of(1, 2, 4) == 2  # the lowest rank holding head 1 writes it
    with pytest.raises(GeometryMismatchError, match="8 KV heads cannot be spread over tp_size=3"):
        feeds(8, 3, 1)
    with pytest.raises(GeometryMismatchError, match="decode: 2 KV heads cannot be spread over tp_size=3"):
        feeds(2, 2, 3)
    with pytest.raises(GeometryMismatchError, match="tp_rank must be in"):
        rank_heads(4, 2, 2)


def test_segments_cut_at_both_page_sizes():
    assert segments(100, 16, 64) == [(0, 16), (16, 16), (32, 16), (48, 16), (64, 16), (80, 16), (96, 4)]
    assert segments(20, 64, 16) == [(0, 16), (16, 4)]
    assert segments(5, 16, 16) == [(0, 5)]


def _pool(num_pages: int, side: PageSide, fill: bool) -> np.ndarray:
    shape = (num_pages, side.item_len)
    if not fill:
        return np.zeros(shape, np.int64)
    return np.arange(1, num_pages * side.item_len + 1, dtype=np.int64).reshape(shape)


@settings(max_examples=150, deadline=None)
@given(num_kv_heads=st.sampled_from([1, 2, 4, 8]), tps=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4])),
       sizes=st.tuples(st.sampled_from([1, 4, 16, 64]), st.sampled_from([1, 4, 16, 64])),
       num_tokens=st.integers(1, 300), token_bytes=st.sampled_from([1, 3, 8]), seed=st.integers(0, 2**16))
def test_copies_move_exactly_the_fed_heads_of_every_token(num_kv_heads, tps, sizes, num_tokens, token_bytes, seed):
    prefill_tp, decode_tp = tps
    if any(num_kv_heads % t and t % num_kv_heads for t in tps):
        return
    rng = np.random.default_rng(seed)
    p_size, d_size = sizes
    for d in range(decode_tp):
        dst = PageSide(d_size, rank_heads(num_kv_heads, decode_tp, d), token_bytes)
        d_pages = rng.permutation(-(-num_tokens // d_size) + 3)[: -(-num_tokens // d_size)].tolist()
        d_pool = _pool(max(d_pages) + 1, dst, fill=False)
        written = np.zeros_like(d_pool)
        expected = {}
        for f in feeds(num_kv_heads, prefill_tp, decode_tp):
            if f.decode_rank != d:
                continue
            src = PageSide(p_size, rank_heads(num_kv_heads, prefill_tp, f.prefill_rank), token_bytes)
            p_pages = rng.permutation(-(-num_tokens // p_size) + 2)[: -(-num_tokens // p_size)].tolist()
            p_pool = _pool(max(p_pages) + 1, src, fill=True) * (f.prefill_rank + 1)
            for c in copies(num_tokens, src, p_pages, dst, d_pages, f.heads):
                d_pool[c.dst_page, c.dst_offset:c.dst_offset + c.nbytes] = \
                    p_pool[c.src_page, c.src_offset:c.src_offset + c.nbytes]
                written[c.dst_page, c.dst_offset:c.dst_offset + c.nbytes] += 1
            for h in range(f.heads.start, f.heads.stop):
                for t in range(num_tokens):
                    sp, st_ = divmod(t, p_size)
                    dp, dt = divmod(t, d_size)
                    expected[(d_pages[dp], dst.offset(h, dt))] = p_pool[p_pages[sp], src.offset(h, st_):
                                                                        src.offset(h, st_) + token_bytes]
        assert written.max() <= 1, "a destination byte written twice"
        for (page, offset), want in expected.items():  # every token of every decode head: the source's bytes
            assert (d_pool[page, offset:offset + token_bytes] == want).all()
        # nothing outside the room's pages; inside them, past the tokens only with whole-page copies
        outside = np.ones(d_pool.shape[0], bool)
        outside[d_pages] = False
        assert not written[outside].any()
        if p_size != d_size:
            assert written.sum() == len(expected) * token_bytes


@given(num_tokens=st.integers(1, 500), page=st.sampled_from([1, 16, 64]))
def test_equal_page_sizes_move_one_copy_per_page(num_tokens, page):
    src = PageSide(page, HeadRange(0, 8), 4)
    dst = PageSide(page, HeadRange(2, 2), 4)
    num_pages = -(-num_tokens // page)
    out = copies(num_tokens, src, list(range(num_pages)), dst, list(range(num_pages, 2 * num_pages)), HeadRange(2, 2))
    assert len(out) == num_pages
    assert all(c.nbytes == 2 * page * 4 and c.src_offset == 2 * page * 4 and c.dst_offset == 0 for c in out)


def test_copies_refuse_heads_a_side_lacks_and_short_page_lists():
    src, dst = PageSide(16, HeadRange(0, 2), 4), PageSide(16, HeadRange(2, 2), 4)
    with pytest.raises(GeometryMismatchError, match="not all held"):
        copies(16, src, [0], dst, [0], HeadRange(0, 2))
    with pytest.raises(GeometryMismatchError, match="destination: 1 pages of 16 tokens cannot hold 20 tokens"):
        copies(20, PageSide(16, HeadRange(0, 2), 4), [0, 1], PageSide(16, HeadRange(0, 2), 4), [0], HeadRange(0, 2))


@settings(max_examples=200, deadline=None)
@given(num_tokens=st.integers(0, 300), sizes=st.tuples(st.sampled_from([1, 2, 3, 4, 6, 16, 64]),
                                                       st.sampled_from([1, 2, 3, 4, 6, 16, 64])),
       num_heads=st.integers(1, 4))
def test_num_copies_counts_copies_without_building_them(num_tokens, sizes, num_heads):
    heads = HeadRange(0, num_heads)
    src, dst = PageSide(sizes[0], heads, 2), PageSide(sizes[1], heads, 2)
    pages = list(range(num_tokens + 1))
    assert num_copies(num_tokens, *sizes, num_heads) == len(copies(num_tokens, src, pages, dst, pages, heads))
    assert num_copies(num_tokens, *sizes, num_heads) <= num_copies(num_tokens + 1, *sizes, num_heads)
