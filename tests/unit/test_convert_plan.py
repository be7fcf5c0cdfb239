"""KV dtype conversion in transit (common/plan/convert.py): which pairs convert, what the plan checks,
and a converted room gathered from real bf16/fp32 pool tensors, scattered into a real e4m3 pool,
equal to quantising the prefill's pages with the decode's scales."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvferry.common.errors import GeometryMismatchError
from kvferry.common.kernels.kv_quant import quantize
from kvferry.common.kernels.staging_copy import gather_convert, inverse_scales, row_index, scatter, to_e4m3
from kvferry.common.plan import geometry as g
from kvferry.common.plan.convert import CONVERSIONS, conversion
from kvferry.common.plan.staging import copy_plan, room_stream
from kvferry.common.wire.messages import AuxInfo, Region

from tests.unit.geometry_cases import layout, page_major, table

AUX = AuxInfo(mem="DRAM", device=0, addr=0x9000_0000, item_len=64, num_slots=4)


def test_equal_dtypes_move_as_they_are_and_wider_to_fp8_converts():
    assert conversion("bfloat16", "bfloat16") is None
    assert conversion("float8_e4m3fn", "float8_e4m3fn") is None
    assert conversion("bfloat16", "float8_e4m3fn").ratio == 2
    assert conversion("float16", "float8_e4m3fn").ratio == 2
    assert conversion("float32", "float8_e4m3fn").ratio == 4
    assert all(dst == "float8_e4m3fn" for _, dst in CONVERSIONS)


@pytest.mark.parametrize("prefill,decode", [("float8_e4m3fn", "bfloat16"), ("float16", "bfloat16"),
                                            ("bfloat16", "float32"), ("bfloat16", "int8")])
def test_a_pair_that_cannot_convert_is_refused_naming_both_dtypes(prefill, decode):
    with pytest.raises(GeometryMismatchError) as err:
        conversion(prefill, decode)
    assert repr(prefill) in str(err.value) and repr(decode) in str(err.value)


def _half(regions, scale=0.5):
    """The decode's side of ``regions`` in a dtype of half the bytes: items and strides halved."""
    return [dataclasses.replace(r, addr=0x4000_0000 + (r.addr - 0x10_0000) // 2, item_len=r.item_len // 2,
                                stride=r.stride // 2, scale=scale * (1 + r.layer)) for r in regions]


@pytest.mark.parametrize("maker", [table, page_major])
def test_build_plan_accepts_a_bf16_prefill_for_an_fp8_decode(maker):
    p = layout(maker(), kv_dtype="bfloat16")
    d = layout(_half(maker()), kv_dtype="float8_e4m3fn")
    plan = g.build_plan(p, d)
    assert plan.conversion is not None and plan.conversion.ratio == 2
    grp = plan.groups[0]
    assert grp.page_nbytes == sum(r.item_len for r in d.regions)  # what the decode receives per page
    members = [m for _, run in grp.runs for m in run.members]
    assert sorted(members) == sorted((r.item_len, r.scale) for r in d.regions)  # every region's scale, once
    segs = room_stream(grp, [3, 5], [1, 6], converted=True)
    assert all(s.prefill_nbytes == 2 * s.run_nbytes for s in segs)
    assert sum(s.num_runs * s.run_nbytes for s in segs) == 2 * grp.page_nbytes


def test_converted_plan_refuses_item_lens_that_do_not_hold_the_same_elements():
    p = layout(table(), kv_dtype="bfloat16")
    d = layout(_half(table()), kv_dtype="float8_e4m3fn")
    bad = list(d.regions)
    bad[2] = dataclasses.replace(bad[2], item_len=bad[2].item_len // 2)  # a quarter of the prefill's bytes
    with pytest.raises(GeometryMismatchError, match="target layer 1 k: item_len mismatch.*bfloat16.*float8_e4m3fn"):
        g.build_plan(p, dataclasses.replace(d, regions=tuple(bad)))


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_converted_plan_refuses_an_unusable_scale(scale):
    p = layout(table(), kv_dtype="bfloat16")
    regions = _half(table())
    regions[0] = dataclasses.replace(regions[0], scale=scale)
    with pytest.raises(GeometryMismatchError, match="FP8 scale"):
        g.build_plan(p, layout(regions, kv_dtype="float8_e4m3fn"))


def test_unconverted_plan_still_refuses_other_dtypes_naming_both():
    with pytest.raises(GeometryMismatchError, match="'float8_e4m3fn'.*'bfloat16'"):
        g.build_plan(layout(table(), kv_dtype="float8_e4m3fn"), layout(table(), kv_dtype="bfloat16"))


# -- a converted room over real tensors -----------------------------------------------------------

LAYERS, HEADS, PAGE, DIM, PAGES = 3, 2, 4, 8, 10


def _pool(dtype, page_major_: bool) -> tuple[torch.Tensor, list[Region]]:
    """A KV pool tensor and its regions, shaped as common/cache/kv_cache.py lays them out."""
    elems = HEADS * PAGE * DIM
    shape = (PAGES, LAYERS, 2, elems) if page_major_ else (LAYERS, 2, PAGES, elems)
    pool = torch.zeros(shape, dtype=dtype)
    item = elems * pool.element_size()
    regions = []
    for layer in range(LAYERS):
        for i, kind in enumerate("kv"):
            view = pool[0, layer, i] if page_major_ else pool[layer, i, 0]
            stride = LAYERS * 2 * item if page_major_ else 0
            regions.append(Region(model="target", layer=layer, kind=kind, mem="DRAM", device=0,
                                  addr=view.data_ptr(), item_len=item, num_pages=PAGES, head_start=0,
                                  num_heads=HEADS, stride=stride, scale=0.3 * (layer + 1) * (1 + i)))
    return pool, regions


def _page(pool, page_major_, layer, i, p):
    return pool[p, layer, i] if page_major_ else pool[layer, i, p]


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("p_major,d_major", [(True, True), (False, False), (True, False), (False, True)])
@pytest.mark.parametrize("first_page", [0, 2])
def test_a_converted_room_lands_as_the_decode_would_have_stored_it(src, p_major, d_major, first_page):
    torch.manual_seed(0)
    prefill_pool, p_regions = _pool(src, p_major)
    prefill_pool.copy_(torch.randn(prefill_pool.shape) * 300)  # beyond ±448 * scale: saturation is exercised
    decode_pool, d_regions = _pool(torch.float8_e4m3fn, d_major)
    decode_pool.view(torch.uint8).fill_(0x7F)  # NaN bytes: anything left unwritten shows
    before = decode_pool.view(torch.uint8).clone()
    p_regions = [dataclasses.replace(r, scale=1.0) for r in p_regions]
    plan = g.build_plan(layout(p_regions, aux=AUX, kv_dtype=str(src).removeprefix("torch.")),
                        layout(d_regions, aux=AUX, kv_dtype="float8_e4m3fn"))
    prefill_ids, decode_ids = [7, 1, 4, 2, 9], [0, 5, 3, 8, 6]
    for grp in plan.groups:
        for seg in room_stream(grp, prefill_ids[first_page:], decode_ids[first_page:], converted=True):
            slot = torch.empty(seg.num_runs * seg.run_nbytes, dtype=torch.uint8)
            pp = copy_plan(seg.prefill_addrs, seg.prefill_nbytes, prefill_pool.data_ptr(), slot.data_ptr(),
                           prefill_pool.numel() * prefill_pool.element_size())
            gather_convert(prefill_pool, slot, pp, row_index(pp, "cpu"), src_dtype=src,
                           inv_scales=inverse_scales(seg.scales, "cpu"))
            dp = copy_plan(seg.decode_addrs, seg.run_nbytes, decode_pool.data_ptr(), slot.data_ptr(),
                           decode_pool.numel())
            scatter(slot, decode_pool, dp, row_index(dp, "cpu"))
    d_scale = {r.key: r.scale for r in d_regions}
    for j, (pp_id, dp_id) in enumerate(zip(prefill_ids, decode_ids)):
        for layer in range(LAYERS):
            for i, kind in enumerate("kv"):
                got = _page(decode_pool, d_major, layer, i, dp_id).view(torch.uint8)
                if j < first_page:  # the decode's prefix hit: never written
                    assert torch.equal(got, _page(before.view(decode_pool.shape), d_major, layer, i, dp_id))
                    continue
                # exactly what the decode's own K/V store (kv_quant.quantize) writes for these values
                want = quantize(_page(prefill_pool, p_major, layer, i, pp_id), d_scale[("target", layer, kind)],
                                torch.float8_e4m3fn)
                assert torch.equal(got, want.view(torch.uint8)), (j, layer, kind)
    untouched = np.setdiff1d(np.arange(PAGES), decode_ids[first_page:])
    for p in untouched.tolist():  # no byte outside the room's pages changed
        for layer in range(LAYERS):
            for i in range(2):
                assert torch.equal(_page(decode_pool, d_major, layer, i, p).view(torch.uint8),
                                   _page(before.view(decode_pool.shape), d_major, layer, i, p))


def test_to_e4m3_saturates_instead_of_giving_nan():
    x = torch.tensor([1e6, -1e6, 448.0, 0.5, -0.0])
    out = to_e4m3(x, 0.5).float()
    assert out.tolist() == [448.0, -448.0, 224.0, 0.25, -0.0]
    assert not torch.isnan(out).any()
