"""KV geometry (DESIGN §4): matching by key, grouping by memory kind, per-room index lists."""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.common.plan import geometry as g
from kvferry.common.plan.layout import KvLayout, check_layout
from kvferry.common.errors import GeometryMismatchError
from kvferry.common.wire.messages import Region, Register
from tests.unit.geometry_cases import (
    AUX, ITEM, PAGES, layout, layout_pairs, locate, page_major, plan_ranges, room, rooms, selected, table, transfer)


def test_identical_tables():
    plan = g.build_plan(layout(table()), layout(table(base=0x20_0000)))
    assert plan.written == tuple(r.key for r in table()) and plan.ignored == ()
    assert not plan.decode_only_spec_dec
    (grp,) = plan.groups
    assert grp.has_aux and len(grp.pairs) == 8
    assert len(grp.prefill_descs()) == len(grp.decode_descs()) == 8 * PAGES + AUX.num_slots
    assert grp.decode_descs()[PAGES + 3] == (0x20_0000 + ITEM * PAGES + 3 * ITEM, ITEM, 0)  # target 0 v, page 3
    assert grp.decode_descs()[-1] == (AUX.addr + 3 * AUX.item_len, AUX.item_len, 0)
    xfer = room(plan, 40)  # 3 pages
    assert xfer.num_bytes == 3 * 8 * ITEM + AUX.item_len
    p_idx, d_idx = xfer.per_group[0]
    assert d_idx.dtype == np.int64 and d_idx[:4].tolist() == [0, 1, 2, PAGES]  # region by region
    assert d_idx[-1] == 8 * PAGES + 1 and p_idx[-1] == 8 * PAGES  # the aux slots, last


def _with_draft(order):
    target, draft = table(base=0x20_0000), table("draft", layers=2, base=0x40_0000)
    if order == "appended":
        return target + draft
    if order == "prepended":
        return draft + target
    return [r for i, t in enumerate(target) for r in ([t, draft[i]] if i < len(draft) else [t])]


@pytest.mark.parametrize("order", ["appended", "prepended", "interleaved"])
def test_decode_only_draft_regions_are_ignored_in_any_order(order):
    decode_regions = _with_draft(order)
    assert sorted(r.key for r in decode_regions) == sorted(r.key for r in _with_draft("appended"))
    plan = g.build_plan(layout(table()), layout(decode_regions))
    assert plan.decode_only_spec_dec
    assert set(plan.ignored) == {r.key for r in table("draft", layers=2)}
    assert plan.written == tuple(r.key for r in table())
    reference = g.build_plan(layout(table()), layout(table(base=0x20_0000)))
    assert plan_ranges(plan) == plan_ranges(reference)
    assert selected(plan, room(plan, 50, [5, 6, 7, 0])) == selected(reference, room(reference, 50, [5, 6, 7, 0]))


@pytest.mark.parametrize("dropped,extra,match", [
    (("target", 3, "v"), [], "decode registered fewer KV regions than prefill: missing target layer 3 v"),
    (("target", 1, "k"), table("draft", 1, 0x40_0000)[:1], "do not cover the prefill's: missing target layer 1 k")])
def test_decode_with_fewer_regions_is_refused_naming_the_missing_key(dropped, extra, match):
    decode = [r for r in table(base=0x20_0000) if r.key != dropped] + extra
    with pytest.raises(GeometryMismatchError, match=match):
        g.build_plan(layout(table()), layout(decode))


def test_extra_target_region_on_decode_is_refused():
    with pytest.raises(GeometryMismatchError, match="target regions the prefill does not have: target layer 4 k"):
        g.build_plan(layout(table()), layout(table(layers=5, base=0x20_0000)))


def test_prefill_with_a_draft_writes_the_draft_regions():
    prefill = table() + table("draft", 2, 0x40_0000)
    decode = table("draft", 2, 0x60_0000) + table(base=0x20_0000)
    plan = g.build_plan(layout(prefill), layout(decode))
    assert plan.written == tuple(r.key for r in prefill) and plan.ignored == ()
    assert not plan.decode_only_spec_dec
    assert sum(len(x.pairs) for x in plan.groups) == 12


def test_prefill_and_decode_with_different_draft_models_are_refused():
    with pytest.raises(GeometryMismatchError, match="draft regions the prefill does not have: draft layer 1 k"):
        g.build_plan(layout(table() + table("draft", 1, 0x40_0000)),
                     layout(table(base=0x20_0000) + table("draft", 2, 0x60_0000)))


