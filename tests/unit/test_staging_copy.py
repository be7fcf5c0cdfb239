"""The torch reference of the staging gather and scatter (``common/kernels/staging_copy.py``) on random
page tables: exact bytes, a lossless round trip, and nothing outside the runs touched."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.common.kernels import staging_copy
from kvferry.common.plan.staging import copy_plan


@st.composite
def page_tables(draw):
    """A buffer of pages (stride bytes apart) and a room: distinct random pages, a run of
    ``run_nbytes`` at ``skew`` bytes into each page (a region inside a page block)."""
    unit = draw(st.sampled_from([1, 2, 4, 8, 16]))
    run_nbytes = unit * draw(st.integers(1, 24))
    skew = unit * draw(st.integers(0, 4))
    stride = run_nbytes + skew + unit * draw(st.integers(0, 4))
    num_pages = draw(st.integers(1, 40))
    pages = draw(st.permutations(range(num_pages)))[: draw(st.integers(0, num_pages))]
    dtype = draw(st.sampled_from([torch.uint8, torch.bfloat16, torch.float32]))
    return num_pages * stride, [p * stride + skew for p in pages], run_nbytes, dtype


def _buffer(nbytes: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    size = -(-nbytes // dtype.itemsize)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)


@settings(max_examples=100)
@given(page_tables(), st.integers(0, 2**31))
def test_gather_scatter_exact_and_nothing_else_touched(table, seed):
    nbytes, offsets, run_nbytes, dtype = table
    src, dst = _buffer(nbytes, dtype, seed), _buffer(nbytes, dtype, seed + 1)
    src_bytes, dst_before = src.view(torch.uint8).numpy().copy(), dst.view(torch.uint8).numpy().copy()
    staging = torch.full((len(offsets) * run_nbytes + 5,), 7, dtype=torch.uint8)  # 5 bytes past the room
    addrs = src.data_ptr() + np.asarray(offsets, dtype=np.int64)
    plan = copy_plan(addrs, run_nbytes, src.data_ptr(), staging.data_ptr(), src.numel() * src.element_size())
    staging_copy.gather_reference(src, staging, plan, staging_copy.row_index(plan, "cpu"))
    want = b"".join(src_bytes[o: o + run_nbytes].tobytes() for o in offsets)
    assert staging[: len(want)].numpy().tobytes() == want
    assert staging[len(want):].tolist() == [7] * 5  # the slot past the room is untouched
    assert np.array_equal(src.view(torch.uint8).numpy(), src_bytes)  # the gather only reads

    # scatter the same runs into another buffer, same offsets: the runs come over, the rest stays
    plan = copy_plan(dst.data_ptr() + np.asarray(offsets, dtype=np.int64), run_nbytes, dst.data_ptr(),
                     staging.data_ptr(), dst.numel() * dst.element_size())
    staging_copy.scatter_reference(staging, dst, plan, staging_copy.row_index(plan, "cpu"))
    expect = dst_before.copy()
    for o in offsets:
        expect[o: o + run_nbytes] = src_bytes[o: o + run_nbytes]
    assert np.array_equal(dst.view(torch.uint8).numpy(), expect)


@settings(max_examples=40)
@given(st.integers(1, 64), st.integers(0, 2**31))
def test_round_trip_through_a_random_page_table(num_pages, seed):
    """Gather pages in a random order, scatter to another random table, gather again: same bytes."""
    rng = np.random.default_rng(seed)
    page_nbytes = 256
    pool, other = (torch.from_numpy(rng.integers(0, 256, 2 * num_pages * page_nbytes, dtype=np.uint8))
                   for _ in range(2))
    ids_a = rng.choice(2 * num_pages, num_pages, replace=False)
    ids_b = rng.choice(2 * num_pages, num_pages, replace=False)
    slot_a, slot_b = (torch.empty(num_pages * page_nbytes, dtype=torch.uint8) for _ in range(2))

    def plan(t, ids, slot):
        return copy_plan(t.data_ptr() + ids * page_nbytes, page_nbytes, t.data_ptr(), slot.data_ptr(), t.numel())

    p = plan(pool, ids_a, slot_a)
    staging_copy.gather_reference(pool, slot_a, p, staging_copy.row_index(p, "cpu"))
    p = plan(other, ids_b, slot_a)
    staging_copy.scatter_reference(slot_a, other, p, staging_copy.row_index(p, "cpu"))
    p = plan(other, ids_b, slot_b)
    staging_copy.gather_reference(other, slot_b, p, staging_copy.row_index(p, "cpu"))
    assert torch.equal(slot_a, slot_b)
    assert torch.equal(other.view(-1, page_nbytes)[torch.from_numpy(ids_b)], pool.view(-1, page_nbytes)[torch.from_numpy(ids_a)])


def test_widest_element_and_whole_page_rows_for_a_page_major_pool():
    pool = torch.zeros(8, 3, 2, 16, dtype=torch.bfloat16)  # [pages, layers, k|v, elems]: one block per page
    block = 3 * 2 * 16 * 2
    slot = torch.empty(3 * block, dtype=torch.uint8)
    plan = copy_plan(pool.data_ptr() + np.array([5, 0, 7]) * block, block, pool.data_ptr(), slot.data_ptr(),
                     pool.numel() * 2)
    assert (plan.row_nbytes, plan.elem_nbytes, plan.rows.tolist()) == (block, 8, [5, 0, 7])
    assert staging_copy.rows_view(pool, plan).shape == (8, block // 8)


def test_refusals():
    t = torch.zeros(64, dtype=torch.uint8)
    plan = copy_plan(t.data_ptr() + np.array([0, 16]), 16, t.data_ptr(), t.data_ptr(), 64)
    with pytest.raises(ValueError, match="cannot hold 2 runs of 16"):
        staging_copy.gather_reference(t, torch.empty(31, dtype=torch.uint8), plan, staging_copy.row_index(plan, "cpu"))
    with pytest.raises(ValueError, match="the copy plan is for a buffer at"):
        staging_copy.scatter_reference(torch.empty(32, dtype=torch.uint8), t[8:], plan, staging_copy.row_index(plan, "cpu"))
    with pytest.raises(ValueError, match="contiguous"):
        staging_copy.rows_view(torch.zeros(8, 8)[:, :4], plan)
