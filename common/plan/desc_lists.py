"""One decode peer's prepared descriptor lists (DESIGN §4): which entry holds which page.

Pure, like ``kvferry.common.plan.geometry``, which builds these inside a ``TransferPlan``.
NIXL (1.5.1, measured) merges two successive entries of a request only when their list indices are
consecutive on both sides and their bytes touch on both sides, so each side's list holds its pages
in address order (``ListOrder``), aux slots last. An entry is one page of a *run* (``fuse_pairs``):
regions whose pages follow one another inside a page block on both sides count as one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from kvferry.common.plan.layout import Desc
from kvferry.common.wire.messages import AuxInfo, Region


@dataclass(frozen=True, slots=True)
class ListOrder:
    """Where page p of run i (``DescGroup.runs``; often a lone region) sits in one side's prepared
    list of one group.

    The list holds every page of the group's regions in (device, address) order, because NIXL
    merges two entries of a request only when their list indices are consecutive (i, i + 1) on both
    sides *and* their bytes touch: in address order, touching pages are consecutive entries.

    The regions fall into clusters: a lone region, or regions interleaved as blocks (a page-major
    pool: equal stride and page count, page p of every member inside one stride). Page p of pair i
    is then entry ``first[i] + p * step[i]``, and ``clusters`` names each cluster's pairs by address,
    clusters in list order. Any other interleaving uses ``table`` (pair-major position → entry) and
    has no clusters.
    """

    first: tuple[int, ...]
    step: tuple[int, ...]
    clusters: tuple[tuple[int, ...], ...]
    size: int  # entries of pages; aux slots, if any, follow
    table: np.ndarray | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, regions: Sequence[Region | Run]) -> ListOrder:
        clusters: list[list[int]] = []
        end = 0
        for i in sorted(range(len(regions)), key=lambda i: (regions[i].device, regions[i].addr)):
            r = regions[i]
            r_end = r.addr + (r.num_pages - 1) * r.page_stride + r.item_len
            if clusters and regions[clusters[-1][0]].device == r.device and r.addr < end:
                clusters[-1].append(i)  # interleaves with the cluster so far
                end = max(end, r_end)
            else:
                clusters.append([i])
                end = r_end
        first, step, base = [0] * len(regions), [1] * len(regions), 0
        for members in clusters:
            if len(members) > 1 and not _is_block([regions[i] for i in members]):
                return cls._by_table(regions)
            for rank, i in enumerate(members):
                first[i], step[i] = base + rank, len(members)
            base += len(members) * regions[members[0]].num_pages
        return cls(tuple(first), tuple(step), tuple(map(tuple, clusters)), base)

    @classmethod
    def _by_table(cls, regions: Sequence[Region | Run]) -> ListOrder:
        counts = [r.num_pages for r in regions]
        addrs = np.concatenate([np.uint64(r.addr) + np.arange(r.num_pages, dtype=np.uint64) * np.uint64(r.page_stride)
                                for r in regions])
        order = np.lexsort((addrs, np.repeat([r.device for r in regions], counts)))
        table = np.empty(len(order), dtype=np.int64)
        table[order] = np.arange(len(order))
        table.flags.writeable = False
        offsets = tuple(accumulate(counts, initial=0))
        return cls(offsets[:-1], (1,) * len(regions), (), offsets[-1], table)

    def grid(self, page_ids: np.ndarray) -> np.ndarray:
        """[pairs, len(page_ids)] entries: row i holds pages ``page_ids`` of pair i."""
        flat = self.entries(np.arange(len(self.first)), page_ids, is_pages_outer=False)
        return flat.reshape(len(self.first), len(page_ids))

    def entries(self, pairs: np.ndarray, page_ids: np.ndarray, *, is_pages_outer: bool) -> np.ndarray:
        """Entries of pages ``page_ids`` of ``pairs``, flattened pages outer (all pairs of page 0, then
        of page 1, ...) or pairs outer."""
        first = np.asarray(self.first, dtype=np.int64)[pairs]
        step = np.asarray(self.step, dtype=np.int64)[pairs]
        if is_pages_outer:
            raw = (first[None, :] + page_ids[:, None] * step[None, :]).ravel()
        else:
            raw = (first[:, None] + page_ids[None, :] * step[:, None]).ravel()
        return raw if self.table is None else self.table[raw]

    def blocks(self, page_ids: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, bool]] | None:
        """The entries of ``page_ids`` of every pair in ascending order, as (pairs, positions in
        ``page_ids``, is_pages_outer) blocks for ``entries``; None when only sorting every entry
        can tell (``table``). Per cluster, pages ascend; a block's regions come inner."""
        if self.table is not None:
            return None
        by_page = np.argsort(page_ids, kind="stable")
        out, lone = [], []
        for members in self.clusters:
            if len(members) == 1:  # runs of lone regions: one block, regions outer
                lone.append(members[0])
                continue
            if lone:
                out.append((np.asarray(lone), by_page, False))
                lone = []
            out.append((np.asarray(members), by_page, True))
        if lone:
            out.append((np.asarray(lone), by_page, False))
        return out