def test_vram_target_and_dram_draft_on_decode_only_spec_dec_is_accepted():
    prefill = layout(table(mem="VRAM"))
    decode = layout(table(mem="VRAM", base=0x20_0000) + table("draft", 2, 0x40_0000, mem="DRAM"))
    plan = g.build_plan(prefill, decode)
    assert plan.decode_only_spec_dec and len(plan.ignored) == 4
    assert [(x.prefill_mem, x.decode_mem, x.has_aux) for x in plan.groups] == [
        ("VRAM", "VRAM", False), ("DRAM", "DRAM", True)]
    assert plan.groups[-1].pairs == ()  # aux lives in DRAM, no KV region does on the prefill
    assert {r.mem for x in plan.groups[:1] for pair in x.pairs for r in pair} == {"VRAM"}


def test_vram_target_and_dram_draft_on_both_sides_makes_two_groups_aux_last():
    prefill = layout(table(mem="VRAM") + table("draft", 2, 0x40_0000, mem="DRAM"))
    decode = layout(table("draft", 2, 0x60_0000, mem="DRAM") + table(mem="VRAM", base=0x20_0000))
    plan = g.build_plan(prefill, decode)
    vram, dram = plan.groups
    assert (vram.prefill_mem, vram.decode_mem, vram.has_aux) == ("VRAM", "VRAM", False)
    assert (dram.prefill_mem, dram.decode_mem, dram.has_aux) == ("DRAM", "DRAM", True)
    assert [p.key[0] for p, _ in vram.pairs] == ["target"] * 8
    assert [p.key[0] for p, _ in dram.pairs] == ["draft"] * 4
    xfer = room(plan, 17)
    assert len(xfer.per_group[0][0]) == 2 * 8 and len(xfer.per_group[1][0]) == 2 * 4 + 1


@pytest.mark.parametrize("field,prefill_value,decode_value", [
    ("model", "llama-3-8b/fp1", "qwen2-7b/fp9"), ("page_size", 16, 32), ("kv_dtype", "bfloat16", "float16"),
    ("tp_size", 1, 2)])
def test_layout_mismatch_shows_both_values(field, prefill_value, decode_value):
    with pytest.raises(GeometryMismatchError, match=f"{field}.*mismatch") as err:
        g.build_plan(layout(table(), **{field: prefill_value}), layout(table(base=0x20_0000), **{field: decode_value}))
    assert repr(prefill_value) in str(err.value) and repr(decode_value) in str(err.value)


@pytest.mark.parametrize("field,value", [("item_len", 512), ("head_start", 2), ("num_heads", 4)])
def test_region_mismatch_shows_both_values(field, value):
    decode = table(base=0x20_0000)
    decode[7] = dataclasses.replace(decode[7], **{field: value})  # the last region: growing it overlaps nothing
    with pytest.raises(GeometryMismatchError,
                       match=f"target layer 3 v: {field} mismatch: prefill has {getattr(decode[6], field)}, "
                             f"decode has {value}"):
        g.build_plan(layout(table()), layout(decode))


def test_mismatch_names_the_peer():
    with pytest.raises(GeometryMismatchError, match=r"page_size.*\(decode peer dec-7\)"):
        g.build_plan(layout(table()), layout(table(base=0x20_0000), page_size=8), peer="dec-7")


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_duplicate_keys_are_refused(side):
    dup = table() + [dataclasses.replace(table()[2], addr=0x80_0000)]
    sides = {"prefill": layout(table()), "decode": layout(table(base=0x20_0000)), side: layout(dup)}
    with pytest.raises(GeometryMismatchError, match=f"{side}: region target layer 1 k registered twice"):
        g.build_plan(sides["prefill"], sides["decode"])


def test_address_overflow_is_refused():
    end_fits = [dataclasses.replace(r, addr=(1 << 64) - ITEM * PAGES * (8 - i)) for i, r in enumerate(table())]
    check_layout(layout(end_fits), "decode")  # ends exactly at 2**64: the last byte is addressable
    past = end_fits[:-1] + [dataclasses.replace(end_fits[-1], addr=end_fits[-1].addr + 1)]
    with pytest.raises(GeometryMismatchError, match="decode region target layer 3 v: addr .* past the 64-bit"):
        g.build_plan(layout(table()), layout(past))
    with pytest.raises(GeometryMismatchError, match="decode aux: .* past the 64-bit"):
        g.build_plan(layout(table()), layout(table(base=0x20_0000), aux=dataclasses.replace(AUX, addr=(1 << 64) - 64)))


