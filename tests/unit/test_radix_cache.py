"""The radix prefix cache (common/cache/radix.py): insert, match, holds, LRU eviction, and a
Hypothesis property over any sequence of those against the page allocator's counts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvferry.common.cache.kv_cache import PageAllocator
from kvferry.common.cache.radix import RadixCache

PS = 4


def _cache(num_pages: int = 64, **kw) -> tuple[RadixCache, PageAllocator]:
    alloc = PageAllocator(num_pages)
    return RadixCache(PS, [alloc], **kw), alloc


def _seq(alloc: PageAllocator, cache: RadixCache, tokens: list[int]) -> list[int]:
    """A request's pages for ``tokens``: the cached prefix shared, the rest allocated."""
    hit = cache.acquire(tokens)
    return hit.pages + alloc.allocate(-(-len(tokens) // PS) - len(hit.pages))


def test_insert_then_match_whole_pages_only():
    cache, alloc = _cache()
    tokens = list(range(10))  # two whole pages and a partial one
    pages = alloc.allocate(3)
    assert cache.insert(tokens, pages) == 2
    assert cache.num_pages == 2
    hit = cache.match(tokens + [99])
    assert (hit.pages, hit.num_tokens) == (pages[:2], 8)
    assert cache.match([0, 1, 2, 3, 4, 5, 6, 0]).num_tokens == 4  # the second page differs in its last token
    assert cache.match([5] * 8).num_tokens == 0
    assert cache.match(tokens, max_tokens=7).num_tokens == 4  # the bound is in whole pages too
    alloc.free(pages)  # the request ends: the tree's hold keeps the two whole pages
    assert [alloc.holders(p) for p in pages] == [1, 1, 0]


def test_a_cached_prefix_keeps_its_pages_and_a_new_tail_is_a_leaf():
    cache, alloc = _cache()
    a = alloc.allocate(2)
    cache.insert(list(range(8)), a)
    b = alloc.allocate(3)  # another request computed the same first two pages itself, and one more
    assert cache.insert(list(range(12)), b) == 1
    assert cache.match(list(range(12))).pages == a + b[2:]
    assert [alloc.holders(p) for p in a + b] == [2, 2, 1, 1, 2]


def test_split_on_partial_match_and_branching():
    cache, alloc = _cache()
    p = alloc.allocate(3)
    cache.insert(list(range(12)), p)
    q = alloc.allocate(3)
    other = list(range(4)) + [50, 51, 52, 53, 60, 61, 62, 63]
    hit = cache.acquire(other)
    assert hit.pages == p[:1]
    alloc.free(q[:1])
    cache.insert(other, hit.pages + q[1:])
    assert cache.match(other).pages == p[:1] + q[1:]
    assert cache.match(list(range(12))).pages == p
    assert cache.num_pages == 5


def test_acquired_pages_are_not_evicted_and_lru_goes_first():
    cache, alloc = _cache()
    old, new = list(range(100, 108)), list(range(200, 208))
    for tokens in (old, new):
        pages = alloc.allocate(2)
        cache.insert(tokens, pages)
        alloc.free(pages)
    held = cache.acquire(new)  # a running request uses `new`: not evictable, however old it gets
    cache.match(old)  # `old` is now the more recently used, but it is the only one evictable
    assert cache.evictable_pages() == 2
    assert cache.evict(10) == 2
    assert cache.match(old).num_tokens == 0
    assert cache.match(new).pages == held.pages
    alloc.free(held.pages)
    assert cache.evict(1) == 2  # whole leaves
    assert alloc.num_free == alloc.num_pages


def test_lru_order_among_evictable_leaves():
    cache, alloc = _cache()
    trees = [list(range(i * 10, i * 10 + 4)) for i in range(3)]
    for tokens in trees:
        pages = alloc.allocate(1)
        cache.insert(tokens, pages)
        alloc.free(pages)
    cache.match(trees[0])  # 1 is now the oldest
    cache.evict(1)
    assert [cache.match(t).num_tokens for t in trees] == [4, 0, 4]


def test_parent_becomes_evictable_after_its_children():
    cache, alloc = _cache()
    pages = alloc.allocate(3)
    cache.insert(list(range(12)), pages)
    cache.match(list(range(4)))  # splits: root -> [page 0] -> [pages 1, 2]
    alloc.free(pages)
    assert cache.evictable_pages() == 3
    assert cache.evict(3) == 3
    assert cache.num_pages == 0 and alloc.num_free == alloc.num_pages


def test_max_pages_bound_evicts_on_insert():
    cache, alloc = _cache(max_pages=2)
    for i in range(3):
        pages = alloc.allocate(1)
        cache.insert([i] * 4, pages)
        alloc.free(pages)
    assert cache.num_pages == 2
    assert cache.match([0] * 4).num_tokens == 0  # the least recently used went


def test_clear_keeps_what_requests_hold():
    cache, alloc = _cache()
    pages = alloc.allocate(2)
    cache.insert(list(range(8)), pages)
    assert cache.clear() == 2
    assert cache.match(list(range(8))).num_tokens == 0
    assert [alloc.holders(p) for p in pages] == [1, 1]  # still the request's
    alloc.free(pages)
    assert alloc.num_free == alloc.num_pages


def test_two_allocators_move_in_lockstep():
    target, draft = PageAllocator(16), PageAllocator(16)
    cache = RadixCache(PS, [target, draft])
    pages = target.allocate(2)
    assert draft.allocate(2) == pages
    cache.insert(list(range(8)), pages)
    hit = cache.acquire(list(range(8)))
    assert [target.holders(p) for p in pages] == [draft.holders(p) for p in pages] == [3, 3]
    for a in (target, draft):
        a.free(pages)
        a.free(hit.pages)
    cache.evict(2)
    assert target.free_runs() == draft.free_runs() == [(0, 16)]


class _Events:
    def __init__(self):
        self.log = []

    def block_stored(self, block_hashes, parent_block_hash, token_ids, block_size, medium=None):
        self.log.append(("stored", tuple(block_hashes), parent_block_hash, tuple(token_ids)))

    def block_removed(self, block_hashes, medium=None):
        self.log.append(("removed", tuple(block_hashes)))

    def all_blocks_cleared(self):
        self.log.append(("cleared",))


def test_events_chain_hashes_and_report_removals():
    events = _Events()
    cache, alloc = _cache(events=events)
    pages = alloc.allocate(3)
    cache.insert(list(range(8)), pages[:2])
    cache.insert(list(range(12)), pages)
    (_, h1, parent1, toks1), (_, h2, parent2, toks2) = events.log
    assert parent1 is None and len(h1) == 2 and toks1 == tuple(range(8))
    assert parent2 == h1[-1] and len(h2) == 1 and toks2 == tuple(range(8, 12))
    alloc.free(pages)
    cache.evict(1)
    assert events.log[-1] == ("removed", h2)
    cache.clear()
    assert events.log[-1] == ("cleared",)


# -- property: counts never go negative, no held page is ever freed -----------------------------
_op = st.one_of(
    st.tuples(st.just("run"), st.lists(st.integers(0, 2), min_size=1, max_size=14)),  # admit, then insert
    st.tuples(st.just("end"), st.integers(0, 7)),  # a running request ends
    st.tuples(st.just("evict"), st.integers(0, 8)),
    st.tuples(st.just("clear"), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_op, max_size=40))
def test_any_sequence_keeps_counts_and_never_frees_a_held_page(ops):
    alloc = PageAllocator(24)
    cache = RadixCache(2, [alloc])
    running: list[tuple[list[int], list[int]]] = []  # (tokens, pages) of live requests
    for op, arg in ops:
        if op == "run":
            need = -(-len(arg) // 2)
            hit = cache.acquire(arg)
            rest = need - len(hit.pages)
            if alloc.num_free < rest:
                cache.evict(rest - alloc.num_free)
            if alloc.num_free < rest:
                alloc.free(hit.pages)
                continue
            pages = hit.pages + alloc.allocate(rest)
            assert hit.num_tokens <= len(arg) and hit.num_tokens % 2 == 0
            cache.insert(arg, pages)
            running.append((arg, pages))
        elif op == "end" and running:
            _, pages = running.pop(arg % len(running))
            alloc.free(pages)
        elif op == "evict":
            cache.evict(arg)
        elif op == "clear":
            cache.clear()
        held = {p for _, pages in running for p in pages}
        for p in held:  # a page a request holds is never free, whatever the tree did
            assert alloc.holders(p) >= 1
        in_tree = _tree_pages(cache)
        assert len(in_tree) == len(set(in_tree)) == cache.num_pages
        for p in range(alloc.num_pages):
            expected = sum(p in pages for _, pages in running) + in_tree.count(p)
            assert alloc.holders(p) == expected >= 0
        assert alloc.num_free == sum(alloc.holders(p) == 0 for p in range(alloc.num_pages))
    for _, pages in running:
        alloc.free(pages)
    cache.evict(alloc.num_pages)
    assert alloc.num_free == alloc.num_pages and cache.num_pages == 0


def _tree_pages(cache: RadixCache) -> list[int]:
    out, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        out.extend(node.pages)
        stack.extend(node.children.values())
    return out


def test_bad_arguments():
    with pytest.raises(ValueError):
        RadixCache(0, [PageAllocator(4)])
    with pytest.raises(ValueError):
        RadixCache(4, [])
