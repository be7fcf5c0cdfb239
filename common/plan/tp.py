"""Tensor-parallel and page-size slicing of one region's pages: pure functions, values in, values out.

Which KV heads each rank holds, which prefill rank writes which heads of which decode rank, and
the byte ranges that move one room's tokens of those heads from one page size to another. This is
the maths a prefill at TP A with P-token pages uses to feed a decode at TP B with Q-token pages;
nothing here knows NIXL, a device or a clock, and every refusal is a ``GeometryMismatchError``
naming both sides' values.

In-page order, heads outermost: the page item of a region whose rank holds heads ``[h0, h0 + H)``
of ``P`` tokens is::

    [head h0: token 0 .. P-1, head_dim each] [head h0 + 1: token 0 .. P-1] ... [head h0 + H - 1: ...]

so a slice of heads of a whole page is one contiguous range, and so is any token range of one head.
A copy that covers whole pages on both sides (same page size) moves every overlapping head of the
page at once: one descriptor per page and region, as without TP. Where the page sizes differ, a
page is cut into segments at both sides' page boundaries, and each head of each segment is one copy.

Heads of a model with ``num_kv_heads`` KV heads over ``tp`` ranks: ``num_kv_heads % tp == 0``
splits them in contiguous blocks; ``num_kv_heads < tp`` with ``tp % num_kv_heads == 0`` replicates
each head on ``tp / num_kv_heads`` consecutive ranks, and the lowest prefill rank holding a head is
the one that writes it (``writer_of``). Anything else is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvferry.common.errors import GeometryMismatchError


@dataclass(frozen=True, slots=True, order=True)
class HeadRange:
    """KV heads ``[start, start + count)``."""

    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count

    def __contains__(self, head: int) -> bool:
        return self.start <= head < self.stop

    def overlap(self, other: "HeadRange") -> "HeadRange | None":
        start, stop = max(self.start, other.start), min(self.stop, other.stop)
        return HeadRange(start, stop - start) if stop > start else None


def check_tp(num_kv_heads: int, tp_size: int, side: str) -> None:
    """Raise unless ``num_kv_heads`` KV heads can be spread over ``tp_size`` ranks."""
    if tp_size < 1 or num_kv_heads < 1:
        raise GeometryMismatchError(f"{side}: tp_size ({tp_size}) and num_kv_heads ({num_kv_heads}) must be >= 1")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise GeometryMismatchError(
            f"{side}: {num_kv_heads} KV heads cannot be spread over tp_size={tp_size} ranks: one must divide "
            f"the other (split in equal blocks, or each head replicated on tp_size / num_kv_heads ranks)")


def rank_heads(num_kv_heads: int, tp_size: int, tp_rank: int, side: str = "rank") -> HeadRange:
    """The KV heads rank ``tp_rank`` of ``tp_size`` holds."""
    check_tp(num_kv_heads, tp_size, side)
    if not 0 <= tp_rank < tp_size:
        raise GeometryMismatchError(f"{side}: tp_rank must be in [0, {tp_size}), got {tp_rank}")
    if num_kv_heads >= tp_size:
        per_rank = num_kv_heads // tp_size
        return HeadRange(tp_rank * per_rank, per_rank)
    return HeadRange(tp_rank * num_kv_heads // tp_size, 1)


def writer_of(head: int, num_kv_heads: int, tp_size: int) -> int:
    """The prefill rank that writes ``head``: the lowest rank holding it."""
    if num_kv_heads >= tp_size:
        return head // (num_kv_heads // tp_size)
    return head * tp_size // num_kv_heads


@dataclass(frozen=True, slots=True)
class Feed:
    """Prefill rank ``prefill_rank`` writes ``heads`` into decode rank ``decode_rank``."""

    prefill_rank: int
    decode_rank: int
    heads: HeadRange


def feeds(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> tuple[Feed, ...]:
    """Every (prefill rank, decode rank) pair that moves heads, with the heads it moves: each head of
    each decode rank comes from exactly one prefill rank, the lowest that holds it."""
    check_tp(num_kv_heads, prefill_tp, "prefill")
    check_tp(num_kv_heads, decode_tp, "decode")
    out = []
    for d in range(decode_tp):
        wanted = rank_heads(num_kv_heads, decode_tp, d)
        for p in range(prefill_tp):
            both = rank_heads(num_kv_heads, prefill_tp, p).overlap(wanted)
            if both is None:
                continue
            mine = [h for h in range(both.start, both.stop) if writer_of(h, num_kv_heads, prefill_tp) == p]
            if mine:  # a rank's written heads are contiguous: mine[0] .. mine[-1]
                out.append(Feed(p, d, HeadRange(mine[0], len(mine))))
    return tuple(out)


def latent_writer(index: int, decode_rank: int, prefill_tp: int) -> int:
    """The prefill rank that writes a model's ``index``-th latent region (MLA, every prefill rank
    holds it whole) into ``decode_rank``: round robin over the layers, shifted by the decode rank,
    so that each prefill rank writes a share of the layers to every decode rank (within one of
    the others' share), and each layer's copies are spread over the prefill ranks alike, instead of
    rank 0 sending everything."""
    return (index + decode_rank) % prefill_tp


def decode_feeders(feeds_: Sequence[Feed], decode_rank: int) -> tuple[int, ...]:
    """The prefill ranks whose notifications complete a room on ``decode_rank``."""
    return tuple(sorted({f.prefill_rank for f in feeds_ if f.decode_rank == decode_rank}))


@dataclass(frozen=True, slots=True)
class PageSide:
    """One side of one region as the copy maths sees it: its page size in tokens, the heads its
    page items hold, and the bytes of one head of one token (head_dim x element size)."""

    page_size: int
    heads: HeadRange
    token_bytes: int

    @property
    def item_len(self) -> int:
        return self.page_size * self.heads.count * self.token_bytes

    def offset(self, head: int, token_in_page: int) -> int:
        """Byte offset of (head, token) inside a page item (heads outermost)."""
        return ((head - self.heads.start) * self.page_size + token_in_page) * self.token_bytes


@dataclass(frozen=True, slots=True)
class Copy:
    """``nbytes`` from byte ``src_offset`` of source page ``src_page`` to byte ``dst_offset`` of
    destination page ``dst_page`` (offsets inside one region's page item)."""

    src_page: int
    src_offset: int
    dst_page: int
    dst_offset: int
    nbytes: int


def segments(num_tokens: int, src_page_size: int, dst_page_size: int, start: int = 0) -> list[tuple[int, int]]:
    """``[start, num_tokens)`` cut at every multiple of either page size: (first token, length) each."""
    if start >= num_tokens:
        return []
    def after(ps: int) -> range:  # the multiples of ps strictly inside (start, num_tokens)
        return range((start // ps + 1) * ps, num_tokens, ps)
    cuts = sorted({start, num_tokens} | set(after(src_page_size)) | set(after(dst_page_size)))
    return [(a, b - a) for a, b in zip(cuts, cuts[1:])]


def copies(num_tokens: int, src: PageSide, src_pages: Sequence[int], dst: PageSide, dst_pages: Sequence[int],
           heads: HeadRange, start: int = 0) -> list[Copy]:
    """The copies that move tokens ``[start, num_tokens)`` of ``heads`` from ``src_pages`` to
    ``dst_pages`` (page ids in token order, from token 0). With equal page sizes every page, the
    last one too, moves whole: one copy for all of ``heads`` (the tail of a last partial page lands
    in pages the room owns, past its tokens). Otherwise one copy per head per segment.

    Prefix reuse: ``start`` (the tokens the destination holds) is a multiple of the destination's
    page size, so no copy lands in a destination page below it (those are cached and shared); on
    the source it may fall inside a page, whose tail is then read from that row on::

        src (64-token pages)  |      page 0 . . . . . . . . . . . . .|    page 1 ...
        dst (16-token pages)  | p0 (held) | p1 (held) | p2 . . | p3 . |  p4 ...
        start = 32                        ^ first copy: src page 0 row 32 -> dst page 2 row 0
    """
    if not 0 <= start <= num_tokens or start % dst.page_size:
        raise GeometryMismatchError(f"start token {start} must be a multiple of the destination's page size "
                                    f"{dst.page_size} in [0, {num_tokens}]")
    if heads.overlap(src.heads) != heads or heads.overlap(dst.heads) != heads:
        raise GeometryMismatchError(f"heads {heads.start}..{heads.stop - 1} are not all held by the source "
                                    f"({src.heads.start}..{src.heads.stop - 1}) and the destination "
                                    f"({dst.heads.start}..{dst.heads.stop - 1})")
    if src.token_bytes != dst.token_bytes:
        raise GeometryMismatchError(f"one head of one token is {src.token_bytes} bytes on the source and "
                                    f"{dst.token_bytes} on the destination")
    _check_pages(num_tokens, src.page_size, src_pages, "source")
    _check_pages(num_tokens, dst.page_size, dst_pages, "destination")
    if src.page_size == dst.page_size:
        nbytes = heads.count * src.page_size * src.token_bytes
        first = start // src.page_size
        return [Copy(s, src.offset(heads.start, 0), d, dst.offset(heads.start, 0), nbytes)
                for s, d in zip(src_pages[first:_pages(num_tokens, src.page_size)], dst_pages[first:])]
    out = []
    for first, length in segments(num_tokens, src.page_size, dst.page_size, start):
        s_page, s_tok = divmod(first, src.page_size)
        d_page, d_tok = divmod(first, dst.page_size)
        for h in range(heads.start, heads.stop):
            out.append(Copy(src_pages[s_page], src.offset(h, s_tok), dst_pages[d_page], dst.offset(h, d_tok),
                            length * src.token_bytes))
    return out


def num_copies(num_tokens: int, src_page_size: int, dst_page_size: int, num_heads: int) -> int:
    """``len(copies(...))`` for ``num_tokens`` tokens of ``num_heads`` heads, without building them:
    one per page at equal page sizes, else one per head per segment (a cut at every multiple of
    either page size below ``num_tokens``, counted once where both cut). Never decreases with
    ``num_tokens``, so the count at the longest room bounds every shorter one."""
    if num_tokens <= 0:
        return 0
    if src_page_size == dst_page_size:
        return _pages(num_tokens, src_page_size)
    last = num_tokens - 1
    cuts = last // src_page_size + last // dst_page_size - last // math.lcm(src_page_size, dst_page_size)
    return (cuts + 1) * num_heads


def _pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def _check_pages(num_tokens: int, page_size: int, page_ids: Sequence[int], where: str) -> None:
    if len(page_ids) < _pages(num_tokens, page_size):
        raise GeometryMismatchError(f"{where}: {len(page_ids)} pages of {page_size} tokens cannot hold "
                                    f"{num_tokens} tokens")
