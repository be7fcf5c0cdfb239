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
memory but not in the list never merge. So each side's prepared list (``kvferry.common.plan.desc_lists``)
holds its pages in address order (``ListOrder``), aux slots last::

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

import numpy as np

from kvferry.common.errors import GeometryMismatchError
from kvferry.common.wire.messages import AuxInfo, Region, RegionKey, Transfer
# One side's table and its checks (kvferry.common.plan.layout) and the prepared lists (kvferry.common.plan.desc_lists),
# imported from their own modules by whoever needs them: nothing is re-exported from here.
from kvferry.common.plan.layout import Desc, KvLayout, check_layout, check_same_forms, format_key, format_keys
from kvferry.common.plan.desc_lists import DescGroup
from kvferry.common.plan.convert import Conversion, check_scale, conversion


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
    # the decode's pool holds another dtype: every room is converted while staged (common/plan/convert.py)
    conversion: Conversion | None = None
    # derived once here, read per room by request_indices
    num_decode_pages: int = field(init=False)  # pages every written decode region holds: ids lie below
    num_prefill_pages: int = field(init=False)

    @property
    def aux_nbytes(self) -> int:
        """Bytes of aux record written per room: the smaller of the two sides' slots, so either side may
        be the older one (common/wire/aux_record.py says which record fits)."""
        return self.groups[-1].aux_nbytes

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
        check_same_forms(prefill, decode)
        convert = _check_compatible(prefill, decode)
        pairs, ignored = _match_regions(prefill, decode, convert)
        groups = _group(pairs, prefill.aux, decode.aux)
        if convert is not None:
            _check_converted_runs(groups)
    except GeometryMismatchError as exc:
        raise GeometryMismatchError(f"{exc} (decode peer {peer})" if peer else str(exc)) from None
    return TransferPlan(prefill=prefill, decode=decode, groups=groups,
                        written=tuple(p.key for p, _ in pairs), ignored=ignored,
                        decode_only_spec_dec=bool(ignored), conversion=convert)


def _check_compatible(prefill: KvLayout, decode: KvLayout) -> Conversion | None:
    """Equal model, page size and TP size; the KV dtypes equal or a pair converted in transit
    (returned; ``common/plan/convert.py`` refuses any other pair naming both)."""
    for name, label, fix in (
            ("model", "model fingerprint", "serve the same checkpoint on both sides"),
            ("page_size", "page_size", "start both sides with the same --page-size"),
            ("tp_size", "tp_size", "heterogeneous TP is not supported yet: use the same TP size")):
        p, d = getattr(prefill, name), getattr(decode, name)
        if p != d:
            raise GeometryMismatchError(f"{label} mismatch: prefill has {p!r}, decode has {d!r}; {fix}")
    return conversion(prefill.kv_dtype, decode.kv_dtype)


def _match_regions(prefill: KvLayout, decode: KvLayout, convert: Conversion | None = None
                   ) -> tuple[list[tuple[Region, Region]], tuple[RegionKey, ...]]:
    """Pair regions by key (rules 2–5); return pairs in prefill order and ignored decode keys.
    Converted, a pair holds the same elements: the prefill's ``item_len`` is ``ratio`` times the
    decode's, and the decode's scale is usable."""
    by_key = {d.key: d for d in decode.regions}
    prefill_keys = {p.key for p in prefill.regions}
    missing = [p.key for p in prefill.regions if p.key not in by_key]
    if missing:
        lead = ("decode registered fewer KV regions than prefill" if len(decode.regions) < len(prefill.regions)
                else "decode KV regions do not cover the prefill's")
        raise GeometryMismatchError(f"{lead}: missing {format_keys(missing)}; serve the same model "
                                    f"(and the same draft model, if the prefill runs one) on both sides")
    extra = [d.key for d in decode.regions if d.key not in prefill_keys]
    extra_target = [k for k in extra if k[0] != "draft"]
    if extra_target:
        raise GeometryMismatchError(f"decode registered target regions the prefill does not have: "
                                    f"{format_keys(extra_target)}; serve the same target model on both sides")
    if extra and any(k[0] == "draft" for k in prefill_keys):
        # Half the draft's KV written and half computed locally is never what was meant.
        raise GeometryMismatchError(f"decode registered draft regions the prefill does not have: "
                                    f"{format_keys(extra)}, while the prefill runs a draft model too; "
                                    f"use the same --draft-model on both sides, or none on the prefill")
    pairs = [(p, by_key[p.key]) for p in prefill.regions]
    ratio = convert.ratio if convert is not None else 1
    for p, d in pairs:
        if convert is not None:
            check_scale(d.scale, f"decode region {format_key(d.key)}")
            if p.item_len != ratio * d.item_len:
                raise GeometryMismatchError(
                    f"region {format_key(p.key)}: item_len mismatch: prefill has {p.item_len} bytes of "
                    f"{convert.src}, decode has {d.item_len} bytes of {convert.dst} (expected {p.item_len // ratio}); "
                    f"same model, --page-size and TP layout are needed on both sides")
        for name in ("head_start", "num_heads") if convert is not None else ("item_len", "head_start", "num_heads"):
            pv, dv = getattr(p, name), getattr(d, name)
            if pv != dv:
                raise GeometryMismatchError(
                    f"region {format_key(p.key)}: {name} mismatch: prefill has {pv}, decode has {dv}; "
                    f"same model, --dtype, --page-size and TP layout are needed on both sides")
    return pairs, tuple(extra)


