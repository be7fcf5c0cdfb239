"""Shared cases for the geometry tests: region tables, layouts, rooms (Hypothesis), and the
checks that locate written bytes and count merged descriptors."""

from __future__ import annotations

import dataclasses
import math

from hypothesis import strategies as st

from kvferry.common.plan import geometry as g
from kvferry.common.plan.layout import KvLayout
from kvferry.common.wire.messages import AuxInfo, Region, Transfer


ITEM = 256
PAGES = 8
AUX = AuxInfo(mem="DRAM", device=0, addr=0x9000_0000, item_len=64, num_slots=4)


def table(model="target", layers=4, base=0x10_0000, mem="DRAM", item_len=ITEM, num_pages=PAGES):
    """K and V regions of ``layers`` layers, packed back to back from ``base`` (layer-major)."""
    size = item_len * num_pages
    return [Region(model=model, layer=layer, kind=kind, mem=mem, device=0, addr=base + (2 * layer + i) * size,
                   item_len=item_len, num_pages=num_pages, head_start=0, num_heads=2)
            for layer in range(layers) for i, kind in enumerate(("k", "v"))]


def page_major(model="target", layers=4, base=0x10_0000, mem="DRAM", item_len=ITEM, num_pages=PAGES):
    """The same regions in a page-major pool: page p of every region in one block of 2 * layers pages."""
    return [dataclasses.replace(r, addr=base + i * item_len, stride=2 * layers * item_len)
            for i, r in enumerate(table(model, layers, base, mem, item_len, num_pages))]


def layout(regions, aux=AUX, **kw) -> KvLayout:
    fields = dict(model="llama-3-8b/fp1", page_size=16, kv_dtype="bfloat16", tp_size=1, tp_rank=0)
    return KvLayout(regions=tuple(regions), aux=aux, **(fields | kw))


def plan_ranges(plan):
    """Everything a plan can write, as comparable data: per group, both memory kinds and both lists."""
    return [(x.prefill_mem, x.decode_mem, x.prefill_descs(), x.decode_descs()) for x in plan.groups]


def selected(plan, xfer):
    """One room's WRITEs as ((prefill mem, addr, nbytes, device), (decode mem, addr, nbytes, device)),
    an entry of a fused run cut back into its regions' pages (see ``pieces``)."""
    out = []
    for grp, (p_idx, d_idx) in zip(plan.groups, xfer.per_group):
        p_descs, d_descs = grp.prefill_descs(), grp.decode_descs()
        assert len(p_idx) == len(d_idx)
        for i, j in zip(p_idx, d_idx):
            p_parts = pieces(plan.prefill, grp.prefill_mem, *p_descs[i])
            d_parts = pieces(plan.decode, grp.decode_mem, *d_descs[j])
            assert [n for _, _, n, _ in p_parts] == [n for _, _, n, _ in d_parts]  # the same cut on both sides
            out += list(zip(p_parts, d_parts))
    return out


def pieces(layout_, mem, addr, nbytes, device):
    """Desc ``(addr, nbytes, device)`` cut into the region pages (or aux slot) it spans, in order;
    a range no region page starts at stays whole (the locate tests then fail on it)."""
    out = []
    while nbytes > 0:
        at = locate(layout_, mem, addr, 1, device)
        size = nbytes
        if at is not None and at[0] != "aux":
            size = min(nbytes, next(r.item_len for r in layout_.regions if r.key == at[0]))
        out.append((mem, addr, size, device))
        addr, nbytes = addr + size, nbytes - size
    return out


def room(plan, n_tokens, decode_ids=None, aux_slot=1):
    pages = math.ceil(n_tokens / plan.page_size)
    ids = list(range(pages)) if decode_ids is None else decode_ids
    return g.request_indices(plan, prefill_page_ids=list(range(pages)), decode_page_ids=ids,
                             prefill_aux_slot=0, decode_aux_slot=aux_slot)


def transfer(page_ids, n_tokens, aux_slot=0):
    return Transfer(room=42, decode_id="dec-1", page_ids=page_ids, aux_slot=aux_slot, num_prompt_tokens=n_tokens)


def _side(draw, keys, item_len, mems, side, cursor):
    """One side's regions from ``cursor`` on: each model's regions either page-major (interleaved,
    one block per page, random gaps inside and after a block) or one after another with random
    strides; random devices, gaps and table order. Returns (regions, end of the last one)."""
    regions = []
    for model in draw(st.permutations(["target", "draft"])):
        model_keys = draw(st.permutations([k for k in keys if k[0] == model]))
        if not model_keys:
            continue
        make = lambda key, **kw: Region(model=key[0], layer=key[1], kind=key[2], mem=mems[side, model],
                                        item_len=item_len[key], head_start=0, num_heads=1, **kw)
        if draw(st.booleans()):  # page-major
            device, num_pages, offsets, block = draw(st.integers(0, 1)), draw(st.integers(1, 6)), [], 0
            for key in model_keys:
                block += draw(st.sampled_from([0, 0, 8]))
                offsets.append(block)
                block += item_len[key]
            stride = block + draw(st.sampled_from([0, 0, 16]))
            short = draw(st.sampled_from([None] * 4 + list(model_keys))) if num_pages > 1 else None
            regions += [make(key, device=device, addr=cursor + off, num_pages=num_pages - (key == short),
                             stride=stride) for key, off in zip(model_keys, offsets)]
            cursor += (num_pages - 1) * stride + block
        else:
            for key in model_keys:
                num_pages, stride = draw(st.integers(1, 6)), item_len[key] + draw(st.sampled_from([0, 0, 8, 64]))
                wire_stride = draw(st.sampled_from([0, stride])) if stride == item_len[key] else stride
                regions.append(make(key, device=draw(st.integers(0, 1)), addr=cursor, num_pages=num_pages,
                                    stride=wire_stride))
                cursor += (num_pages - 1) * stride + item_len[key] + draw(st.sampled_from([0, 0, 8]))
        cursor += draw(st.sampled_from([0, 0, 8, 4096]))
    return draw(st.permutations(regions)), cursor