@pytest.mark.parametrize("field,value,expected", [
    ("model", "medusa", "one of"), ("kind", "kv", "one of"), ("mem", "HBM", "one of"), ("layer", -1, ">= 0"),
    ("item_len", 0, "> 0"), ("num_pages", 0, r"in \[1, 4194304\]"),
    ("num_pages", 2**40, r"in \[1, 4194304\]"), ("addr", -8, ">= 0"), ("num_heads", 0, "> 0")])
def test_insane_region_is_refused_naming_the_field(field, value, expected):
    bad = table(base=0x20_0000)
    bad[0] = dataclasses.replace(bad[0], **{field: value})
    with pytest.raises(GeometryMismatchError, match=f"decode region .*: {field} must be {expected}.*{value!r}"):
        g.build_plan(layout(table()), layout(bad))


@pytest.mark.parametrize("field,value", [("item_len", 16), ("num_slots", 0), ("mem", "GPU")])
def test_insane_aux_is_refused(field, value):
    with pytest.raises(GeometryMismatchError, match=f"decode aux: {field} must be"):
        g.build_plan(layout(table()), layout(table(), aux=dataclasses.replace(AUX, **{field: value})))


def test_aux_record_is_the_smaller_slot_of_the_two_sides():
    """Either side may be the older one (a 32-byte v1 slot): the prefill writes what the smaller slot
    holds (common/wire/aux_record.py picks the record that fits)."""
    plan = g.build_plan(layout(table(), aux=dataclasses.replace(AUX, item_len=128)), layout(table()))
    assert plan.aux_nbytes == 64 and plan.groups[-1].prefill_descs()[-1][1] == 64
    plan = g.build_plan(layout(table()), layout(table(), aux=dataclasses.replace(AUX, item_len=128)))
    assert plan.aux_nbytes == 64 and plan.groups[-1].decode_descs()[-1][:2] == (AUX.addr + 3 * 128, 64)


def test_overlapping_regions_are_refused():
    bad = table(base=0x20_0000)
    bad[3] = dataclasses.replace(bad[3], addr=bad[2].addr + ITEM)
    with pytest.raises(GeometryMismatchError, match="decode: target layer 1 k .* and target layer 1 v .* overlap"):
        g.build_plan(layout(table()), layout(bad))
    with pytest.raises(GeometryMismatchError, match="overlap on DRAM device 0"):
        check_layout(layout(table(), aux=dataclasses.replace(AUX, addr=0x10_0000)), "prefill")
    moved = bad[:3] + [dataclasses.replace(bad[3], device=1)] + bad[4:]
    check_layout(layout(moved), "decode")  # same addresses on another device do not overlap


def test_from_register_keeps_every_field():
    reg = Register(decode_id="d", agent_name="a", agent_metadata=b"", model="m", page_size=8, kv_dtype="fp8",
                   tp_size=2, tp_rank=1, regions=table(), aux=AUX)
    assert KvLayout.from_register(reg) == layout(table(), model="m", page_size=8, kv_dtype="fp8",
                                                   tp_size=2, tp_rank=1)


PLAN = g.build_plan(layout(table()), layout(table(base=0x20_0000)))


@pytest.mark.parametrize("ids,match", [
    ([0, 8, 1], r"decode page id 8 outside the KV pool \[0, 8\)"), ([0, -1, 1], "decode page id -1 outside"),
    ([4, 2, 4], "decode page id 4 appears more than once"),
    ([0, 1], "2 page ids for 33 prompt tokens at page_size 16; expected 3"),
    ([0, 1, 2, 3], "4 page ids for 33 prompt tokens")])
def test_bad_page_ids_are_refused(ids, match):
    g.validate_transfer(PLAN, transfer([7, 0, 3], 33, aux_slot=3), prefill_num_prompt_tokens=33)  # the valid case
    with pytest.raises(GeometryMismatchError, match=f"room 42 from decode dec-1: .*{match}"):
        g.validate_transfer(PLAN, transfer(ids, 33), prefill_num_prompt_tokens=33)


