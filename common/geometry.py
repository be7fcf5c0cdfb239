"""KV geometry and the transfer plan (DESIGN §4): pure functions, values in, values out.

The prefill builds one ``TransferPlan`` per registered decode from the two region tables, then turns
each room into index lists into the plan's prepared descriptor lists. Nothing here touches NIXL,
ZeroMQ, a device, a clock or a logger; every check raises ``GeometryMismatchError`` naming the field
and both values.

Descriptor lists of one ``DescGroup`` (the same shape on both sides, each with its own page counts)::

    index:  0 .. n0-1          n0 .. n0+n1-1        ...   A .. A+num_slots-1
            pages of pair 0    pages of pair 1      ...   aux slots (only in the aux group)

    token-page j of pair i  →  offset_i + page_ids[j]        aux  →  A + aux_slot

Regions are the outer loop and pages the inner one, so a room's consecutive pages sit next to each
other in the index lists, and NIXL merges descriptors adjacent on both sides into one.

Matching is by key ``(model, layer, kind)``, never by position: the decode's table may list draft
regions first, last or interleaved, and the written byte ranges do not change. Descriptor order
follows the prefill's table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from common.errors import GeometryMismatchError
from common.wire import (AUX_RECORD_BYTES, KV_KINDS, MEM_KINDS, MODEL_KINDS, AuxInfo, Region,
                         RegionKey, Register, Transfer)

ADDR_LIMIT = 1 << 64  # one past the last byte a 64-bit descriptor address can name
Desc = tuple[int, int, int]  # one NIXL descriptor: (addr, nbytes, device)
_MAX_KEYS_SHOWN = 8


def format_key(key: RegionKey) -> str:
    """``("target", 3, "v")`` → ``"target layer 3 v"``, the form used in every message."""
    return f"{key[0]} layer {key[1]} {key[2]}"


def _format_keys(keys: Sequence[RegionKey]) -> str:
    shown = ", ".join(format_key(k) for k in keys[:_MAX_KEYS_SHOWN])
    more = len(keys) - _MAX_KEYS_SHOWN
    return f"{shown} and {more} more" if more > 0 else shown


@dataclass(frozen=True, slots=True)
class KvLayout:
    """One side's KV geometry: the fields of ``Register`` that describe memory.

    ``model`` is the architecture fingerprint (not a region's target/draft tag). ``check_layout``
    states the invariants; ``build_plan`` enforces them on both sides.
    """

    model: str
    page_size: int  # tokens per page
    kv_dtype: str
    tp_size: int
    tp_rank: int
    regions: tuple[Region, ...]
    aux: AuxInfo

    @classmethod
    def from_register(cls, reg: Register) -> KvLayout:
        return cls(model=reg.model, page_size=reg.page_size, kv_dtype=reg.kv_dtype,
                   tp_size=reg.tp_size, tp_rank=reg.tp_rank, regions=tuple(reg.regions), aux=reg.aux)


_Rule = tuple[str, Callable[[Any], bool], str]  # (field, predicate, what the field must be)
_REGION_RULES: tuple[_Rule, ...] = (
    ("model", lambda r: r.model in MODEL_KINDS, f"one of {MODEL_KINDS}"),
    ("kind", lambda r: r.kind in KV_KINDS, f"one of {KV_KINDS}"),
    ("mem", lambda r: r.mem in MEM_KINDS, f"one of {MEM_KINDS}"),
    ("layer", lambda r: r.layer >= 0, ">= 0"),
    ("device", lambda r: r.device >= 0, ">= 0"),
    ("addr", lambda r: r.addr >= 0, ">= 0"),
    ("item_len", lambda r: r.item_len > 0, "> 0"),
    ("num_pages", lambda r: r.num_pages > 0, "> 0"),
    ("head_start", lambda r: r.head_start >= 0, ">= 0"),
    ("num_heads", lambda r: r.num_heads > 0, "> 0"),
)
_AUX_RULES: tuple[_Rule, ...] = (
    ("mem", lambda a: a.mem in MEM_KINDS, f"one of {MEM_KINDS}"),
    ("device", lambda a: a.device >= 0, ">= 0"),
    ("addr", lambda a: a.addr >= 0, ">= 0"),
    ("item_len", lambda a: a.item_len >= AUX_RECORD_BYTES, f">= {AUX_RECORD_BYTES} (one aux record)"),
    ("num_slots", lambda a: a.num_slots > 0, "> 0"),
)


def _apply_rules(obj: object, rules: tuple[_Rule, ...], where: str) -> None:
    for name, ok, expected in rules:
        if not ok(obj):
            raise GeometryMismatchError(f"{where}: {name} must be {expected}, got {getattr(obj, name)!r}")


def check_layout(layout: KvLayout, side: str) -> None:
    """Raise unless ``layout`` is sane on its own; ``side`` ("prefill"/"decode") names it in messages.

    Invariants: ``page_size > 0``; ``0 <= tp_rank < tp_size``; at least one region; every region has
    a known model/kind/mem, ``item_len > 0``, ``num_pages > 0`` and ends inside 64-bit space; no key
    appears twice; the aux area holds ``num_slots > 0`` slots of at least one aux record each; no two
    regions (or a region and the aux area) share a byte on one (mem, device).
    """
    if layout.page_size <= 0:
        raise GeometryMismatchError(f"{side}: page_size must be > 0, got {layout.page_size}")
    if not 0 <= layout.tp_rank < layout.tp_size:
        raise GeometryMismatchError(
            f"{side}: tp_rank must be in [0, tp_size={layout.tp_size}), got {layout.tp_rank}")
    if not layout.regions:
        raise GeometryMismatchError(f"{side}: registered no KV regions")
    seen: set[RegionKey] = set()
    for r in layout.regions:
        where = f"{side} region {format_key(r.key)}"
        _apply_rules(r, _REGION_RULES, where)
        _check_end(r.addr, r.num_pages, r.item_len, where, "pages")
        if r.key in seen:
            raise GeometryMismatchError(f"{side}: region {format_key(r.key)} registered twice")
        seen.add(r.key)
    _apply_rules(layout.aux, _AUX_RULES, f"{side} aux")
    _check_end(layout.aux.addr, layout.aux.num_slots, layout.aux.item_len, f"{side} aux", "slots")
    _check_disjoint(layout, side)


def _check_end(addr: int, count: int, item_len: int, where: str, unit: str) -> None:
    end = addr + count * item_len
    if end > ADDR_LIMIT:
        raise GeometryMismatchError(f"{where}: addr {addr:#x} + {count} {unit} × {item_len} bytes "
                                    f"ends at {end:#x}, past the 64-bit address space")


def _check_disjoint(layout: KvLayout, side: str) -> None:
    # A shared byte would let one tensor's WRITE land in another's pages.
    spans = [(r.mem, r.device, r.addr, r.addr + r.num_pages * r.item_len, format_key(r.key))
             for r in layout.regions]
    a = layout.aux
    spans.append((a.mem, a.device, a.addr, a.addr + a.num_slots * a.item_len, "aux"))
    spans.sort()
    # Sorted by start, checking neighbours is enough: if span k starts inside an earlier span i,
    # then span i+1 does too (start_i <= start_i+1 <= start_k < end_i).
    for prev, span in zip(spans, spans[1:]):
        if prev[:2] == span[:2] and span[2] < prev[3]:
            raise GeometryMismatchError(
                f"{side}: {prev[4]} [{prev[2]:#x}, {prev[3]:#x}) and {span[4]} [{span[2]:#x}, "
                f"{span[3]:#x}) overlap on {span[0]} device {span[1]}")


@dataclass(frozen=True, slots=True)
class DescGroup:
    """One pair of prepared descriptor lists (prefill side, decode side) for one NIXL WRITE.

    Invariants: every prefill region of ``pairs`` has memory kind ``prefill_mem`` and every decode
    region ``decode_mem`` (a NIXL list holds one memory kind; devices are per descriptor); matched
    regions have equal ``item_len``; the aux slots, when present, come after all pages and are
    ``aux_nbytes`` long on both sides.
    """

    prefill_mem: str
    decode_mem: str
    pairs: tuple[tuple[Region, Region], ...]  # (prefill region, decode region), prefill table order
    prefill_aux: AuxInfo | None = None
    decode_aux: AuxInfo | None = None
    aux_nbytes: int = 0  # bytes written into the decode's aux slot (the prefill's slot size)

    @property
    def has_aux(self) -> bool:
        return self.prefill_aux is not None

    def prefill_offsets(self) -> tuple[int, ...]:
        """Index of each pair's page 0 in the prefill list, then the index of aux slot 0."""
        return tuple(accumulate((p.num_pages for p, _ in self.pairs), initial=0))

    def decode_offsets(self) -> tuple[int, ...]:
        """Index of each pair's page 0 in the decode list, then the index of aux slot 0."""
        return tuple(accumulate((d.num_pages for _, d in self.pairs), initial=0))

    def prefill_descs(self) -> list[Desc]:
        """Every page of every prefill region in pair order, then every prefill aux slot."""
        return _descs([p for p, _ in self.pairs], self.prefill_aux, self.aux_nbytes)

    def decode_descs(self) -> list[Desc]:
        """Every page of every decode region in pair order, then every decode aux slot."""
        return _descs([d for _, d in self.pairs], self.decode_aux, self.aux_nbytes)


def _descs(regions: Sequence[Region], aux: AuxInfo | None, aux_nbytes: int) -> list[Desc]:
    out = [(r.addr + p * r.item_len, r.item_len, r.device) for r in regions for p in range(r.num_pages)]
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

    @property
    def page_size(self) -> int:
        return self.prefill.page_size

    @property
    def num_decode_pages(self) -> int:
        """Pages every written decode region holds: decode page ids must lie below this."""
        return min(d.num_pages for g in self.groups for _, d in g.pairs)

    @property
    def num_prefill_pages(self) -> int:
        return min(r.num_pages for r in self.prefill.regions)


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
    for pid in page_ids:
        if not 0 <= pid < num_pages:
            raise GeometryMismatchError(f"{where} page id {pid} outside the KV pool [0, {num_pages})")
    if len(set(page_ids)) != len(page_ids):
        dup = next(pid for i, pid in enumerate(page_ids) if pid in page_ids[:i])
        raise GeometryMismatchError(f"{where} page id {dup} appears more than once")


@dataclass(frozen=True, slots=True)
class RequestXfer:
    """One room's WRITEs: per group (same order as ``plan.groups``), the index lists into its prepared
    prefill and decode lists. Equal lengths per group; ``num_bytes`` is everything written."""

    per_group: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    num_bytes: int


def request_indices(plan: TransferPlan, *, prefill_page_ids: Sequence[int], decode_page_ids: Sequence[int],
                    prefill_aux_slot: int, decode_aux_slot: int) -> RequestXfer:
    """Index lists for one room: token-page j of pair i maps prefill ``offset_i + prefill_page_ids[j]``
    to decode ``offset_i + decode_page_ids[j]``; the aux group also maps one aux slot to one.

    Invariant: the decode byte ranges selected are pairwise disjoint and lie inside their regions.
    """
    if len(prefill_page_ids) != len(decode_page_ids):
        raise GeometryMismatchError(f"{len(prefill_page_ids)} prefill pages but {len(decode_page_ids)} "
                                    f"decode pages for one room")
    _check_page_ids(prefill_page_ids, plan.num_prefill_pages, "prefill")
    _check_page_ids(decode_page_ids, plan.num_decode_pages, "decode")
    for side, slot, aux in (("prefill", prefill_aux_slot, plan.prefill.aux),
                            ("decode", decode_aux_slot, plan.decode.aux)):
        if not 0 <= slot < aux.num_slots:
            raise GeometryMismatchError(f"{side} aux_slot {slot} outside [0, {aux.num_slots})")
    per_group, num_bytes = [], 0
    for g in plan.groups:
        p_off, d_off = g.prefill_offsets(), g.decode_offsets()
        p_idx = [p_off[i] + pid for i in range(len(g.pairs)) for pid in prefill_page_ids]
        d_idx = [d_off[i] + pid for i in range(len(g.pairs)) for pid in decode_page_ids]
        num_bytes += len(decode_page_ids) * sum(p.item_len for p, _ in g.pairs)
        if g.has_aux:
            p_idx.append(p_off[-1] + prefill_aux_slot)
            d_idx.append(d_off[-1] + decode_aux_slot)
            num_bytes += g.aux_nbytes
        per_group.append((tuple(p_idx), tuple(d_idx)))
    return RequestXfer(per_group=tuple(per_group), num_bytes=num_bytes)


def count_merged_descs(prefill_descs: Sequence[Desc], decode_descs: Sequence[Desc]) -> int:
    """How many descriptors remain once entries adjacent on both sides merge, as NIXL's prepared
    lists do. Inputs are one WRITE's selected descriptors, in index-list order, of equal length."""
    if len(prefill_descs) != len(decode_descs):
        raise ValueError(f"{len(prefill_descs)} prefill descriptors but {len(decode_descs)} decode ones")
    runs = 0
    for i, (p, d) in enumerate(zip(prefill_descs, decode_descs)):
        if i == 0 or not (_adjacent(prefill_descs[i - 1], p) and _adjacent(decode_descs[i - 1], d)):
            runs += 1
    return runs


def _adjacent(prev: Desc, cur: Desc) -> bool:
    return prev[2] == cur[2] and prev[0] + prev[1] == cur[0]
