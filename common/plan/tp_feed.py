"""The transfer plan between a prefill at TP A and a decode at TP B, page sizes free: pure functions.

``build_tp_plan`` checks every rank's region table (``KvLayout``) of both sides against each other
and says which prefill rank writes which KV heads of which regions into which decode rank (a
``FeedPlan`` per such pair of ranks); ``feed_descs`` turns one feed and one room's page ids into
the NIXL descriptors (``(addr, nbytes, device)`` rows) that move the room's tokens. The head and
token maths is ``kvferry.common.plan.tp``'s; this module adds the region tables, the checks that need
them, and the addresses. Every refusal is a ``GeometryMismatchError`` naming both values.

Heads are counted per model: a draft model may have fewer KV heads than the target, so its regions
may be fed by other prefill ranks than the target's. A feed holds every region key its pair of
ranks moves heads of, target and draft alike, each ``RegionPair`` with its own heads; the decode
rank's room is complete once every prefill rank in ``TpPlan.feeders`` has notified it. An MLA
model's latent regions (``LATENT_KIND``: one per layer, whole on every rank) go whole to every
decode rank, the layers' writers spread over the prefill ranks (``latent_writer``). Decode
draft regions are ignored when the prefill has no draft (the decode runs speculative decoding on
its own), as in ``kvferry.common.plan.geometry.build_plan``. Aux records are not part of this plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvferry.common.errors import GeometryMismatchError
from kvferry.common.plan.layout import KvLayout, cache_form, check_layout, check_same_forms, format_key, format_keys
from kvferry.common.plan.tp import HeadRange, PageSide, check_tp, copies, feeds, latent_writer, num_copies, rank_heads
from kvferry.common.wire.messages import Region, RegionKey

INT64_LIMIT = 1 << 63  # descriptors are int64: a region must end below this
# The most descriptors one room may need over all its feeds (before merging). Each row costs ~1.5-2 us
# to post and ~200 bytes while built, so 2**20 is ~2 s and ~200 MB per room in flight at worst.
MAX_ROOM_DESCS = 1 << 20
_NO_DESCS = np.zeros((0, 3), dtype=np.int64)


@dataclass(frozen=True, slots=True)
class RegionPair:
    """One region key's source region (on the prefill rank) and destination region (on the decode
    rank), the heads of its model this feed moves, and the bytes of one head of one token."""

    src: Region
    dst: Region
    heads: HeadRange
    token_bytes: int

    @property
    def key(self) -> RegionKey:
        return self.src.key


@dataclass(frozen=True, slots=True)
class FeedPlan:
    """Prefill rank ``prefill_rank`` writes ``pairs`` (its heads of each) into decode rank ``decode_rank``."""

    prefill_rank: int
    decode_rank: int
    src_page_size: int
    dst_page_size: int
    pairs: tuple[RegionPair, ...]  # in the prefill's region table order; never empty

    def heads_of(self, model: str = "target") -> HeadRange | None:
        """The heads of ``model`` ("target"/"draft") this feed moves, or None if none."""
        return next((p.heads for p in self.pairs if p.src.model == model), None)

    @property
    def src_mem(self) -> str:
        return self.pairs[0].src.mem

    @property
    def dst_mem(self) -> str:
        return self.pairs[0].dst.mem


@dataclass(frozen=True, slots=True)
class TpPlan:
    """Every feed from a prefill at ``prefill_tp`` ranks into a decode at ``decode_tp`` ranks.

    ``written`` lists the prefill's region keys in its table order, ``ignored`` the decode-only
    draft keys (as ``geometry.build_plan`` reports them). ``num_kv_heads`` is the target model's;
    ``draft_num_kv_heads`` the draft's, 0 when no draft region is written."""

    prefill_tp: int
    decode_tp: int
    num_kv_heads: int
    draft_num_kv_heads: int
    feeds: tuple[FeedPlan, ...]  # by decode rank, then prefill rank
    written: tuple[RegionKey, ...]
    ignored: tuple[RegionKey, ...]

    def feeders(self, decode_rank: int) -> tuple[int, ...]:
        """The prefill ranks whose notifications complete a room on ``decode_rank``."""
        if not 0 <= decode_rank < self.decode_tp:
            raise GeometryMismatchError(f"decode rank {decode_rank} outside [0, {self.decode_tp})")
        return tuple(sorted({f.prefill_rank for f in self.feeds if f.decode_rank == decode_rank}))


