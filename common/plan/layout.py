"""One side's KV geometry: the region table and the checks that need only that side (DESIGN §4).

``KvLayout`` is what a daemon derives from its own pools or reads from a ``register`` message;
``check_layout`` refuses a table no plan could use (bad kinds, overflowing or overlapping regions,
a page stride shorter than a page). Pure functions, like ``kvferry.common.plan.geometry``, which builds the
transfer plan from two of these.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvferry.common.errors import GeometryMismatchError
from kvferry.common.wire.aux_record import AUX_RECORD_BYTES
from kvferry.common.wire.messages import (LATENT_KIND, MEM_KINDS, MODEL_KINDS, REGION_KINDS, AuxInfo, Region, RegionKey,
                                         Register)

ADDR_LIMIT = 1 << 64  # one past the last byte a 64-bit descriptor address can name
Desc = tuple[int, int, int]  # one NIXL descriptor: (addr, nbytes, device)
_MAX_KEYS_SHOWN = 8


def format_key(key: RegionKey) -> str:
    """``("target", 3, "v")`` → ``"target layer 3 v"``, the form used in every message."""
    return f"{key[0]} layer {key[1]} {key[2]}"


def format_keys(keys: Sequence[RegionKey]) -> str:
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


# Upper bounds on what a peer may register, checked before anything is allocated or built for it:
# 4M pages is 64M tokens at 16-token pages, past any pool a device holds today; a register above
# them is refused at once instead of having the prefill build lists of that length.
MAX_PAGES = 1 << 22
MAX_AUX_SLOTS = 1 << 20
# Ranks of one TP group: 1024 GPUs is more than any NVLink domain (72 on an NVL72 rack) holds, and
# keeps every loop over a peer's ranks (its parts, the missing ones named in a refusal) short.
MAX_TP_SIZE = 1024


def check_tp_rank(tp_size: int, tp_rank: int, side: str) -> None:
    """Raise unless ``1 <= tp_size <= MAX_TP_SIZE`` and ``0 <= tp_rank < tp_size``: checked before
    anything counts over a peer's ranks."""
    if not 1 <= tp_size <= MAX_TP_SIZE:
        raise GeometryMismatchError(f"{side}: tp_size must be in [1, {MAX_TP_SIZE}] (the most ranks one TP group "
                                    f"may have), got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise GeometryMismatchError(f"{side}: tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")

_Rule = tuple[str, Callable[[Any], bool], str]  # (field, predicate, what the field must be)
_REGION_RULES: tuple[_Rule, ...] = (
    ("model", lambda r: r.model in MODEL_KINDS, f"one of {MODEL_KINDS}"),
    ("kind", lambda r: r.kind in REGION_KINDS, f"one of {REGION_KINDS}"),
    ("mem", lambda r: r.mem in MEM_KINDS, f"one of {MEM_KINDS}"),
    ("layer", lambda r: r.layer >= 0, ">= 0"),
    ("device", lambda r: r.device >= 0, ">= 0"),
    ("addr", lambda r: r.addr >= 0, ">= 0"),
    ("item_len", lambda r: r.item_len > 0, "> 0"),
    ("stride", lambda r: r.stride == 0 or r.stride >= r.item_len, "0 or >= item_len (pages must not overlap)"),
    ("num_pages", lambda r: 0 < r.num_pages <= MAX_PAGES, f"in [1, {MAX_PAGES}]"),
    ("head_start", lambda r: r.head_start >= 0, ">= 0"),
    ("num_heads", lambda r: r.num_heads > 0, "> 0"),
)
_AUX_RULES: tuple[_Rule, ...] = (
    ("mem", lambda a: a.mem in MEM_KINDS, f"one of {MEM_KINDS}"),
    ("device", lambda a: a.device >= 0, ">= 0"),
    ("addr", lambda a: a.addr >= 0, ">= 0"),
    ("item_len", lambda a: a.item_len >= AUX_RECORD_BYTES, f">= {AUX_RECORD_BYTES} (one aux record)"),
    ("num_slots", lambda a: 0 < a.num_slots <= MAX_AUX_SLOTS, f"in [1, {MAX_AUX_SLOTS}]"),
)


def _apply_rules(obj: object, rules: tuple[_Rule, ...], where: str) -> None:
    for name, ok, expected in rules:
        if not ok(obj):
            raise GeometryMismatchError(f"{where}: {name} must be {expected}, got {getattr(obj, name)!r}")


def check_layout(layout: KvLayout, side: str) -> None:
    """Raise unless ``layout`` is sane on its own; ``side`` ("prefill"/"decode") names it in messages.

    Invariants: ``page_size > 0``; ``0 <= tp_rank < tp_size <= MAX_TP_SIZE``; at least one region;
    every region has a known model/kind/mem, ``item_len > 0``, ``stride`` 0 or ``>= item_len``, ``num_pages > 0`` and
    ends inside 64-bit space; no key appears twice; the aux area holds ``num_slots > 0`` slots of at
    least one aux record each (or none at all on a tensor-parallel rank > 0: ``has_aux``); no two regions (or a region and the aux area) share a byte on one
    (mem, device). Regions may interleave (page-major pools) when their strides are equal; regions
    with different strides must not even interleave, a conservative rule that no pool layout kvferry
    builds comes near.
    """
    if layout.page_size <= 0:
        raise GeometryMismatchError(f"{side}: page_size must be > 0, got {layout.page_size}")
    check_tp_rank(layout.tp_size, layout.tp_rank, side)
    if not layout.regions:
        raise GeometryMismatchError(f"{side}: registered no KV regions")
    seen: set[RegionKey] = set()
    for r in layout.regions:
        where = f"{side} region {format_key(r.key)}"
        _apply_rules(r, _REGION_RULES, where)
        _check_end(_Span.of_region(r), where, "pages")
        if r.key in seen:
            raise GeometryMismatchError(f"{side}: region {format_key(r.key)} registered twice")
        seen.add(r.key)
    for model in dict.fromkeys(r.model for r in layout.regions):
        cache_form(layout, model, side)  # K and V, or an MLA latent: one form per model
    if has_aux(layout):
        _apply_rules(layout.aux, _AUX_RULES, f"{side} aux")
        _check_end(_Span.of_aux(layout.aux), f"{side} aux", "slots")
    _check_disjoint(layout, side)


def cache_form(layout: KvLayout, model: str, side: str = "") -> str | None:
    """How ``model`` ("target"/"draft") caches its KV in ``layout``: "kv" (K and V regions per
    layer), "mla" (one latent region per layer, replicated: head_start 0, one head), None when
    the layout has no region of it. Raises for a model that mixes the two or a latent region
    that is not replicated."""
    regions = [r for r in layout.regions if r.model == model]
    latent = [r for r in regions if r.kind == LATENT_KIND]
    if not latent:
        return "kv" if regions else None
    if len(latent) != len(regions):
        raise GeometryMismatchError(f"{side}: {model} registers both MLA latent and K/V regions; a model caches "
                                    f"one or the other")
    for r in latent:
        if (r.head_start, r.num_heads) != (0, 1):
            raise GeometryMismatchError(f"{side} region {format_key(r.key)}: an MLA latent is whole on every rank "
                                        f"(head_start 0, num_heads 1), got head_start {r.head_start}, num_heads "
                                        f"{r.num_heads}")
    return "mla"


def check_same_forms(prefill: KvLayout, decode: KvLayout) -> None:
    """Each model both sides hold caches in the same form (``cache_form``): an MLA prefill cannot
    fill a decode of K and V, nor the reverse; refused naming both forms and both fingerprints.
    The planners check this before the fingerprints, so that an operator pairing a DeepSeek with
    a Llama reads why the two can never meet, not only that two hashes differ."""
    for model in dict.fromkeys(r.model for r in prefill.regions):
        p, d = cache_form(prefill, model, "prefill"), cache_form(decode, model, "decode")
        if d is not None and p != d:
            name = {"kv": "K and V per layer", "mla": "one MLA latent per layer"}
            raise GeometryMismatchError(f"{model} KV form mismatch: prefill caches {name[p]}, decode caches "
                                        f"{name[d]}; serve the same model on both sides (model fingerprint: "
                                        f"prefill {prefill.model!r}, decode {decode.model!r})")


def has_aux(layout: KvLayout) -> bool:
    """Whether ``layout`` holds aux slots: rank 0 always does; a tensor-parallel rank > 0 may hold
    none (``num_slots`` 0: rank 0 of its daemon receives the room's aux record)."""
    return layout.tp_rank == 0 or layout.aux.num_slots != 0


@dataclass(frozen=True, slots=True)
class _Span:
    """``count`` items of ``item_len`` bytes, ``stride`` bytes apart, from ``addr`` on (mem, device)."""

    name: str
    mem: str
    device: int
    addr: int
    item_len: int
    stride: int
    count: int

    @classmethod
    def of_region(cls, r: Region) -> _Span:
        return cls(format_key(r.key), r.mem, r.device, r.addr, r.item_len, r.page_stride, r.num_pages)

    @classmethod
    def of_aux(cls, a: AuxInfo) -> _Span:
        return cls("aux", a.mem, a.device, a.addr, a.item_len, a.item_len, a.num_slots)

    @property
    def end(self) -> int:
        """One past the last byte of the last item."""
        return self.addr + (self.count - 1) * self.stride + self.item_len

    def __str__(self) -> str:
        return f"{self.name} [{self.addr:#x}, {self.end:#x})"


def _check_end(span: _Span, where: str, unit: str) -> None:
    if span.end > ADDR_LIMIT:
        raise GeometryMismatchError(
            f"{where}: addr {span.addr:#x} + {span.count} {unit} × {span.item_len} bytes every {span.stride} "
            f"bytes ends at {span.end:#x}, past the 64-bit address space")


def _check_disjoint(layout: KvLayout, side: str) -> None:
    # A shared byte would let one tensor's WRITE land in another's pages.
    by_place: dict[tuple[str, int], list[_Span]] = {}
    aux = [_Span.of_aux(layout.aux)] if has_aux(layout) else []
    for span in [_Span.of_region(r) for r in layout.regions] + aux:
        by_place.setdefault((span.mem, span.device), []).append(span)
    for (mem, device), spans in by_place.items():
        by_stride: dict[int, list[_Span]] = {}
        for span in spans:
            by_stride.setdefault(span.stride, []).append(span)
        for stride, group in by_stride.items():
            hit = _shared_byte(group, stride)
            if hit is not None:
                a, b, byte = hit
                raise GeometryMismatchError(f"{side}: {a} and {b} overlap on {mem} device {device}: "
                                            f"byte {byte:#x} lies in a page of both")
        clash = _interleaved_strides(spans)
        if clash is not None:
            a, b = clash
            raise GeometryMismatchError(
                f"{side}: {a} and {b} overlap on {mem} device {device} with different page strides "
                f"({a.stride} and {b.stride} bytes); only regions of equal stride may interleave")


def _shared_byte(spans: Sequence[_Span], stride: int) -> tuple[_Span, _Span, int] | None:
    """Exact check for spans of one stride: (span, span, a byte in both), lower address first, or None.

    Byte ``x`` is (block ``x // stride``, phase ``x % stride``). An item of a span covers one phase
    interval in one block, or, when it crosses a block edge, a head and a tail interval in two; so a
    span is at most two rectangles (block range × phase interval). A sweep over blocks keeps the
    phase intervals present at the current block sorted; they are disjoint unless two spans share a
    byte, so a new interval need only be compared with its two neighbours. O(n log n) for n spans.
    """
    events = []  # (block, 0 = leave / 1 = enter, (phase_lo, phase_hi, span index))
    for i, span in enumerate(spans):
        block, phase = divmod(span.addr, stride)
        parts = [(block, (phase, min(phase + span.item_len, stride), i))]
        if phase + span.item_len > stride:
            parts.append((block + 1, (0, phase + span.item_len - stride, i)))
        for first, interval in parts:
            events += [(first, 1, interval), (first + span.count, 0, interval)]
    events.sort()
    present: list[tuple[int, int, int]] = []
    for block, kind, interval in events:
        at = bisect.bisect_left(present, interval)
        if kind == 0:
            del present[at]
            continue
        lo, hi, i = interval
        for other in (present[at - 1] if at else None, present[at] if at < len(present) else None):
            if other is not None and other[0] < hi and lo < other[1]:
                pair = sorted((spans[i], spans[other[2]]), key=lambda s: s.addr)
                return pair[0], pair[1], block * stride + max(lo, other[0])
        present.insert(at, interval)
    return None


def _interleaved_strides(spans: Sequence[_Span]) -> tuple[_Span, _Span] | None:
    """Two spans of different strides whose [addr, end) extents overlap, or None. One sweep by start,
    keeping the largest end so far and the largest end of any other stride."""
    best: _Span | None = None  # the largest end so far
    second: _Span | None = None  # the largest end among spans whose stride differs from best's
    for span in sorted(spans, key=lambda s: s.addr):
        other = best if best is not None and best.stride != span.stride else second
        if other is not None and other.end > span.addr:
            return other, span
        if best is None or (span.stride == best.stride and span.end > best.end):
            best = span
        elif span.stride != best.stride and span.end > best.end:
            best, second = span, best
        elif span.stride != best.stride and (second is None or span.end > second.end):
            second = span
    return None


def layout_summary(layout: KvLayout, draft_model: str = "") -> dict:
    """One side's KV layout as an operator compares it with the other side's (``/server_info``):
    what ``build_plan`` checks, without addresses."""
    def of_model(model: str) -> dict | None:
        regions = [r for r in layout.regions if r.model == model]
        if not regions:
            return None
        return {"layers": len({r.layer for r in regions}), "regions": len(regions),
                "bytes_per_page": sum(r.item_len for r in regions), "num_pages": max(r.num_pages for r in regions),
                "mem": sorted({r.mem for r in regions}),
                "kv_heads": sorted({(r.head_start, r.head_start + r.num_heads) for r in regions})}

    return {"model": layout.model, "draft_model": draft_model or None, "page_size": layout.page_size,
            "kv_dtype": layout.kv_dtype, "tp_size": layout.tp_size, "tp_rank": layout.tp_rank,
            "target": of_model("target"), "draft": of_model("draft"), "aux_slots": layout.aux.num_slots}
