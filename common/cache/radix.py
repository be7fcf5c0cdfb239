"""A radix tree over token ids at page granularity: the prefix cache of either daemon.

Each edge holds whole pages: ``tokens`` is a multiple of ``page_size`` long and ``pages[i]`` holds
``tokens[i * page_size : (i + 1) * page_size]``. Children are keyed by their first page's tokens,
so a lookup walks one page at a time::

    root ── [sys prompt: pages 0 1 2 3] ──┬── [turn 1: pages 4 5] ── [turn 2: pages 9]
                                          └── [other user: pages 7 8]

Holds, not locks. The tree holds one reference on each of its pages in every ``PageAllocator`` it
was given (the target's and, in lockstep, the draft's): the same counts the n > 1 forks use. A
request that reuses a prefix takes its own reference (``acquire``), so a page is free again only
once the tree evicted it and every request using it released it. A page whose count is above the
tree's own one is in use (a running sequence, a room whose WRITE reads it): its node is not
evictable, whatever its age. Eviction takes least recently used leaves first, whole.

Read-only: a cached page is full (only whole pages are inserted) and nobody writes positions below
a sequence's cached length, so a shared page is never written (the decode's WRITE starts at its
hit, a multiple of its page size: ``kvferry.common.plan.tp``).

Not thread-safe: the allocators' one owner thread (the daemon's event loop) calls it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvferry.common.cache.kv_cache import PageAllocator


class EventSink(Protocol):
    """Where the tree reports what it stores and drops (``kv_events.KvEventPublisher``)."""

    def block_stored(self, block_hashes: list[int], parent_block_hash: int | None, token_ids: list[int],
                     block_size: int, medium: str | None = ...) -> None: ...

    def block_removed(self, block_hashes: list[int], medium: str | None = ...) -> None: ...

    def all_blocks_cleared(self) -> None: ...


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    pages: list[int]
    parent: _Node | None
    hashes: list[int] = field(default_factory=list)  # one per page, chained (only with an event sink)
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0


@dataclass(frozen=True, slots=True)
class Hit:
    """The cached prefix of a token list: ``num_tokens`` (a multiple of the page size) in ``pages``."""

    pages: list[int]
    num_tokens: int


class RadixCache:
    def __init__(self, page_size: int, allocators: Sequence[PageAllocator], *, max_pages: int | None = None,
                 events: EventSink | None = None, medium: str = "GPU"):
        if page_size <= 0:
            raise ValueError(f"page_size is {page_size}, expected > 0")
        if not allocators:
            raise ValueError("a radix cache needs at least one page allocator")
        self.page_size = page_size
        self.allocators = list(allocators)
        self.max_pages = max_pages  # None: bounded by the pool only
        self.events = events
        self.medium = medium
        self.root = _Node((), [], None)
        self.num_pages = 0       # pages the tree holds
        self.num_evicted = 0     # pages dropped by eviction since start
        self._clock = itertools.count(1)

    # -- lookup ---------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], max_tokens: int | None = None) -> Hit:
        """The longest cached prefix of ``tokens`` of at most ``max_tokens`` tokens, in whole pages;
        marks its nodes used now. Takes no reference: ``acquire`` does."""
        ps = self.page_size
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        num_pages_max = max(limit, 0) // ps
        node, pages, now = self.root, [], next(self._clock)
        while len(pages) < num_pages_max:
            start = len(pages) * ps
            child = node.children.get(tuple(tokens[start:start + ps]))
            if child is None:
                break
            same = 1  # the first page matched (it is the key)
            most = min(len(child.pages), num_pages_max - len(pages))
            while same < most and _page_equal(child.tokens, same, tokens, start, ps):
                same += 1
            if same < len(child.pages):
                child = self._split(child, same)
            child.last_used = now
            pages.extend(child.pages)
            node = child
        return Hit(pages, len(pages) * ps)

    def acquire(self, tokens: Sequence[int], max_tokens: int | None = None) -> Hit:
        """``match``, and one reference per matched page in every allocator, the caller's to free
        (with the rest of its pages: ``PageAllocator.free``)."""
        hit = self.match(tokens, max_tokens)
        for allocator in self.allocators:
            allocator.share(hit.pages)
        return hit

    # -- insert ---------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Cache the whole pages of ``tokens`` (``pages[i]`` holds page i; a last partial page is
        left out). Where a prefix is cached already its pages stay and the given ones are not taken
        (the caller frees its own as usual); the rest becomes a new leaf holding a reference on its
        pages. Returns the pages newly cached."""
        ps = self.page_size
        num_pages = min(len(tokens) // ps, len(pages))
        node, i, now = self.root, 0, next(self._clock)
        while i < num_pages:
            child = node.children.get(tuple(tokens[i * ps:(i + 1) * ps]))
            if child is None:
                break
            same = 1
            most = min(len(child.pages), num_pages - i)
            while same < most and _page_equal(child.tokens, same, tokens, i * ps, ps):
                same += 1
            if same < len(child.pages):
                child = self._split(child, same)
            child.last_used = now
            node, i = child, i + same
        if i == num_pages:
            return 0
        new_pages = list(pages[i:num_pages])
        for allocator in self.allocators:
            allocator.share(new_pages)
        leaf = _Node(tuple(tokens[i * ps:num_pages * ps]), new_pages, node, last_used=now)
        node.children[leaf.tokens[:ps]] = leaf
        self.num_pages += len(new_pages)
        if self.events is not None:
            parent_hash = node.hashes[-1] if node.hashes else None
            leaf.hashes = _chain(parent_hash, leaf.tokens, ps)
            self.events.block_stored(list(leaf.hashes), parent_hash, list(leaf.tokens), ps, self.medium)
        if self.max_pages is not None and self.num_pages > self.max_pages:
            self.evict(self.num_pages - self.max_pages)
        return len(new_pages)

    # -- eviction -------------------------------------------------------------------------------
    def is_evictable(self, node: _Node) -> bool:
        """A leaf whose pages nobody but the tree holds."""
        refs = self.allocators[0].holders
        return not node.children and node is not self.root and all(refs(p) == 1 for p in node.pages)

    def evictable_pages(self) -> int:
        """Pages eviction could free now: unreferenced leaves, then the parents they leave childless."""
        refs = self.allocators[0].holders
        order, stack = [], list(self.root.children.values())
        while stack:  # parents before children; walked backwards, children come first
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        whole: dict[int, bool] = {}  # id(node) -> everything at and under it is freeable
        total = 0
        for node in reversed(order):
            ok = all(whole[id(c)] for c in node.children.values()) and all(refs(p) == 1 for p in node.pages)
            whole[id(node)] = ok
            total += len(node.pages) if ok else 0
        return total

    def evict(self, num_pages: int) -> int:
        """Drop least recently used unreferenced leaves until ``num_pages`` pages went back to the
        pool or none is left to drop; returns the pages freed."""
        if num_pages <= 0:
            return 0
        heap = [(n.last_used, id(n), n) for n in self._leaves() if self.is_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            if not self.is_evictable(node):
                continue
            freed += self._drop(node)
            parent = node.parent
            if parent is not self.root and self.is_evictable(parent):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        self.num_evicted += freed
        return freed

    def clear(self) -> int:
        """Drop every node (pages still held by requests stay theirs); returns the pages let go."""
        dropped = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for allocator in self.allocators:
                allocator.free(node.pages)
            dropped += len(node.pages)
        self.root.children.clear()
        self.num_pages = 0
        if self.events is not None:
            self.events.all_blocks_cleared()
        return dropped

    # -- internals ------------------------------------------------------------------------------
    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    def _drop(self, node: _Node) -> int:
        del node.parent.children[node.tokens[:self.page_size]]
        for allocator in self.allocators:
            allocator.free(node.pages)
        self.num_pages -= len(node.pages)
        if self.events is not None and node.hashes:
            self.events.block_removed(list(node.hashes), self.medium)
        return len(node.pages)

    def _split(self, node: _Node, num_pages: int) -> _Node:
        """Cut ``node``'s edge after ``num_pages`` pages; returns the new upper node."""
        ps = self.page_size
        cut = num_pages * ps
        upper = _Node(node.tokens[:cut], node.pages[:num_pages], node.parent, node.hashes[:num_pages],
                      last_used=node.last_used)
        node.parent.children[upper.tokens[:ps]] = upper
        node.tokens, node.pages, node.hashes = node.tokens[cut:], node.pages[num_pages:], node.hashes[num_pages:]
        node.parent = upper
        upper.children[node.tokens[:ps]] = node
        return upper


def _page_equal(edge: tuple[int, ...], page: int, tokens: Sequence[int], start: int, ps: int) -> bool:
    """Page ``page`` of ``edge`` equals ``tokens[start + page * ps:][:ps]``."""
    a = page * ps
    b = start + a
    return len(tokens) >= b + ps and edge[a:a + ps] == tuple(tokens[b:b + ps])


def _chain(parent: int | None, tokens: tuple[int, ...], ps: int) -> list[int]:
    from kvferry.common.cache.kv_events import block_hash  # only with an event sink

    out = []
    for i in range(0, len(tokens), ps):
        parent = block_hash(parent, tokens[i:i + ps])
        out.append(parent)
    return out