@st.composite
def layout_pairs(draw):
    """A compatible (prefill, decode) pair: random page counts, memory kinds, devices, gaps, strides,
    layouts (page-major, layer-major, mixed) and order. Half the time the decode mirrors the
    prefill's layout at another address, the case where descriptors merge across regions."""
    num_layers = draw(st.integers(1, 3))
    prefill_draft = draw(st.integers(0, 2))
    decode_only_draft = 0 if prefill_draft else draw(st.integers(0, 2))
    keys = [(m, layer, kind) for m, n in (("target", num_layers), ("draft", prefill_draft))
            for layer in range(n) for kind in ("k", "v")]
    extra = [("draft", layer, kind) for layer in range(decode_only_draft) for kind in ("k", "v")]
    item_len = {k: draw(st.sampled_from([8, 16, 24, 64])) for k in keys + extra}
    mems = {(side, m): draw(st.sampled_from(["DRAM", "VRAM"])) for side in "pd" for m in ("target", "draft")}
    aux_len = draw(st.integers(32, 48))
    prefill, cursor = _side(draw, keys, item_len, mems, "p", draw(st.integers(0, 1 << 40)))
    if draw(st.booleans()):
        shift = draw(st.integers(0, 1 << 40))
        mirrored = [dataclasses.replace(r, addr=r.addr + shift) for r in prefill]
        more, d_cursor = _side(draw, extra, item_len, mems, "d", cursor + shift)
        decode = draw(st.permutations(mirrored + more))
    else:
        decode, d_cursor = _side(draw, keys + extra, item_len, mems, "d", draw(st.integers(0, 1 << 40)))
    sides = []
    for regions, end, extra_len in ((prefill, cursor, 0), (decode, d_cursor, draw(st.integers(0, 16)))):
        aux = AuxInfo(mem=draw(st.sampled_from(["DRAM", "VRAM"])), device=0, addr=end, item_len=aux_len + extra_len,
                      num_slots=draw(st.integers(1, 3)))
        sides.append(layout(regions, aux=aux))
    page_size = draw(st.integers(1, 4))
    return dataclasses.replace(sides[0], page_size=page_size), dataclasses.replace(sides[1], page_size=page_size)


@dataclasses.dataclass(frozen=True)
class Room:
    plan: g.TransferPlan
    xfer: g.RequestXfer
    prefill_ids: list[int]
    decode_ids: list[int]
    prefill_aux_slot: int
    decode_aux_slot: int
    n_tokens: int


@st.composite
def rooms(draw):
    prefill, decode = draw(layout_pairs())
    plan = g.build_plan(prefill, decode)
    num_pages = draw(st.integers(0, min(plan.num_prefill_pages, plan.num_decode_pages)))
    n_tokens = num_pages * plan.page_size - draw(st.integers(0, plan.page_size - 1)) if num_pages else 0
    prefill_ids = draw(st.permutations(range(plan.num_prefill_pages)))[:num_pages]
    decode_ids = draw(st.permutations(range(plan.num_decode_pages)))[:num_pages]
    slots = draw(st.integers(0, prefill.aux.num_slots - 1)), draw(st.integers(0, decode.aux.num_slots - 1))
    xfer = g.request_indices(plan, prefill_page_ids=prefill_ids, decode_page_ids=decode_ids,
                             prefill_aux_slot=slots[0], decode_aux_slot=slots[1])
    return Room(plan, xfer, prefill_ids, decode_ids, *slots, n_tokens)


def locate(layout_: KvLayout, mem, addr, nbytes, device):
    """(region key or "aux", page or slot index) of the byte range, or None if no single page holds it."""
    a = layout_.aux
    spans = [(r.key, r.mem, r.device, r.addr, r.item_len, r.page_stride, r.num_pages) for r in layout_.regions]
    spans.append(("aux", a.mem, a.device, a.addr, a.item_len, a.item_len, a.num_slots))
    for key, m, dev, start, item_len, stride, count in spans:
        index, offset = divmod(addr - start, stride)
        if (m, dev) == (mem, device) and 0 <= index < count and offset == 0 and nbytes <= item_len:
            return key, index
    return None


def nixl_merged(plan, xfer) -> int:
    """Descriptors left by NIXL 1.5.1's rule (measured): successive entries merge when their list
    indices are consecutive on both sides and their bytes touch on both sides."""
    total = 0
    for grp, (p_idx, d_idx) in zip(plan.groups, xfer.per_group):
        p_descs, d_descs = grp.prefill_descs(), grp.decode_descs()
        for k in range(len(p_idx)):
            joins = k > 0 and p_idx[k] == p_idx[k - 1] + 1 and d_idx[k] == d_idx[k - 1] + 1 and all(
                g.is_adjacent(descs[idx[k - 1]], descs[idx[k]]) for descs, idx in ((p_descs, p_idx), (d_descs, d_idx)))
            total += not joins
    return total


def merged_descs(plan, xfer) -> int:
    """Descriptors left once kvferry's own ``count_merged_descs`` merges each group's selection."""
    return sum(g.count_merged_descs([grp.prefill_descs()[i] for i in p_idx], [grp.decode_descs()[i] for i in d_idx])
               for grp, (p_idx, d_idx) in zip(plan.groups, xfer.per_group))