def _is_block(regions: Sequence[Region | Run]) -> bool:
    """Interleaved regions, by address, that form one block per page (the page-major pool)."""
    stride, count = regions[0].page_stride, regions[0].num_pages
    return (all(r.page_stride == stride and r.num_pages == count for r in regions)
            and max(r.addr + r.item_len for r in regions) - regions[0].addr <= stride)


@dataclass(frozen=True, slots=True)
class Run:
    """Regions whose pages sit back to back inside one page block, as one: page p of the run is
    ``[addr + p * page_stride, + item_len)`` and holds page p of each member region in turn. A
    lone region is a run of one."""

    mem: str
    device: int
    addr: int
    item_len: int
    num_pages: int
    page_stride: int
    members: tuple[tuple[int, float], ...] = ()  # (item_len, scale) of each member region, in page order

    @classmethod
    def of(cls, r: Region) -> Run:
        return cls(r.mem, r.device, r.addr, r.item_len, r.num_pages, r.page_stride, ((r.item_len, r.scale),))

    def extended_by(self, r: Region) -> Run | None:
        """This run with ``r`` appended, if ``r``'s pages start where this run's end, page for page."""
        if (r.mem, r.device, r.num_pages, r.page_stride) != (self.mem, self.device, self.num_pages, self.page_stride):
            return None
        if r.addr != self.addr + self.item_len or self.item_len + r.item_len > self.page_stride:
            return None
        return Run(self.mem, self.device, self.addr, self.item_len + r.item_len, self.num_pages, self.page_stride,
                   self.members + ((r.item_len, r.scale),))


def fuse_pairs(pairs: Sequence[tuple[Region, Region]]) -> tuple[tuple[Run, Run], ...]:
    """Matched pairs as the fewest (prefill run, decode run) pairs: in prefill address order, a pair
    joins the previous run when its regions follow that run's on *both* sides, page for page.

    Two page-major pools with the same region order make one run per pool, so a prepared list holds
    one entry per page instead of one per page per region (65 instead of 4,097 entries for a
    1,024-token Llama-3-8B room): ``make_prepped_xfer`` then walks 64x fewer entries. Layer-major
    pools (a region's pages back to back) never fuse. The bytes a room selects are the same either
    way: a run's page p is exactly its members' page p, concatenated on both sides alike.
    """
    out: list[tuple[Run, Run]] = []
    for p, d in sorted(pairs, key=lambda pd: (pd[0].device, pd[0].addr)):
        if out:
            rp, rd = out[-1][0].extended_by(p), out[-1][1].extended_by(d)
            if rp is not None and rd is not None:
                out[-1] = (rp, rd)
                continue
        out.append((Run.of(p), Run.of(d)))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DescGroup:
    """One pair of prepared descriptor lists (prefill side, decode side) for one NIXL WRITE.

    Invariants: every prefill region of ``pairs`` has memory kind ``prefill_mem`` and every decode
    region ``decode_mem`` (a NIXL list holds one memory kind; devices are per descriptor); matched
    regions have equal ``item_len``; each list holds its side's pages in address order
    (``prefill_order``/``decode_order``); the aux slots, when present, come after all pages and are
    ``aux_nbytes`` long on both sides.
    """

    prefill_mem: str
    decode_mem: str
    pairs: tuple[tuple[Region, Region], ...]  # (prefill region, decode region), prefill table order
    prefill_aux: AuxInfo | None = None
    decode_aux: AuxInfo | None = None
    aux_nbytes: int = 0  # bytes written into the decode's aux slot (the smaller slot size of the two sides)
    runs: tuple[tuple[Run, Run], ...] = field(init=False)  # the pairs fused (``fuse_pairs``)
    page_nbytes: int = field(init=False)  # bytes of one token page over every pair, as the decode holds them
    prefill_order: ListOrder = field(init=False)
    decode_order: ListOrder = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "runs", fuse_pairs(self.pairs))
        object.__setattr__(self, "page_nbytes", sum(d.item_len for _, d in self.pairs))
        object.__setattr__(self, "prefill_order", ListOrder.of([p for p, _ in self.runs]))
        object.__setattr__(self, "decode_order", ListOrder.of([d for _, d in self.runs]))

    @property
    def has_aux(self) -> bool:
        return self.prefill_aux is not None

    def prefill_descs(self) -> list[Desc]:
        """Every page of every prefill run in address order, then every prefill aux slot. Page p
        of a run is ``(addr + p * page_stride, item_len, device)``."""
        return _descs([p for p, _ in self.runs], self.prefill_order, self.prefill_aux, self.aux_nbytes)

    def decode_descs(self) -> list[Desc]:
        """Every page of every decode run in address order, then every decode aux slot."""
        return _descs([d for _, d in self.runs], self.decode_order, self.decode_aux, self.aux_nbytes)


def _descs(regions: Sequence[Run], order: ListOrder, aux: AuxInfo | None, aux_nbytes: int) -> list[Desc]:
    out: list[Desc | None] = [None] * order.size
    for i, r in enumerate(regions):
        at = order.first[i] + np.arange(r.num_pages, dtype=np.int64) * order.step[i]
        for p, entry in enumerate((at if order.table is None else order.table[at]).tolist()):
            out[entry] = (r.addr + p * r.page_stride, r.item_len, r.device)
    if aux is not None:
        out.extend((aux.addr + s * aux.item_len, aux_nbytes, aux.device) for s in range(aux.num_slots))
    return out