def build_tp_plan(prefill: Sequence[KvLayout], decode: Sequence[KvLayout]) -> TpPlan:
    """Check both sides' layouts (``prefill[i]`` is prefill rank i's, ``decode[j]`` decode rank j's)
    and build every feed. Raises ``GeometryMismatchError``.

    Checks: each side lists ``tp_size`` layouts, rank i at index i, agreeing on tp_size, model,
    kv_dtype, page_size and region keys; both sides have the same model and kv_dtype; region keys
    match as in ``geometry.build_plan``; per model, ``num_kv_heads`` (the largest ``head_start +
    num_heads``) is equal on both sides, can be spread over each side's ranks, and every rank holds
    exactly ``rank_heads``; ``item_len`` is a whole number of bytes per head per token, equal on
    both sides; the written regions of one rank share one memory kind and end below 2**63.
    """
    p_tp = _check_side(prefill, "prefill")
    d_tp = _check_side(decode, "decode")
    p0, d0 = prefill[0], decode[0]
    check_same_forms(p0, d0)
    for name, label, fix in (("model", "model fingerprint", "serve the same checkpoint on both sides"),
                             ("kv_dtype", "kv_dtype", "start both sides with the same --kv-cache-dtype and --dtype "
                              "(a room is converted between KV dtypes only between equal TP sizes)")):
        pv, dv = getattr(p0, name), getattr(d0, name)
        if pv != dv:
            raise GeometryMismatchError(f"{label} mismatch: prefill has {pv!r}, decode has {dv!r}; {fix}")
    written, ignored = _match_keys(p0, d0)
    heads: dict[str, int] = {}
    for model in dict.fromkeys(k[0] for k in written):
        keys = [k for k in written if k[0] == model]
        heads[model] = _model_heads(prefill, decode, model, keys)
    token_bytes = _token_bytes(prefill, decode, written)
    for side, layouts in (("prefill", prefill), ("decode", decode)):
        _check_written(layouts, written, side)
    by_ranks: dict[tuple[int, int], dict[RegionKey, HeadRange]] = {}
    for model, n in heads.items():
        keys = [k for k in written if k[0] == model]
        if cache_form(p0, model) == "mla":  # replicated: every decode rank needs every layer whole
            for d in range(d_tp):
                for i, k in enumerate(keys):
                    by_ranks.setdefault((d, latent_writer(i, d, p_tp)), {})[k] = HeadRange(0, 1)
            continue
        for f in feeds(n, p_tp, d_tp):
            for k in keys:
                by_ranks.setdefault((f.decode_rank, f.prefill_rank), {})[k] = f.heads
    out = []
    for (d, p), key_heads in sorted(by_ranks.items()):
        src, dst = _by_key(prefill[p]), _by_key(decode[d])
        pairs = tuple(RegionPair(src[k], dst[k], key_heads[k], token_bytes[k]) for k in written if k in key_heads)
        out.append(FeedPlan(p, d, p0.page_size, d0.page_size, pairs))
    return TpPlan(prefill_tp=p_tp, decode_tp=d_tp, num_kv_heads=heads.get("target", 0),
                  draft_num_kv_heads=heads.get("draft", 0), feeds=tuple(out), written=written, ignored=ignored)


def _by_key(layout: KvLayout) -> dict[RegionKey, Region]:
    return {r.key: r for r in layout.regions}