def test_page_range_uses_the_smallest_written_decode_region():
    decode = table(base=0x20_0000)
    decode[6] = dataclasses.replace(decode[6], num_pages=5)
    plan = g.build_plan(layout(table()), layout(decode + table("draft", 1, 0x40_0000, num_pages=2)))
    assert plan.num_decode_pages == 5  # the ignored 2-page draft does not count
    g.validate_transfer(plan, transfer([4], 16), prefill_num_prompt_tokens=16)
    with pytest.raises(GeometryMismatchError, match=r"page id 5 outside the KV pool \[0, 5\)"):
        g.validate_transfer(plan, transfer([5], 16), prefill_num_prompt_tokens=16)


@pytest.mark.parametrize("slot", [4, -1, 100])
def test_wrong_aux_slot_is_refused(slot):
    with pytest.raises(GeometryMismatchError, match=rf"room 42 .*aux_slot {slot} outside \[0, 4\)"):
        g.validate_transfer(PLAN, transfer([0], 5, aux_slot=slot), prefill_num_prompt_tokens=5)


def test_wrong_prompt_length_is_refused_as_a_tokenizer_mismatch():
    with pytest.raises(GeometryMismatchError,
                       match="room 42 .*decode counted 33, prefill counted 34; tokenizer mismatch likely"):
        g.validate_transfer(PLAN, transfer([0, 1, 2], 33), prefill_num_prompt_tokens=34)
    with pytest.raises(GeometryMismatchError, match="num_prompt_tokens must be > 0"):
        g.validate_transfer(PLAN, transfer([], 0), prefill_num_prompt_tokens=0)


def test_request_indices_refuses_bad_local_input():
    with pytest.raises(GeometryMismatchError, match="2 prefill pages but 1 decode pages"):
        g.request_indices(PLAN, prefill_page_ids=[0, 1], decode_page_ids=[0], prefill_aux_slot=0, decode_aux_slot=0)
    with pytest.raises(GeometryMismatchError, match="prefill page id 9 outside"):
        g.request_indices(PLAN, prefill_page_ids=[9], decode_page_ids=[0], prefill_aux_slot=0, decode_aux_slot=0)
    with pytest.raises(GeometryMismatchError, match=r"prefill aux_slot 4 outside \[0, 4\)"):
        g.request_indices(PLAN, prefill_page_ids=[0], decode_page_ids=[0], prefill_aux_slot=4, decode_aux_slot=0)


def test_contiguous_pages_merge_into_one_descriptor_per_run():
    gapped = [dataclasses.replace(r, addr=r.addr + i * 4096) for i, r in enumerate(table(base=0x20_0000))]
    plan = g.build_plan(layout([dataclasses.replace(r, addr=r.addr + i * 4096) for i, r in enumerate(table())]),
                        layout(gapped))
    (grp,) = plan.groups
    p_descs, d_descs = grp.prefill_descs(), grp.decode_descs()

    def merged(xfer):
        p_idx, d_idx = xfer.per_group[0]
        return g.count_merged_descs([p_descs[i] for i in p_idx], [d_descs[i] for i in d_idx])

    assert merged(room(plan, 80)) == 8 + 1  # 5 contiguous pages per region, plus the aux slot
    assert merged(room(plan, 80, [0, 1, 4, 5, 6])) == 8 * 2 + 1
    assert merged(room(plan, 80, [4, 3, 2, 1, 0])) == 8 * 5 + 1  # reversed pages never merge


@given(rooms())
def test_every_written_range_lies_inside_its_matched_regions(room_):
    for (p_mem, p_addr, p_len, p_dev), (d_mem, d_addr, d_len, d_dev) in selected(room_.plan, room_.xfer):
        assert p_len == d_len > 0
        p_at = locate(room_.plan.prefill, p_mem, p_addr, p_len, p_dev)
        d_at = locate(room_.plan.decode, d_mem, d_addr, d_len, d_dev)
        assert p_at is not None and d_at is not None and p_at[0] == d_at[0]


@given(rooms())
def test_token_page_j_goes_from_prefill_page_to_decode_page(room_):
    plan = room_.plan
    written = [(locate(plan.prefill, *p), locate(plan.decode, *d)) for p, d in selected(plan, room_.xfer)]
    expected = [((key, p), (key, d)) for key in plan.written for p, d in zip(room_.prefill_ids, room_.decode_ids)]
    expected.append((("aux", room_.prefill_aux_slot), ("aux", room_.decode_aux_slot)))
    assert Counter(written) == Counter(expected)


