"""Prepared descriptor lists (DESIGN §4): address order, fused runs, what NIXL merges, aux slots."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.common.plan import geometry as g
from kvferry.common.errors import GeometryMismatchError
from kvferry.common.wire.messages import Region
from tests.unit.geometry_cases import (
    ITEM, PAGES, layout, locate, merged_descs, nixl_merged, page_major, room, rooms, selected, table)


@pytest.mark.parametrize("prefill_pool,decode_pool,contiguous,fragmented", [
    (page_major, page_major, 1 + 1, 5 + 1),  # one block per page; consecutive pages merge into one
    (table, table, 8 + 1, 8 * 5 + 1),  # one descriptor per region per run of pages
    (page_major, table, 8 * 5 + 1, 8 * 5 + 1),  # nothing is adjacent on both sides
    (table, page_major, 8 * 5 + 1, 8 * 5 + 1)])
def test_descriptors_per_layout_pair(prefill_pool, decode_pool, contiguous, fragmented):
    plan = g.build_plan(layout(prefill_pool()), layout(decode_pool(base=0x20_0000)))
    assert merged_descs(plan, room(plan, 80)) == contiguous
    assert merged_descs(plan, room(plan, 80, [6, 2, 4, 0, 7])) == fragmented
    # whatever the prefill's layout, the decode receives the same bytes in the same places
    same = g.build_plan(layout(table()), layout(decode_pool(base=0x20_0000)))
    for ids in (None, [6, 2, 4, 0, 7]):
        assert sorted(d for _, d in selected(plan, room(plan, 80, ids))) == sorted(
            d for _, d in selected(same, room(same, 80, ids)))


def test_entries_follow_prefill_addresses_so_runs_merge_whatever_the_token_order():
    plan = g.build_plan(layout(page_major()), layout(page_major(base=0x20_0000)))
    # token page 0 sits on prefill page 1 and decode page 3, token page 1 on prefill 0 and decode 2:
    # in token order nothing is adjacent, in prefill order prefill 0-1 go to decode 2-3, one run
    xfer = g.request_indices(plan, prefill_page_ids=[1, 0], decode_page_ids=[3, 2],
                             prefill_aux_slot=0, decode_aux_slot=0)
    assert merged_descs(plan, xfer) == 1 + 1
    p_idx, d_idx = xfer.per_group[0]  # the 8 regions fuse into one run: page p is entry p, aux slots follow
    assert p_idx.tolist() == [0, 1, PAGES] and d_idx.tolist() == [2, 3, PAGES]
    assert nixl_merged(plan, xfer) == 2


@given(rooms())
def test_entries_come_in_prefill_address_order(room_):
    for grp, (p_idx, _) in zip(room_.plan.groups, room_.xfer.per_group):
        descs = grp.prefill_descs()
        kv = [(descs[i][2], descs[i][0]) for i in p_idx[:len(p_idx) - grp.has_aux]]
        assert kv == sorted(kv) and len(set(kv)) == len(kv)


@given(rooms())
def test_lists_hold_every_page_by_address_and_grid_finds_it(room_):
    for grp in room_.plan.groups:
        for regions, order, descs, aux in (
                ([p for p, _ in grp.runs], grp.prefill_order, grp.prefill_descs(), grp.prefill_aux),
                ([d for _, d in grp.runs], grp.decode_order, grp.decode_descs(), grp.decode_aux)):
            pages = descs[:order.size]
            keys = [(dev, addr) for addr, _, dev in pages]
            assert keys == sorted(keys) and len(set(keys)) == len(keys) == sum(r.num_pages for r in regions)
            usable = min(r.num_pages for r in regions) if regions else 0  # what grid() may be asked for
            for i, r in enumerate(regions):
                at = order.grid(np.arange(usable, dtype=np.int64))[i]
                assert [descs[e] for e in at] == [(r.addr + p * r.page_stride, r.item_len, r.device)
                                                  for p in range(usable)]
            assert len(descs) - order.size == (aux.num_slots if aux else 0)


@given(rooms())
def test_merge_count_is_what_nixl_does(room_):
    assert merged_descs(room_.plan, room_.xfer) == nixl_merged(room_.plan, room_.xfer)


def test_irregular_interleaving_falls_back_to_a_table():
    regions = page_major(layers=1)  # k and v interleaved; v one page short: not one block per page
    regions[1] = dataclasses.replace(regions[1], num_pages=PAGES - 1)
    plan = g.build_plan(layout(regions), layout(table(layers=1, base=0x20_0000)))
    order = plan.groups[0].prefill_order
    assert order.table is not None and order.clusters == () and order.size == 2 * PAGES - 1
    descs = plan.groups[0].prefill_descs()
    assert [d[0] for d in descs[:4]] == [0x10_0000, 0x10_0000 + ITEM, 0x10_0000 + 2 * ITEM, 0x10_0000 + 3 * ITEM]
    xfer = room(plan, 3 * 16, [4, 5, 6])
    assert merged_descs(plan, xfer) == nixl_merged(plan, xfer) == 2 * 3 + 1  # decode layer-major: nothing merges
    assert Counter(locate(plan.prefill, *p) for p, _ in selected(plan, xfer)) == Counter(
        {(key, page): 1 for key in plan.written for page in range(3)} | {("aux", 0): 1})


@given(rooms())
def test_merging_is_the_most_any_order_can_give(room_):
    """Page entry b can only merge into entry a if b starts where a ends on both sides; every such
    link is realised, so no order of the same pages gives fewer descriptors. The aux slot is listed
    after every page (it is posted last, with the notification): it adds one descriptor at most,
    even where it happens to touch a page listed before the last."""
    for grp, (p_idx, d_idx) in zip(room_.plan.groups, room_.xfer.per_group):
        is_page = [i < grp.prefill_order.size for i in p_idx]
        p_sel = [grp.prefill_descs()[i] for i in p_idx]
        d_sel = [grp.decode_descs()[i] for i in d_idx]
        p_pages = [p for p, page in zip(p_sel, is_page) if page]
        d_pages = [d for d, page in zip(d_sel, is_page) if page]
        ends = {(p[2], p[0] + p[1], d[2], d[0] + d[1]) for p, d in zip(p_pages, d_pages)}
        links = sum((p[2], p[0], d[2], d[0]) in ends for p, d in zip(p_pages, d_pages))
        pages_merged = g.count_merged_descs(p_pages, d_pages) if p_pages else 0
        assert pages_merged == len(p_pages) - links
        assert pages_merged <= g.count_merged_descs(p_sel, d_sel) <= pages_merged + is_page.count(False)
        merged_p, merged_d = g.merge_runs(p_sel, d_sel)
        assert [n for _, n, _ in merged_p] == [n for _, n, _ in merged_d]
        assert sum(n for _, n, _ in merged_p) == sum(p[1] for p in p_sel)


def _repack(regions, *, is_page_major: bool, base: int) -> list[Region]:
    """The same regions (keys, sizes, memory) in a fresh pool at ``base``: per (mem, device), one
    page-major block per page, or regions one after another. Page counts become the smallest one."""
    num_pages, out = min(r.num_pages for r in regions), []
    places = sorted({(r.mem, r.device) for r in regions})
    for place in places:
        group = [r for r in regions if (r.mem, r.device) == place]
        block, cursor = sum(r.item_len for r in group), base
        for r in group:
            if is_page_major:
                out.append(dataclasses.replace(r, addr=cursor, num_pages=num_pages, stride=block))
                cursor += r.item_len
            else:
                out.append(dataclasses.replace(r, addr=cursor, num_pages=num_pages, stride=0))
                cursor += num_pages * r.item_len
    return out


@given(rooms(), st.booleans())
def test_the_prefill_layout_never_changes_what_the_decode_receives(room_, is_page_major):
    """Interop: relay the prefill's pool out page-major or layer-major; token page j of every key still
    goes to the same decode bytes (the decode's own layout decides where those are)."""
    plan = room_.plan
    aux = plan.prefill.aux
    relaid = dataclasses.replace(plan.prefill, regions=tuple(_repack(
        plan.prefill.regions, is_page_major=is_page_major, base=aux.addr + aux.num_slots * aux.item_len)))
    other = g.build_plan(relaid, plan.decode)
    xfer = g.request_indices(other, prefill_page_ids=room_.prefill_ids, decode_page_ids=room_.decode_ids,
                             prefill_aux_slot=room_.prefill_aux_slot, decode_aux_slot=room_.decode_aux_slot)

    def received(plan_, xfer_):
        return Counter((locate(plan_.prefill, *p), d) for p, d in selected(plan_, xfer_))

    assert received(other, xfer) == received(plan, room_.xfer)
    assert xfer.num_bytes == room_.xfer.num_bytes


@given(rooms())
def test_runs_hold_exactly_the_pairs_bytes(room_):
    for grp in room_.plan.groups:
        for side in (0, 1):
            runs = [r[side] for r in grp.runs]
            assert sum(r.item_len for r in runs) == sum(p[side].item_len for p in grp.pairs)
            assert _covered(runs) == _covered([p[side] for p in grp.pairs])


def _covered(spans):
    """The bytes of every page of ``spans`` as maximal (device, start, end) ranges."""
    ranges = sorted((r.device, r.addr + k * r.page_stride, r.addr + k * r.page_stride + r.item_len)
                    for r in spans for k in range(r.num_pages))
    out = []
    for dev, start, end in ranges:
        if out and out[-1][0] == dev and out[-1][2] == start:
            out[-1] = (dev, out[-1][1], end)
        else:
            out.append((dev, start, end))
    return out


def test_regions_fuse_only_when_they_follow_each_other_on_both_sides():
    both = g.build_plan(layout(page_major()), layout(page_major(base=0x20_0000)))
    assert [(p.item_len, d.item_len) for p, d in both.groups[0].runs] == [(8 * ITEM, 8 * ITEM)]
    # the decode lists its regions in another order inside the page block: nothing follows on both sides
    swapped = page_major(base=0x20_0000)
    swapped[0], swapped[1] = (dataclasses.replace(swapped[0], addr=swapped[1].addr),
                              dataclasses.replace(swapped[1], addr=swapped[0].addr))
    plan = g.build_plan(layout(page_major()), layout(swapped))
    assert len(plan.groups[0].runs) == 3  # k0 and v0 stay apart; k1..v3 follow on both sides and fuse
    xfer = room(plan, 16 * 3, [4, 7, 2])
    assert merged_descs(plan, xfer) == nixl_merged(plan, xfer)
    layer_major = g.build_plan(layout(table()), layout(table(base=0x20_0000)))
    assert len(layer_major.groups[0].runs) == 8  # a region's pages are back to back: no page block to share


@given(rooms(), st.data())
def test_a_room_built_before_its_aux_slot_matches_one_built_with_it(room_, data):
    plan = room_.plan
    num_slots = plan.prefill.aux.num_slots
    slot = data.draw(st.integers(0, num_slots - 1))
    early = g.request_indices(plan, prefill_page_ids=room_.prefill_ids, decode_page_ids=room_.decode_ids,
                              prefill_aux_slot=0, decode_aux_slot=room_.decode_aux_slot)
    direct = g.request_indices(plan, prefill_page_ids=room_.prefill_ids, decode_page_ids=room_.decode_ids,
                               prefill_aux_slot=slot, decode_aux_slot=room_.decode_aux_slot)
    late = early.with_prefill_aux_slot(plan, slot)
    assert [[a.tolist() for a in grp] for grp in late.per_group] == [[a.tolist() for a in grp]
                                                                     for grp in direct.per_group]
    assert early.per_group[-1][0][-1] == plan.groups[-1].prefill_order.size  # the original is left alone
    with pytest.raises(GeometryMismatchError, match=f"prefill aux_slot {num_slots} outside"):
        early.with_prefill_aux_slot(plan, num_slots)


def test_page_ids_that_are_not_integers_are_refused():
    plan = g.build_plan(layout(page_major()), layout(page_major(base=0x20_0000)))
    with pytest.raises(GeometryMismatchError, match="decode page ids must be a list of integers"):
        g.request_indices(plan, prefill_page_ids=[0], decode_page_ids=["x"], prefill_aux_slot=0, decode_aux_slot=0)