def _check_side(layouts: Sequence[KvLayout], side: str) -> int:
    """One side's ranks agree with each other; returns its tp_size."""
    if not layouts:
        raise GeometryMismatchError(f"{side}: no layout given (one per TP rank is needed)")
    for i, layout in enumerate(layouts):
        check_layout(layout, f"{side} rank {i}")
    first = layouts[0]
    for name in ("tp_size", "model", "kv_dtype", "page_size"):
        for i, layout in enumerate(layouts[1:], 1):
            if getattr(layout, name) != getattr(first, name):
                raise GeometryMismatchError(
                    f"{side} ranks disagree on {name}: rank 0 has {getattr(first, name)!r}, rank {i} has "
                    f"{getattr(layout, name)!r}; start every rank of one side with the same settings")
    tp = first.tp_size
    ranks = [layout.tp_rank for layout in layouts]
    missing = sorted(set(range(tp)) - set(ranks))
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if missing or twice or len(layouts) != tp:
        raise GeometryMismatchError(
            f"{side}: tp_size {tp} needs one layout per rank 0..{tp - 1}, got {len(layouts)} with tp_rank "
            f"{ranks}" + (f"; missing rank(s) {missing}" if missing else "")
            + (f"; rank(s) {twice} given twice" if twice else ""))
    for i, layout in enumerate(layouts):
        if layout.tp_rank != i:
            raise GeometryMismatchError(f"{side}: the layout at index {i} is tp_rank {layout.tp_rank}'s; "
                                        f"list rank i's layout at index i (got tp_rank {ranks})")
    keys = [r.key for r in first.regions]
    for i, layout in enumerate(layouts[1:], 1):
        other = [r.key for r in layout.regions]
        # a draft model runs unsharded on rank 0 (decode-only speculative decoding): other ranks lack it
        lacks = [k for k in keys if k not in set(other) and k[0] != "draft"]
        extra = [k for k in other if k not in set(keys)]
        if lacks or extra:
            raise GeometryMismatchError(
                f"{side} ranks hold different KV regions: rank {i} lacks [{format_keys(lacks)}] that rank 0 "
                f"has, and has [{format_keys(extra)}] that rank 0 lacks; every rank serves every layer")
    return tp


def _match_keys(prefill: KvLayout, decode: KvLayout) -> tuple[tuple[RegionKey, ...], tuple[RegionKey, ...]]:
    """The written keys (prefill table order) and the ignored decode-only draft keys, refused as
    ``geometry.build_plan`` refuses them."""
    p_keys = [r.key for r in prefill.regions]
    d_keys = [r.key for r in decode.regions]
    missing = [k for k in p_keys if k not in set(d_keys)]
    if missing:
        lead = ("decode registered fewer KV regions than prefill" if len(d_keys) < len(p_keys)
                else "decode KV regions do not cover the prefill's")
        raise GeometryMismatchError(f"{lead} (prefill {len(p_keys)}, decode {len(d_keys)}): missing "
                                    f"{format_keys(missing)}; serve the same model (and the same draft model, "
                                    f"if the prefill runs one) on both sides")
    extra = [k for k in d_keys if k not in set(p_keys)]
    extra_target = [k for k in extra if k[0] != "draft"]
    if extra_target:
        raise GeometryMismatchError(f"decode registered target regions the prefill does not have: "
                                    f"{format_keys(extra_target)}; serve the same target model on both sides")
    if extra and any(k[0] == "draft" for k in p_keys):
        raise GeometryMismatchError(f"decode registered draft regions the prefill does not have: "
                                    f"{format_keys(extra)}, while the prefill runs a draft model too; "
                                    f"use the same --draft-model on both sides, or none on the prefill")
    return tuple(p_keys), tuple(extra)


def _model_heads(prefill: Sequence[KvLayout], decode: Sequence[KvLayout], model: str,
                 keys: Sequence[RegionKey]) -> int:
    """``model``'s KV head count, once both sides agree on it and every rank holds its share."""
    wanted = set(keys)
    counts = {}
    for side, layouts in (("prefill", prefill), ("decode", decode)):
        counts[side] = max(r.head_start + r.num_heads for lay in layouts for r in lay.regions if r.key in wanted)
    n, tps = counts["prefill"], (prefill[0].tp_size, decode[0].tp_size)
    if counts["decode"] != n:
        raise GeometryMismatchError(
            f"{model} num_kv_heads mismatch (largest head_start + num_heads over a side's ranks): prefill has "
            f"{n} over tp_size {tps[0]}, decode has {counts['decode']} over tp_size {tps[1]}; serve the same model")
    for side, layouts, tp in (("prefill", prefill, tps[0]), ("decode", decode, tps[1])):
        try:
            check_tp(n, tp, f"{side} {model}")
        except GeometryMismatchError as exc:
            raise GeometryMismatchError(f"{exc} (prefill tp_size {tps[0]}, decode tp_size {tps[1]})") from None
        for lay in layouts:
            want = rank_heads(n, tp, lay.tp_rank, side)
            for r in lay.regions:
                if r.key in wanted and (r.head_start, r.num_heads) != (want.start, want.count):
                    raise GeometryMismatchError(
                        f"{side} rank {lay.tp_rank} region {format_key(r.key)}: holds heads head_start "
                        f"{r.head_start}, num_heads {r.num_heads}; rank {lay.tp_rank} of tp_size {tp} with "
                        f"{n} {model} KV heads must hold head_start {want.start}, num_heads {want.count}")
    return n


