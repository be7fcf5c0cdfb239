"""Pages of a ``ModelRunner``'s sequences: admission (with a prefix hit), eviction, caching, release.

A mixin of ``ModelRunner`` (``runner.py``): it reads ``target``, ``draft``, ``page_size``,
``spec_k``, ``history`` and ``prefix_cache`` of the runner. Allocator work: call it on the thread
that owns the allocators (the daemon's event loop).
"""

from __future__ import annotations

from kvferry.common.cache.radix import RadixCache
from kvferry.common.engine.sequence import Sequence, pages_needed
from kvferry.common.errors import OverloadedError


class Admission:
    prefix_cache: RadixCache | None

    def enable_prefix_cache(self, *, max_tokens: int | None = None, events=None, medium: str = "GPU") -> RadixCache:
        """Keep prompts' (and, on the decode, finished sequences') whole pages for reuse, at most
        ``max_tokens`` tokens of them (None: as many as the pool holds); ``events`` is an
        ``EventSink`` (kv_events)."""
        max_pages = None if max_tokens is None else max_tokens // self.page_size
        self.prefix_cache = RadixCache(self.page_size, [s.allocator for s in self.slots], max_pages=max_pages,
                                       events=events, medium=medium)
        return self.prefix_cache

    @property
    def slots(self) -> list:  # of runner.ModelSlot
        """The target, then the draft when there is one."""
        return [s for s in (self.target, self.draft) if s is not None]

    def free_pages(self) -> dict[str, int]:
        """Free pages of each pool, by model name ("target", "draft")."""
        return {s.kv.model_name: s.allocator.num_free for s in self.slots}

    def pages_for(self, seq: Sequence, *, prompt_only: bool = False) -> int:
        if prompt_only:
            return pages_needed(seq.num_prompt_tokens, self.page_size)
        # +spec_k+1: a verify forward writes k+1 positions past the last cached token.
        return pages_needed(seq.max_total_tokens + self.spec_k + 1, self.page_size)

    def can_admit(self, seq: Sequence, *, prompt_only: bool = False) -> bool:
        """Whether ``admit`` finds the pages now (counting what the prefix cache could give up)."""
        n = self.pages_for(seq, prompt_only=prompt_only)
        spare = self.reclaimable_pages()
        ok = self.target.allocator.num_free + spare >= n
        if self.draft is not None:
            ok = ok and self.draft.allocator.num_free + spare >= n
        return ok

    def reclaimable_pages(self) -> int:
        """Pages the prefix cache could give back now (cached, used by no request); 0 without one."""
        return self.prefix_cache.evictable_pages() if self.prefix_cache is not None else 0

    def make_room(self, num_pages: int) -> None:
        """Evict cached prefixes until ``num_pages`` pages are free in every pool, if they can be."""
        if self.prefix_cache is None:
            return
        short = num_pages - min(s.allocator.num_free for s in self.slots)
        if short > 0:
            self.prefix_cache.evict(short)

    def admit(self, seq: Sequence, *, prompt_only: bool = False, max_hit: int = 0) -> None:
        """Allocate every page the sequence can need (only the prompt's on a prefill worker);
        raises OverloadedError when the pool is short.

        With a prefix cache and ``max_hit`` > 0, the longest cached prefix of the prompt of at most
        ``max_hit`` tokens is reused: its pages are shared (read only), ``num_cached`` (and the
        draft's) start there and ``seq.cached_tokens`` says how many. Cached prefixes nobody uses
        are evicted, least recently used first, when the pool is short."""
        n = self.pages_for(seq, prompt_only=prompt_only)
        cache = self.prefix_cache
        hit_pages: list[int] = []
        if cache is not None and max_hit > 0:
            hit = cache.acquire(seq.prompt_ids, max_hit)
            hit_pages = hit.pages
        need = n - len(hit_pages)
        self.make_room(need)
        if min(s.allocator.num_free for s in self.slots) < need:
            for slot in self.slots:
                slot.allocator.free(hit_pages)
            raise OverloadedError(
                f"request_id={seq.request_id}: KV pool has {self.target.allocator.num_free} free pages, "
                f"needs {need} (prompt {seq.num_prompt_tokens} + max_new_tokens {seq.params.max_new_tokens}"
                f"{f', {len(hit_pages)} pages cached' if hit_pages else ''}); retry later")
        seq.pages = hit_pages + self.target.allocator.allocate(need)
        if self.draft is not None:
            seq.draft_pages = list(hit_pages) + self.draft.allocator.allocate(need)
            if seq.draft_pages != seq.pages:
                # The decode registers one page list per room for both models, so both pools must
                # hand out the same ids; they move in lockstep, and this says so if they ever drift.
                pages, draft_pages = seq.pages, seq.draft_pages
                self.release(seq)
                raise RuntimeError(f"request_id={seq.request_id}: target and draft KV allocators drifted apart "
                                   f"(target pages {pages[:4]}..., draft pages {draft_pages[:4]}...)")
        num_hit = len(hit_pages) * self.page_size
        seq.cached_tokens = num_hit
        seq.num_cached = max(seq.num_cached, num_hit)
        if self.draft is not None:
            seq.draft_num_cached = max(seq.draft_num_cached, num_hit)

    def cache_tokens(self, seq: Sequence, num_tokens: int | None = None) -> int:
        """Put the whole pages of ``seq``'s first ``num_tokens`` tokens (default: every token whose KV
        it holds, the draft's too) into the prefix cache; returns the pages newly cached."""
        if self.prefix_cache is None:
            return 0
        valid = seq.num_cached if self.draft is None else min(seq.num_cached, seq.draft_num_cached)
        num_tokens = valid if num_tokens is None else min(num_tokens, valid)
        return self.prefix_cache.insert(seq.tokens[:num_tokens], seq.pages)

    def release(self, seq: Sequence) -> None:
        if seq.pages:
            self.target.allocator.free(seq.pages)
            seq.pages = []
        if seq.draft_pages and self.draft is not None:
            self.draft.allocator.free(seq.draft_pages)
            seq.draft_pages = []
        if seq.history_row is not None:
            self.history.release(seq.history_row)
            seq.history_row = None