def _check_converted_runs(groups: Sequence[DescGroup]) -> None:
    """A converted run's members hold equal items on each side (the convert of a run reshapes it
    into [items, elements]); the pools' regions of one model always do."""
    mems = {g.decode_mem for g in groups if g.pairs}
    if len(mems) > 1:
        raise GeometryMismatchError(f"the decode's KV regions lie in {sorted(mems)}; a converted room is written "
                                    f"from one staging buffer into one memory kind")
    for g in groups:
        for p, d in g.runs:
            for run in (p, d):
                if len({n for n, _ in run.members}) > 1:
                    raise GeometryMismatchError(
                        f"regions of unequal page sizes ({sorted({n for n, _ in run.members})} bytes) share a page "
                        f"block at {run.addr:#x}; a converted room needs equal ones")


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
                            aux_nbytes=min(prefill_aux.item_len, decode_aux.item_len)))
    return tuple(groups)


def validate_transfer(plan: TransferPlan, transfer: Transfer, *, prefill_num_prompt_tokens: int) -> None:
    """Rule 6: raise unless ``transfer`` fits ``plan`` and matches the prefill's own prompt.

    Checks, in order: the prompt lengths agree; ``len(page_ids) == ceil(n / page_size)``; every id
    lies in ``[0, plan.num_decode_pages)`` and appears once; ``0 <= aux_slot < num_slots``.
    """
    check_transfer_counts(transfer, prefill_num_prompt_tokens, page_size=plan.page_size,
                          num_aux_slots=plan.decode.aux.num_slots)
    _check_page_ids(transfer.page_ids, plan.num_decode_pages, f"room {transfer.room} from decode {transfer.decode_id}: "
                                                              f"decode")


def check_transfer_counts(transfer: Transfer, prefill_num_prompt_tokens: int, *, page_size: int,
                          num_aux_slots: int) -> None:
    """The counts of a transfer request, whatever the plan: the prompt lengths agree and are > 0,
    ``len(page_ids) == ceil(n / page_size)`` at the decode's page size, the aux slot exists."""
    where = f"room {transfer.room} from decode {transfer.decode_id}"
    n = transfer.num_prompt_tokens
    if n != prefill_num_prompt_tokens:
        raise GeometryMismatchError(
            f"{where}: num_prompt_tokens mismatch: decode counted {n}, prefill counted "
            f"{prefill_num_prompt_tokens}; tokenizer mismatch likely: serve the same tokenizer on both sides")
    if n <= 0:
        raise GeometryMismatchError(f"{where}: num_prompt_tokens must be > 0, got {n}")
    expected = math.ceil(n / page_size)
    if len(transfer.page_ids) != expected:
        raise GeometryMismatchError(
            f"{where}: {len(transfer.page_ids)} page ids for {n} prompt tokens at page_size "
            f"{page_size}; expected {expected}")
    if not 0 <= transfer.aux_slot < num_aux_slots:
        raise GeometryMismatchError(f"{where}: aux_slot {transfer.aux_slot} outside [0, {num_aux_slots})")
    check_prefix_len(transfer, page_size)


def check_prefix_len(transfer: Transfer, decode_page_size: int) -> None:
    """``decode_prefix_len`` (the prompt tokens the decode holds, not written) lies in ``[0, n]`` and
    is a multiple of the decode's page size: the first page written is one the room owns alone, never
    a cached (shared, read-only) page."""
    p, n = transfer.decode_prefix_len, transfer.num_prompt_tokens
    if not 0 <= p <= n or p % decode_page_size:
        raise GeometryMismatchError(
            f"room {transfer.room} from decode {transfer.decode_id}: decode_prefix_len {p} must be a multiple of "
            f"the decode's page_size {decode_page_size} in [0, num_prompt_tokens={n}]")


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
                    prefill_aux_slot: int, decode_aux_slot: int, first_page: int = 0) -> RequestXfer:
    """Index lists for one room: token page j of pair i maps prefill page ``prefill_page_ids[j]`` of
    the pair's prefill region to decode page ``decode_page_ids[j]`` of its decode region (list
    entries from ``ListOrder.grid``); the aux group also maps one aux slot to one, last.

    Entries come in prefill address order (see the module docstring), so that NIXL merges every run
    that is adjacent on both sides. Invariant: the decode byte ranges selected are pairwise disjoint
    and lie inside their regions; the (prefill, decode) pairs do not depend on the order.

    Prefix reuse (equal page sizes on both sides, as this plan has): token pages below ``first_page``
    are held by the decode already (``decode_prefix_len / page_size``) and are not written; a room
    whose every page is held writes its aux record alone.
    """
    if len(prefill_page_ids) != len(decode_page_ids):
        raise GeometryMismatchError(f"{len(prefill_page_ids)} prefill pages but {len(decode_page_ids)} "
                                    f"decode pages for one room")
    if not 0 <= first_page <= len(decode_page_ids):
        raise GeometryMismatchError(f"first page {first_page} outside the room's {len(decode_page_ids)} pages")
    prefill_ids = _page_array(prefill_page_ids, plan.num_prefill_pages, "prefill")[first_page:]
    decode_ids = _page_array(decode_page_ids, plan.num_decode_pages, "decode")[first_page:]
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
        if merged_p and is_adjacent(merged_p[-1], p) and is_adjacent(merged_d[-1], d):
            merged_p[-1] = (merged_p[-1][0], merged_p[-1][1] + p[1], p[2])
            merged_d[-1] = (merged_d[-1][0], merged_d[-1][1] + d[1], d[2])
        else:
            merged_p.append(tuple(p))
            merged_d.append(tuple(d))
    return merged_p, merged_d


def count_merged_descs(prefill_descs: Sequence[Desc], decode_descs: Sequence[Desc]) -> int:
    """How many descriptors remain once entries adjacent on both sides merge (see ``merge_runs``)."""
    return len(merge_runs(prefill_descs, decode_descs)[0])


def is_adjacent(prev: Desc, cur: Desc) -> bool:
    return prev[2] == cur[2] and prev[0] + prev[1] == cur[0]
