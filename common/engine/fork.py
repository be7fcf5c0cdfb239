"""n > 1 completions of one prompt: the prompt KV is computed (or received) once and forked.

A child has the parent's prompt and no output. The pages before the one that holds the last
prompt token are shared (``PageAllocator.share``: read only, since nobody writes positions before
its own last prompt token); that page is copied into the child's own (copy-on-write done at once:
each completion writes it next); the rest are the child's. The child starts one token back, at
``num_cached = prompt_len - 1``: its first decode step recomputes the last prompt token into its
own page and samples its first token from that step's logits with its own generator. The parent
keeps the first token the prefill sampled. Speculative decoding needs the parent's draft KV in
place first (``fork`` fills it when the prefill did not write it); the draft pages fork the same way.
"""

from __future__ import annotations

from common.engine.runner import ModelRunner
from common.engine.sequence import Sequence
from common.errors import OverloadedError


def pages_for_group(runner: ModelRunner, seq: Sequence, n: int) -> int:
    """Pages ``seq`` and ``n - 1`` forks of it take (for admission)."""
    own = runner.pages_for(seq)
    return own + (n - 1) * (own - _last_prompt_page(runner, seq))


def fork(runner: ModelRunner, parent: Sequence, children: list[Sequence]) -> None:
    """Give each child the parent's prompt KV (see the module doc). Runs on the model executor.
    Raises OverloadedError, taking nothing, when a pool is short."""
    last = _last_prompt_page(runner, parent)
    if runner.draft is not None and parent.draft_num_cached < parent.num_prompt_tokens:
        runner.prefill_draft([parent])
    needed = sum(runner.pages_for(c) - last for c in children)
    for slot in runner.slots:
        if slot.allocator.num_free < needed:
            raise OverloadedError(f"request_id={parent.request_id}: n={len(children) + 1} completions need "
                                  f"{needed} more KV pages, the pool has {slot.allocator.num_free}; retry later")
    for child in children:
        own = runner.pages_for(child) - last
        child.pages = runner.target.allocator.share(parent.pages[:last]) + runner.target.allocator.allocate(own)
        runner.target.kv.copy_page(parent.pages[last], child.pages[last])
        if runner.draft is not None:
            child.draft_pages = (runner.draft.allocator.share(parent.draft_pages[:last])
                                 + runner.draft.allocator.allocate(own))
            runner.draft.kv.copy_page(parent.draft_pages[last], child.draft_pages[last])
        child.num_cached = child.draft_num_cached = parent.num_prompt_tokens - 1
        if parent.grammar is not None:  # structured output: its own matcher, at the grammar's start
            child.grammar = parent.grammar.fresh()


def _last_prompt_page(runner: ModelRunner, seq: Sequence) -> int:
    return (seq.num_prompt_tokens - 1) // runner.page_size