def _token_bytes(prefill: Sequence[KvLayout], decode: Sequence[KvLayout], keys: Sequence[RegionKey]
                 ) -> dict[RegionKey, int]:
    """Bytes of one head of one token per key: whole, and equal on every rank of both sides."""
    out: dict[RegionKey, int] = {}
    first: dict[RegionKey, str] = {}
    wanted = set(keys)
    for side, layouts in (("prefill", prefill), ("decode", decode)):
        for lay in layouts:
            for r in lay.regions:
                if r.key not in wanted:
                    continue
                per_page = lay.page_size * r.num_heads
                how = (f"{side} rank {lay.tp_rank} has item_len {r.item_len} for page_size {lay.page_size} "
                       f"x {r.num_heads} heads")
                if r.item_len % per_page:
                    raise GeometryMismatchError(f"region {format_key(r.key)}: {how}, not a whole number of "
                                                f"bytes per head per token")
                tb = r.item_len // per_page
                if r.key not in out:
                    out[r.key], first[r.key] = tb, how
                elif out[r.key] != tb:
                    raise GeometryMismatchError(
                        f"region {format_key(r.key)}: one head of one token is {out[r.key]} bytes where "
                        f"{first[r.key]}, but {tb} where {how}; the same model and --dtype are needed")
    return out


def _check_written(layouts: Sequence[KvLayout], keys: Sequence[RegionKey], side: str) -> None:
    """A rank's written regions share one memory kind (one descriptor list per feed) and int64 addresses."""
    wanted = set(keys)
    for lay in layouts:
        regions = [r for r in lay.regions if r.key in wanted]
        mems = sorted({r.mem for r in regions})
        if len(mems) > 1:
            raise GeometryMismatchError(f"{side} rank {lay.tp_rank}: written KV regions lie in {mems}; a TP "
                                        f"feed needs them in one memory kind")
        for r in regions:
            end = r.addr + (r.num_pages - 1) * r.page_stride + r.item_len
            if end > INT64_LIMIT:
                raise GeometryMismatchError(f"{side} rank {lay.tp_rank} region {format_key(r.key)} ends at "
                                            f"{end:#x}, past what an int64 descriptor names ({INT64_LIMIT:#x})")


def room_descs(plan: TpPlan, num_tokens: int) -> int:
    """The descriptors one room of ``num_tokens`` tokens needs over every feed of ``plan`` when no two
    rows merge (pages scattered): the rows ``feed_descs(..., merge=False)`` returns, summed. Grows
    with ``num_tokens``: the count at the longest room bounds every room."""
    return sum(num_copies(num_tokens, f.src_page_size, f.dst_page_size, p.heads.count)
               for f in plan.feeds for p in f.pairs)


def check_room_descs(plan: TpPlan, max_room_tokens: int, limit: int = MAX_ROOM_DESCS) -> None:
    """Refuse ``plan`` when a room of ``max_room_tokens`` tokens could need more than ``limit``
    descriptors (page sizes, heads and regions multiply), naming the count and the fix."""
    n = room_descs(plan, max_room_tokens)
    if n > limit:
        f = plan.feeds[0]
        raise GeometryMismatchError(
            f"a room of {max_room_tokens} tokens would need up to {n} NIXL descriptors over {len(plan.feeds)} "
            f"TP feeds (prefill page_size {f.src_page_size}, decode page_size {f.dst_page_size}, "
            f"{plan.num_kv_heads} KV heads, {len(plan.written)} regions), more than the bound of {limit} "
            f"descriptors per room; serve the decode with the prefill's page size (one descriptor per page "
            f"and region) or larger pages")


