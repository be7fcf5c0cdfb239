"""KV geometry and the transfer plan (DESIGN §4): pure functions, values in, values out.

The prefill builds one ``TransferPlan`` per registered decode from the two region tables, then turns
each room into index lists into the plan's prepared descriptor lists. Nothing here touches NIXL,
ZeroMQ, a device, a clock or a logger; every check raises ``GeometryMismatchError`` naming the field
and both values.

Page p of a region lies at ``addr + p * page_stride``: back to back in a layer-major pool
(stride = item_len), one block per page holding every region in a page-major pool::

    layer-major  [L0k p0 p1 p2 ...][L0v p0 p1 p2 ...][L1k ...]     a region is contiguous
    page-major   [p0: L0k L0v L1k ...][p1: L0k L0v L1k ...] ...     a page is contiguous

NIXL (1.5.1, measured) merges two successive entries of a request only when their list indices are
consecutive (i, i + 1) on both sides and their bytes touch on both sides; entries that touch in
memory but not in the list never merge. So each side's prepared list holds its pages in address
order (``ListOrder``), aux slots last::

    index:  0 .. size-1                                      size .. size+num_slots-1
            every page of the group's regions, by address    aux slots (only in the aux group)

and ``request_indices`` orders each room's entries by prefill address. Then every pair of entries
that touch on both sides sits side by side in the lists: the most merging any order can give. Two
page-major sides make a room of n scattered pages n descriptors (plus aux), two layer-major sides
one per region per run of consecutive pages, a mixed pair one per page per region.

An entry is one page of a *run* (``fuse_pairs``): regions whose pages follow one another inside a
page block on both sides count as one, so two page-major pools list one entry per page, and
NIXL's per-request work is per page, not per page and region.

Matching is by key ``(model, layer, kind)``, never by position: the decode's table may list draft
regions first, last or interleaved, and the written byte ranges do not change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from common.errors import GeometryMismatchError
from common.wire import AuxInfo, Region, RegionKey, Transfer
# One side's table and checks live in common.layout; they are part of this module's API too.
from common.layout import ADDR_LIMIT, Desc, KvLayout, _format_keys, check_layout, format_key  # noqa: F401


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

    @classmethod
    def of(cls, r: Region) -> Run:
        return cls(r.mem, r.device, r.addr, r.item_len, r.num_pages, r.page_stride)

    def extended_by(self, r: Region) -> Run | None:
        """This run with ``r`` appended, if ``r``'s pages start where this run's end, page for page."""
        if (r.mem, r.device, r.num_pages, r.page_stride) != (self.mem, self.device, self.num_pages, self.page_stride):
            return None
        if r.addr != self.addr + self.item_len or self.item_len + r.item_len > self.page_stride:
            return None
        return Run(self.mem, self.device, self.addr, self.item_len + r.item_len, self.num_pages, self.page_stride)


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
    aux_nbytes: int = 0  # bytes written into the decode's aux slot (the prefill's slot size)
    runs: tuple[tuple[Run, Run], ...] = field(init=False)  # the pairs fused (``fuse_pairs``)
    page_nbytes: int = field(init=False)  # bytes of one token page over every pair
    prefill_order: ListOrder = field(init=False)
    decode_order: ListOrder = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "runs", fuse_pairs(self.pairs))
        object.__setattr__(self, "page_nbytes", sum(p.item_len for p, _ in self.pairs))
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


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """How the prefill writes into one decode: built once per registered peer by ``build_plan``.

    ``groups[-1]`` holds the aux slot; its WRITE carries the notification and is posted only after
    every other group's WRITE is DONE, so the notification means "all of the room has landed".
    ``written`` lists the prefill's keys in its table order; ``ignored`` the decode-only draft keys.
    """

    prefill: KvLayout
    decode: KvLayout
    groups: tuple[DescGroup, ...]
    written: tuple[RegionKey, ...]
    ignored: tuple[RegionKey, ...]
    decode_only_spec_dec: bool
    # derived once here, read per room by request_indices
    num_decode_pages: int = field(init=False)  # pages every written decode region holds: ids lie below
    num_prefill_pages: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_decode_pages", min(d.num_pages for g in self.groups for _, d in g.pairs))
        object.__setattr__(self, "num_prefill_pages", min(r.num_pages for r in self.prefill.regions))

    @property
    def page_size(self) -> int:
        return self.prefill.page_size


def build_plan(prefill: KvLayout, decode: KvLayout, *, peer: str = "") -> TransferPlan:
    """Validate both layouts against each other (DESIGN §4 rules 1–5) and group the written regions.

    ``peer`` (the decode's id or agent name) is added to every message. Raises
    ``GeometryMismatchError``. The result depends on the decode's regions by key only.
    """
    try:
        check_layout(prefill, "prefill")
        check_layout(decode, "decode")
        _check_compatible(prefill, decode)
        pairs, ignored = _match_regions(prefill, decode)
    except GeometryMismatchError as exc:
        raise GeometryMismatchError(f"{exc} (decode peer {peer})" if peer else str(exc)) from None
    return TransferPlan(prefill=prefill, decode=decode, groups=_group(pairs, prefill.aux, decode.aux),
                        written=tuple(p.key for p, _ in pairs), ignored=ignored,
                        decode_only_spec_dec=bool(ignored))


def _check_compatible(prefill: KvLayout, decode: KvLayout) -> None:
    for name, label, fix in (
            ("model", "model fingerprint", "serve the same checkpoint on both sides"),
            ("page_size", "page_size", "start both sides with the same --page-size"),
            ("kv_dtype", "kv_dtype", "start both sides with the same --dtype"),
            ("tp_size", "tp_size", "heterogeneous TP is not supported yet: use the same TP size")):
        p, d = getattr(prefill, name), getattr(decode, name)
        if p != d:
            raise GeometryMismatchError(f"{label} mismatch: prefill has {p!r}, decode has {d!r}; {fix}")
    if decode.aux.item_len < prefill.aux.item_len:
        raise GeometryMismatchError(
            f"aux item_len mismatch: prefill writes {prefill.aux.item_len}-byte aux records, decode "
            f"slots hold {decode.aux.item_len} bytes; upgrade the decode so both use the same record")


def _match_regions(prefill: KvLayout, decode: KvLayout
                   ) -> tuple[list[tuple[Region, Region]], tuple[RegionKey, ...]]:
    """Pair regions by key (rules 2–5); return pairs in prefill order and ignored decode keys."""
    by_key = {d.key: d for d in decode.regions}
    prefill_keys = {p.key for p in prefill.regions}
    missing = [p.key for p in prefill.regions if p.key not in by_key]
    if missing:
        lead = ("decode registered fewer KV regions than prefill" if len(decode.regions) < len(prefill.regions)
                else "decode KV regions do not cover the prefill's")
        raise GeometryMismatchError(f"{lead}: missing {_format_keys(missing)}; serve the same model "
                                    f"(and the same draft model, if the prefill runs one) on both sides")
    extra = [d.key for d in decode.regions if d.key not in prefill_keys]
    extra_target = [k for k in extra if k[0] != "draft"]
    if extra_target:
        raise GeometryMismatchError(f"decode registered target regions the prefill does not have: "
                                    f"{_format_keys(extra_target)}; serve the same target model on both sides")
    if extra and any(k[0] == "draft" for k in prefill_keys):
        # Half the draft's KV written and half computed locally is never what was meant.
        raise GeometryMismatchError(f"decode registered draft regions the prefill does not have: "
                                    f"{_format_keys(extra)}, while the prefill runs a draft model too; "
                                    f"use the same --draft-model on both sides, or none on the prefill")
    pairs = [(p, by_key[p.key]) for p in prefill.regions]
    for p, d in pairs:
        for name in ("item_len", "head_start", "num_heads"):
            pv, dv = getattr(p, name), getattr(d, name)
            if pv != dv:
                raise GeometryMismatchError(
                    f"region {format_key(p.key)}: {name} mismatch: prefill has {pv}, decode has {dv}; "
                    f"same model, --dtype, --page-size and TP layout are needed on both sides")
    return pairs, tuple(extra)


def _group(pairs: Sequence[tuple[Region, Region]], prefill_aux: AuxInfo, decode_aux: AuxInfo
           ) -> tuple[DescGroup, ...]:
    """One group per (prefill mem, decode mem) in first-seen order; the aux group goes last."""
    by_mem: dict[tuple[str, str], list[tuple[Region, Region]]] = {}
    for p, d in pairs:
        by_mem.setdefault((p.mem, d.mem), []).append((p, d))
    aux_mem = (prefill_aux.mem, decode_aux.mem)
    groups = [DescGroup(pm, dm, tuple(ps)) for (pm, dm), ps in by_mem.items() if (pm, dm) != aux_mem]
    groups.append(DescGroup(aux_mem[0], aux_mem[1], tuple(by_mem.get(aux_mem, ())),
                            prefill_aux=prefill_aux, decode_aux=decode_aux,
                            aux_nbytes=prefill_aux.item_len))
    return tuple(groups)


def validate_transfer(plan: TransferPlan, transfer: Transfer, *, prefill_num_prompt_tokens: int) -> None:
    """Rule 6: raise unless ``transfer`` fits ``plan`` and matches the prefill's own prompt.

    Checks, in order: the prompt lengths agree; ``len(page_ids) == ceil(n / page_size)``; every id
    lies in ``[0, plan.num_decode_pages)`` and appears once; ``0 <= aux_slot < num_slots``.
    """
    where = f"room {transfer.room} from decode {transfer.decode_id}"
    n = transfer.num_prompt_tokens
    if n != prefill_num_prompt_tokens:
        raise GeometryMismatchError(
            f"{where}: num_prompt_tokens mismatch: decode counted {n}, prefill counted "
            f"{prefill_num_prompt_tokens}; tokenizer mismatch likely: serve the same tokenizer on both sides")
    if n <= 0:
        raise GeometryMismatchError(f"{where}: num_prompt_tokens must be > 0, got {n}")
    expected = math.ceil(n / plan.page_size)
    if len(transfer.page_ids) != expected:
        raise GeometryMismatchError(
            f"{where}: {len(transfer.page_ids)} page ids for {n} prompt tokens at page_size "
            f"{plan.page_size}; expected {expected}")
    _check_page_ids(transfer.page_ids, plan.num_decode_pages, f"{where}: decode")
    num_slots = plan.decode.aux.num_slots
    if not 0 <= transfer.aux_slot < num_slots:
        raise GeometryMismatchError(f"{where}: aux_slot {transfer.aux_slot} outside [0, {num_slots})")


def _check_page_ids(page_ids: Sequence[int], num_pages: int, where: str) -> None:
    _page_array(page_ids, num_pages, where)


def _page_array(page_ids: Sequence[int], num_pages: int, where: str) -> np.ndarray:
    """``page_ids`` as int64, once checked: each in ``[0, num_pages)``, none twice."""
    try:
        ids = (page_ids.astype(np.int64, copy=False) if isinstance(page_ids, np.ndarray)
               else np.fromiter(page_ids, dtype=np.int64, count=len(page_ids)))
    except (OverflowError, TypeError, ValueError):
        raise GeometryMismatchError(f"{where} page ids must be a list of integers") from None
    if len(ids) == 0:
        return ids
    if ids.min() < 0 or ids.max() >= num_pages:
        pid = int(ids[(ids < 0) | (ids >= num_pages)][0])
        raise GeometryMismatchError(f"{where} page id {pid} outside the KV pool [0, {num_pages})")
    ordered = np.sort(ids)
    repeats = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(repeats):
        raise GeometryMismatchError(f"{where} page id {int(repeats[0])} appears more than once")
    return ids


@dataclass(frozen=True, slots=True, eq=False)
class RequestXfer:
    """One room's WRITEs: per group (same order as ``plan.groups``), the index lists into its prepared
    prefill and decode lists, as int64 arrays of equal length (``NixlEngine.post_write`` takes them
    as they are). ``num_bytes`` is everything written."""

    per_group: tuple[tuple[np.ndarray, np.ndarray], ...]
    num_bytes: int

    def with_prefill_aux_slot(self, plan: TransferPlan, slot: int) -> RequestXfer:
        """The same room reading its aux record from prefill slot ``slot`` (the last entry of the
        aux group, always). Lets the prefill build a room's lists before it holds a slot."""
        if not 0 <= slot < plan.prefill.aux.num_slots:
            raise GeometryMismatchError(f"prefill aux_slot {slot} outside [0, {plan.prefill.aux.num_slots})")
        local, remote = self.per_group[-1]
        local = local.copy()
        local[-1] = plan.groups[-1].prefill_order.size + slot
        return RequestXfer(per_group=self.per_group[:-1] + ((local, remote),), num_bytes=self.num_bytes)


def request_indices(plan: TransferPlan, *, prefill_page_ids: Sequence[int], decode_page_ids: Sequence[int],
                    prefill_aux_slot: int, decode_aux_slot: int) -> RequestXfer:
    """Index lists for one room: token page j of pair i maps prefill page ``prefill_page_ids[j]`` of
    the pair's prefill region to decode page ``decode_page_ids[j]`` of its decode region (list
    entries from ``ListOrder.grid``); the aux group also maps one aux slot to one, last.

    Entries come in prefill address order (see the module docstring), so that NIXL merges every run
    that is adjacent on both sides. Invariant: the decode byte ranges selected are pairwise disjoint
    and lie inside their regions; the (prefill, decode) pairs do not depend on the order.
    """
    if len(prefill_page_ids) != len(decode_page_ids):
        raise GeometryMismatchError(f"{len(prefill_page_ids)} prefill pages but {len(decode_page_ids)} "
                                    f"decode pages for one room")
    prefill_ids = _page_array(prefill_page_ids, plan.num_prefill_pages, "prefill")
    decode_ids = _page_array(decode_page_ids, plan.num_decode_pages, "decode")
    for side, slot, aux in (("prefill", prefill_aux_slot, plan.prefill.aux),
                            ("decode", decode_aux_slot, plan.decode.aux)):
        if not 0 <= slot < aux.num_slots:
            raise GeometryMismatchError(f"{side} aux_slot {slot} outside [0, {aux.num_slots})")
    per_group, num_bytes = [], 0
    for g in plan.groups:
        p_parts, d_parts = _by_prefill_address(g, prefill_ids, decode_ids)
        num_bytes += len(decode_ids) * g.page_nbytes
        if g.has_aux:
            p_parts.append(np.array([g.prefill_order.size + prefill_aux_slot]))
            d_parts.append(np.array([g.decode_order.size + decode_aux_slot]))
            num_bytes += g.aux_nbytes
        per_group.append(tuple(np.concatenate(parts).astype(np.int64, copy=False) if parts
                               else np.zeros(0, dtype=np.int64) for parts in (p_parts, d_parts)))
    return RequestXfer(per_group=tuple(per_group), num_bytes=num_bytes)


def _by_prefill_address(g: DescGroup, prefill_ids: np.ndarray, decode_ids: np.ndarray
                        ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Both sides' entries of one group's room, in the prefill list's order (its address order)."""
    blocks = g.prefill_order.blocks(prefill_ids)
    if blocks is None:  # an irregular prefill layout: sort every entry
        p_grid = g.prefill_order.grid(prefill_ids).ravel()
        order = np.argsort(p_grid, kind="stable")
        return [p_grid[order]], [g.decode_order.grid(decode_ids).ravel()[order]]
    p_parts = [g.prefill_order.entries(pairs, prefill_ids[pos], is_pages_outer=outer) for pairs, pos, outer in blocks]
    d_parts = [g.decode_order.entries(pairs, decode_ids[pos], is_pages_outer=outer) for pairs, pos, outer in blocks]
    return p_parts, d_parts


def merge_runs(prefill_descs: Sequence[Desc], decode_descs: Sequence[Desc]) -> tuple[list[Desc], list[Desc]]:
    """One WRITE's selected descriptors (index-list order, equal length) merged as NIXL's prepared
    lists merge them: an entry adjacent to the previous one on both sides (same device, starting
    where it ends) extends it. Returns the merged (prefill, decode) lists, of equal length.

    NIXL also needs the two entries at consecutive list indices on both sides; the plan's lists are
    in address order, where touching entries are consecutive, so the count here is NIXL's."""
    if len(prefill_descs) != len(decode_descs):
        raise ValueError(f"{len(prefill_descs)} prefill descriptors but {len(decode_descs)} decode ones")
    merged_p: list[Desc] = []
    merged_d: list[Desc] = []
    for p, d in zip(prefill_descs, decode_descs):
        if merged_p and _adjacent(merged_p[-1], p) and _adjacent(merged_d[-1], d):
            merged_p[-1] = (merged_p[-1][0], merged_p[-1][1] + p[1], p[2])
            merged_d[-1] = (merged_d[-1][0], merged_d[-1][1] + d[1], d[2])
        else:
            merged_p.append(tuple(p))
            merged_d.append(tuple(d))
    return merged_p, merged_d


def count_merged_descs(prefill_descs: Sequence[Desc], decode_descs: Sequence[Desc]) -> int:
    """How many descriptors remain once entries adjacent on both sides merge (see ``merge_runs``)."""
    return len(merge_runs(prefill_descs, decode_descs)[0])


def _adjacent(prev: Desc, cur: Desc) -> bool:
    return prev[2] == cur[2] and prev[0] + prev[1] == cur[0]