@given(layout_pairs())
def test_written_keys_are_exactly_the_prefill_keys(pair):
    prefill, decode = pair
    plan = g.build_plan(prefill, decode)
    assert plan.written == tuple(r.key for r in prefill.regions)
    assert set(plan.ignored) == {r.key for r in decode.regions} - set(plan.written)
    assert plan.decode_only_spec_dec == bool(plan.ignored)
    assert sorted(p.key for x in plan.groups for p, _ in x.pairs) == sorted(plan.written)
    for x in plan.groups:
        positions = [plan.written.index(p.key) for p, _ in x.pairs]
        assert positions == sorted(positions)  # each group keeps the prefill's table order
        assert all(p.mem == x.prefill_mem and d.mem == x.decode_mem and p.key == d.key for p, d in x.pairs)
    assert plan.groups[-1].has_aux and not any(x.has_aux for x in plan.groups[:-1])


@given(rooms(), st.randoms(use_true_random=False))
def test_shuffling_the_decode_table_never_changes_byte_ranges(room_, rnd):
    plan, xfer = room_.plan, room_.xfer
    shuffled = list(plan.decode.regions)
    rnd.shuffle(shuffled)
    other = g.build_plan(plan.prefill, dataclasses.replace(plan.decode, regions=tuple(shuffled)))
    assert plan_ranges(other) == plan_ranges(plan)
    assert set(other.ignored) == set(plan.ignored)
    assert other.groups == plan.groups  # same pairs, so the same index lists too
    assert selected(other, xfer) == selected(plan, xfer)


@given(rooms())
def test_room_writes_disjoint_decode_ranges_covering_exactly_its_pages(room_):
    plan, xfer, num_pages, n_tokens = room_.plan, room_.xfer, len(room_.decode_ids), room_.n_tokens
    if n_tokens:
        assert math.ceil(n_tokens / plan.page_size) == num_pages
    ranges = sorted((d[0], d[3], d[1], d[1] + d[2]) for _, d in selected(plan, xfer))
    for a, b in zip(ranges, ranges[1:]):
        assert a[:2] != b[:2] or a[3] <= b[2], f"overlap {a} {b}"
    per_region = sum(num_pages * p.item_len for x in plan.groups for p, _ in x.pairs)
    aux = plan.groups[-1].aux_nbytes
    assert sum(end - start for *_, start, end in ranges) == per_region + aux == xfer.num_bytes
    assert len(ranges) == num_pages * len(plan.written) + 1
    owners = Counter(locate(plan.decode, mem, start, end - start, dev)[0] for mem, dev, start, end in ranges)
    assert owners == Counter({key: num_pages for key in plan.written if num_pages} | {"aux": 1})


@given(st.lists(st.tuples(st.sampled_from(["DRAM", "VRAM"]), st.integers(0, 1), st.integers(0, 96),
                          st.integers(1, 4), st.sampled_from([1, 8, 16]), st.sampled_from([0, 0, 0, 1, 8, 16, 24, 40])),
                min_size=1, max_size=6))
def test_overlap_check_agrees_with_brute_force(spans):
    """Refused exactly when two regions share a byte, or (the documented conservative rule) when two
    regions of different page strides interleave."""
    regions = [Region(model="target", layer=i, kind="k", mem=mem, device=dev, addr=addr, item_len=item_len,
                      num_pages=pages, head_start=0, num_heads=1, stride=item_len + extra if extra else 0)
               for i, (mem, dev, addr, pages, item_len, extra) in enumerate(spans)]
    items = [(i, r.mem, r.device, r.addr + p * r.page_stride, r.item_len)
             for i, r in enumerate(regions) for p in range(r.num_pages)]
    items += [(-1, AUX.mem, AUX.device, AUX.addr + s * AUX.item_len, AUX.item_len) for s in range(AUX.num_slots)]
    sharing = any(a[0] != b[0] and a[1:3] == b[1:3] and a[3] < b[3] + b[4] and b[3] < a[3] + a[4]
                  for i, a in enumerate(items) for b in items[i + 1:])
    extents = [(r.mem, r.device, r.page_stride, r.addr, r.addr + (r.num_pages - 1) * r.page_stride + r.item_len)
               for r in regions]
    interleaved = any(a[:2] == b[:2] and a[2] != b[2] and a[3] < b[4] and b[3] < a[4]
                      for i, a in enumerate(extents) for b in extents[i + 1:])
    if sharing:
        with pytest.raises(GeometryMismatchError, match="overlap on") as err:
            check_layout(layout(regions), "decode")
        shown = re.search(r"on (\w+) device (\d): byte (0x[0-9a-f]+) lies in a page of both", str(err.value))
        if shown:  # the byte named is really in two regions' pages
            mem, dev, byte = shown[1], int(shown[2]), int(shown[3], 16)
            assert len({i for i, m, d, start, n in items if (m, d) == (mem, dev) and start <= byte < start + n}) >= 2
        else:
            assert "different page strides" in str(err.value)
    elif interleaved:
        with pytest.raises(GeometryMismatchError, match="overlap on .* with different page strides"):
            check_layout(layout(regions), "decode")
    else:
        check_layout(layout(regions), "decode")


