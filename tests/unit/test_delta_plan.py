"""Delta transfer maths (prefix reuse): a room whose decode holds its first ``start`` tokens moves
exactly tokens ``[start, n)`` of every head, and no copy lands in a decode page below ``start``
(those pages are cached and shared), at equal and at different page sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from kvferry.common.errors import GeometryMismatchError
from kvferry.common.plan.tp import HeadRange, PageSide, copies

TOKEN_BYTES = 4
PAGE_SIZES = (4, 8, 12, 16)


def _landed(cs, dst: PageSide, heads: HeadRange) -> set[tuple[int, int]]:
    """(head, token) cells written, read back from the copies' destination offsets."""
    out = set()
    for c in cs:
        for b in range(0, c.nbytes, TOKEN_BYTES):
            cell, = divmod(c.dst_offset + b, TOKEN_BYTES)[:1]
            head_off, row = divmod(cell, dst.page_size)
            out.add((dst.heads.start + head_off, c.dst_page * dst.page_size + row))
    return out


@given(src_ps=st.sampled_from(PAGE_SIZES), dst_ps=st.sampled_from(PAGE_SIZES), n=st.integers(1, 80),
       start_pages=st.integers(0, 20), num_heads=st.integers(1, 3))
def test_delta_moves_exactly_the_suffix(src_ps, dst_ps, n, start_pages, num_heads):
    start = min(start_pages * dst_ps, (n // dst_ps) * dst_ps)
    heads = HeadRange(0, num_heads)
    src, dst = PageSide(src_ps, heads, TOKEN_BYTES), PageSide(dst_ps, heads, TOKEN_BYTES)
    src_pages = list(range(-(-n // src_ps)))
    dst_pages = list(range(-(-n // dst_ps)))  # page j holds tokens [j * dst_ps, (j + 1) * dst_ps)
    cs = copies(n, src, src_pages, dst, dst_pages, heads, start)
    assert all(c.dst_page >= start // dst_ps for c in cs)  # never into a cached page
    cells = _landed(cs, dst, heads)
    wanted = {(h, t) for h in range(num_heads) for t in range(start, n)}
    assert wanted <= cells
    if src_ps != dst_ps:
        assert cells == wanted  # cut at both sides' page boundaries: nothing past the prompt
    else:  # whole pages: the last page's tail (past n) lands in a page the room owns
        assert all(t >= start for _, t in cells)


def test_start_must_be_a_whole_decode_page():
    side = PageSide(16, HeadRange(0, 1), TOKEN_BYTES)
    with pytest.raises(GeometryMismatchError, match="multiple of the destination's page size"):
        copies(40, side, [0, 1, 2], side, [0, 1, 2], HeadRange(0, 1), start=8)
    assert copies(32, side, [0, 1], side, [5, 6], HeadRange(0, 1), start=32) == []