def feed_descs(feed: FeedPlan, num_tokens: int, prefill_page_ids: Sequence[int], decode_page_ids: Sequence[int],
               *, merge: bool = True, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The (prefill, decode) NIXL descriptors, int64 arrays [n, 3] of (addr, nbytes, device), that
    move tokens ``[start, num_tokens)`` (``start``: the decode's prefix hit, ``tp.copies``) of the
    feed's heads of every pair: token t lies in page ``prefill_page_ids[t // src_page_size]`` on the
    prefill, ``decode_page_ids[t // dst_page_size]`` on the decode. Rows come in prefill address order; with ``merge``, a row that starts where the
    previous one ends on both sides (same device) extends it, the most merging any order gives,
    since a feed reads each prefill byte at most once.

    At equal page sizes the last page moves whole (its tail past ``num_tokens`` lands in a page
    the room owns). Raises unless there are enough page ids for ``num_tokens`` on each side, each
    id lies in ``[0, num_pages)`` of every region of its side, and none appears twice.
    """
    if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise GeometryMismatchError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
    where = f"feed prefill rank {feed.prefill_rank} -> decode rank {feed.decode_rank}"
    src_ids = _page_ids(prefill_page_ids, num_tokens, feed.src_page_size, [p.src for p in feed.pairs],
                        f"{where}: prefill")
    dst_ids = _page_ids(decode_page_ids, num_tokens, feed.dst_page_size, [p.dst for p in feed.pairs],
                        f"{where}: decode")
    if num_tokens == start:  # nothing (left) to move: the decode holds the whole prompt
        return _NO_DESCS.copy(), _NO_DESCS.copy()
    shapes: dict[tuple[PageSide, PageSide, HeadRange], np.ndarray] = {}  # one copy table per (sides, heads)
    src_rows, dst_rows = [], []
    for pair in feed.pairs:
        s_side = PageSide(feed.src_page_size, HeadRange(pair.src.head_start, pair.src.num_heads), pair.token_bytes)
        d_side = PageSide(feed.dst_page_size, HeadRange(pair.dst.head_start, pair.dst.num_heads), pair.token_bytes)
        table = shapes.get((s_side, d_side, pair.heads))
        if table is None:
            cs = copies(num_tokens, s_side, src_ids, d_side, dst_ids, pair.heads, start)
            table = np.array([(c.src_page, c.src_offset, c.dst_page, c.dst_offset, c.nbytes) for c in cs],
                             dtype=np.int64).reshape(-1, 5)
            shapes[(s_side, d_side, pair.heads)] = table
        src_rows.append(_rows(pair.src, table[:, 0], table[:, 1], table[:, 4]))
        dst_rows.append(_rows(pair.dst, table[:, 2], table[:, 3], table[:, 4]))
    src, dst = np.concatenate(src_rows), np.concatenate(dst_rows)
    order = np.lexsort((src[:, 0], src[:, 2]))
    src, dst = src[order], dst[order]
    return _merged(src, dst) if merge else (src, dst)


def _rows(region: Region, pages: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    out = np.empty((len(pages), 3), dtype=np.int64)
    out[:, 0] = region.addr + pages * region.page_stride + offsets
    out[:, 1] = nbytes
    out[:, 2] = region.device
    return out


def _merged(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows that start where the previous row ends, on the same device, on both sides, join it."""
    def touches(d: np.ndarray) -> np.ndarray:
        return (d[:-1, 0] + d[:-1, 1] == d[1:, 0]) & (d[:-1, 2] == d[1:, 2])

    starts = np.flatnonzero(np.concatenate(([True], ~(touches(src) & touches(dst)))))
    out = []
    for d in (src, dst):
        m = d[starts].copy()
        m[:, 1] = np.add.reduceat(d[:, 1], starts)
        out.append(m)
    return out[0], out[1]


def _page_ids(page_ids: Sequence[int], num_tokens: int, page_size: int, regions: Sequence[Region],
              where: str) -> list[int]:
    """The ids the room's tokens use, once checked against every region of one side."""
    try:
        ids = np.asarray(page_ids, dtype=np.int64).reshape(-1)
    except (OverflowError, TypeError, ValueError):
        raise GeometryMismatchError(f"{where} page ids must be a list of integers") from None
    need = -(-num_tokens // page_size)
    if len(ids) < need:
        raise GeometryMismatchError(f"{where}: {len(ids)} page ids of {page_size} tokens cannot hold "
                                    f"{num_tokens} tokens; {need} are needed")
    smallest = min(regions, key=lambda r: r.num_pages)
    bad = ids[(ids < 0) | (ids >= smallest.num_pages)]
    if len(bad):
        raise GeometryMismatchError(f"{where} page id {int(bad[0])} outside region "
                                    f"{format_key(smallest.key)}'s pages [0, {smallest.num_pages})")
    ordered = np.sort(ids)
    repeats = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(repeats):
        raise GeometryMismatchError(f"{where} page id {int(repeats[0])} appears more than once")
    return ids[:need].tolist()