def test_page_major_regions_interleave_without_sharing_a_byte():
    check_layout(layout(page_major()), "decode")
    block = 8 * ITEM
    # one region shifted by half a page into its neighbour's bytes
    bad = page_major()
    bad[5] = dataclasses.replace(bad[5], addr=bad[5].addr + ITEM // 2)
    with pytest.raises(GeometryMismatchError, match=r"decode: target layer 2 v \[.*\) and target layer 3 k .* "
                                                    r"overlap on DRAM device 0: byte 0x100600 lies in a page of both"):
        check_layout(layout(bad), "decode")
    # a stride one page short of the block: page 1 of layer 0 k lands on page 0 of layer 3 v
    short = [dataclasses.replace(r, stride=block - ITEM) for r in page_major()]
    with pytest.raises(GeometryMismatchError, match="target layer 0 k .* and target layer 3 v .* byte 0x100700"):
        check_layout(layout(short), "decode")
    # a page-major pool beside a layer-major one (another model) in its own span is fine
    check_layout(layout(page_major() + table("draft", 2, base=0x10_0000 + PAGES * block)), "decode")
    with pytest.raises(GeometryMismatchError, match="different page strides"):
        check_layout(layout(page_major() + table("draft", 2, base=0x10_0000 + PAGES * block - ITEM)), "decode")


def test_stride_is_checked():
    with pytest.raises(GeometryMismatchError, match=r"decode region target layer 0 k: stride must be 0 or >= "
                                                    r"item_len.*got 255"):
        g.build_plan(layout(table()), layout([dataclasses.replace(table()[0], stride=ITEM - 1)] + table()[1:]))
    last = dataclasses.replace(page_major()[0], addr=(1 << 64) - (PAGES - 1) * 8 * ITEM - ITEM)
    check_layout(layout([last]), "decode")  # the last page ends exactly at 2**64
    with pytest.raises(GeometryMismatchError, match="every 2048 bytes ends at 0x10000000000000001, past the 64-bit"):
        check_layout(layout([dataclasses.replace(last, addr=last.addr + 1)]), "decode")
    assert page_major()[0].page_stride == 8 * ITEM and table()[0].page_stride == ITEM


@pytest.mark.parametrize("first", [0, 1, 3, 4])
def test_a_decode_prefix_hit_writes_only_the_pages_after_it(first):
    """Prefix reuse on the equal-geometry lists: pages below ``first_page`` (the decode's cached,
    shared ones) are neither read nor written; the aux record still goes, last."""
    from tests.unit.geometry_cases import selected

    prefill_ids, decode_ids = [4, 5, 6, 7], [3, 0, 1, 2]
    whole = g.request_indices(PLAN, prefill_page_ids=prefill_ids, decode_page_ids=decode_ids, prefill_aux_slot=0,
                              decode_aux_slot=1)
    delta = g.request_indices(PLAN, prefill_page_ids=prefill_ids, decode_page_ids=decode_ids, prefill_aux_slot=0,
                              decode_aux_slot=1, first_page=first)
    tail = g.request_indices(PLAN, prefill_page_ids=prefill_ids[first:], decode_page_ids=decode_ids[first:],
                             prefill_aux_slot=0, decode_aux_slot=1)
    assert selected(PLAN, delta) == selected(PLAN, tail)
    assert len(selected(PLAN, delta)) < len(selected(PLAN, whole)) or first == 0
    page_bytes = sum(grp.page_nbytes for grp in PLAN.groups)
    assert whole.num_bytes - delta.num_bytes == first * page_bytes
    msg = dataclasses.replace(transfer(decode_ids, 64), decode_prefix_len=first * PLAN.page_size)
    g.validate_transfer(PLAN, msg, prefill_num_prompt_tokens=64)
    with pytest.raises(GeometryMismatchError, match="decode_prefix_len 8 must be a multiple"):
        g.validate_transfer(PLAN, dataclasses.replace(msg, decode_prefix_len=8), prefill_num_prompt_tokens=64)
