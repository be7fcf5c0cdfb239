"""n > 1 completions of one prompt: the prompt KV is computed (or received) once and forked.

A child has the parent's prompt and no output. The pages before the one that holds the last
prompt token are shared (``PageAllocator.share``: read only, since nobody writes positions before
its own last prompt token); that page is copied into the child's own (copy-on-write done at once:
each completion writes it next); the rest are the child's. The child starts one token back, at
``num_cached = prompt_len - 1``: its first decode step recomputes the last prompt token into its
own page and samples its first token from that step's logits with its own generator. The parent
keeps the first token the prefill sampled. Speculative decoding needs the parent's draft KV in
place first (``fork_kv`` fills it when the prefill did not write it); the draft pages fork the same way.

Threads: the allocators change only on the event loop (``fork_pages``, like ``admit`` and
``release``); the model executor only fills KV (``fork_kv``). ``fork_group`` runs both and, on a
cancel or failure, frees the group's pages only once the executor's job has returned.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Executor

import torch

from kvferry.common.engine.batcher import Job
from kvferry.common.engine.colocated import decode_seed
from kvferry.common.engine.output import StepOutput
from kvferry.common.engine.runner import ModelRunner
from kvferry.common.engine.sequence import Sequence
from kvferry.common.errors import OverloadedError
from kvferry.common.sampling.sampler import make_generator


def pages_for_group(runner: ModelRunner, seq: Sequence, n: int) -> int:
    """Pages ``seq`` and ``n - 1`` forks of it take (for admission)."""
    own = runner.pages_for(seq)
    return own + (n - 1) * (own - _last_prompt_page(runner, seq))


def check_group(runner: ModelRunner, seq: Sequence, n: int) -> None:
    """Raise OverloadedError unless the pools hold ``seq`` and its ``n - 1`` forks now (checked at
    admission, so that a request is refused before its prompt is computed or moved)."""
    needed = pages_for_group(runner, seq, n)
    spare = runner.reclaimable_pages()
    for slot in runner.slots:
        if slot.allocator.num_free + spare < needed:
            raise OverloadedError(f"request_id={seq.request_id}: n={n} completions need {needed} KV pages, "
                                  f"the {slot.kv.model_name} pool has {slot.allocator.num_free} free; retry later")


def fork_seed(seed: int | None, index: int) -> int | None:
    """Generator seed of completion ``index`` of a request seeded with ``seed``: completion 0 is the
    parent (``decode_seed``), the others their own reproducible streams."""
    return None if seed is None else (decode_seed(seed) + index * 0x632BE59BD9B4E019) % (1 << 63)


def children_of(parent: Sequence, n: int, device: torch.device) -> list[Sequence]:
    """Completions 1 .. n - 1 of ``parent``'s prompt: no pages, no output yet (``fork`` gives them KV)."""
    return [Sequence(f"{parent.request_id}-{i}", list(parent.prompt_ids), parent.params,
                     generator=make_generator(fork_seed(parent.params.seed, i), device),
                     top_logprobs_num=parent.top_logprobs_num) for i in range(1, n)]


async def outputs(jobs: list[Job]) -> AsyncIterator[tuple[int, StepOutput]]:
    """``(job index, output)`` of every job in arrival order, until each has sent its finished one."""
    if len(jobs) == 1:
        while True:
            out = await jobs[0].queue.get()
            yield 0, out
            if out.finished:
                return
    merged: asyncio.Queue[tuple[int, StepOutput]] = asyncio.Queue()

    async def pump(index: int, job: Job) -> None:
        while True:
            out = await job.queue.get()
            merged.put_nowait((index, out))
            if out.finished:
                return

    pumps = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        remaining = len(jobs)
        while remaining:
            index, out = await merged.get()
            remaining -= out.finished
            yield index, out
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def fork(runner: ModelRunner, parent: Sequence, children: list[Sequence]) -> None:
    """``fork_pages`` then ``fork_kv`` on the calling thread (a caller with no event loop)."""
    fork_pages(runner, parent, children)
    fork_kv(runner, parent, children)


async def fork_group(runner: ModelRunner, executor: Executor, parent: Sequence, children: list[Sequence]) -> None:
    """Fork ``parent`` into ``children``: their pages taken here, on the event loop (the one thread
    that changes the allocators), their KV filled on the model ``executor``. On any failure, a
    cancel included, the parent's and the children's pages go back, never before the executor's
    job has returned (it reads and writes them): a cancel raises at once, and the pages follow
    from the job's done callback, on the loop too."""
    group = [parent] + children
    try:
        fork_pages(runner, parent, children)
    except BaseException:
        _release_group(runner, group)
        raise
    job = asyncio.get_running_loop().run_in_executor(executor, fork_kv, runner, parent, children)
    try:
        await asyncio.shield(job)
    except BaseException:
        if job.done():
            _release_group(runner, group, job)
        else:
            job.add_done_callback(lambda done: _release_group(runner, group, done))
        raise


def _release_group(runner: ModelRunner, seqs: list[Sequence], job: asyncio.Future | None = None) -> None:
    if job is not None and not job.cancelled():
        job.exception()  # read: a job that failed after its request was cancelled is no "unretrieved" error
    for seq in seqs:
        runner.release(seq)


def fork_pages(runner: ModelRunner, parent: Sequence, children: list[Sequence]) -> None:
    """Give each child its pages (see the module doc): the shared ones, its own copy of the last
    prompt page, the rest, in both pools alike. Raises OverloadedError, taking nothing, when a pool
    is short. Allocator work: call it on the thread that owns the allocators (the event loop)."""
    last = _last_prompt_page(runner, parent)
    needed = sum(runner.pages_for(c) - last for c in children)
    runner.make_room(needed)  # cached prefixes nobody uses give way
    for slot in runner.slots:
        if slot.allocator.num_free < needed:
            raise OverloadedError(f"request_id={parent.request_id}: n={len(children) + 1} completions need "
                                  f"{needed} more KV pages, the pool has {slot.allocator.num_free}; retry later")
    for child in children:
        own = runner.pages_for(child) - last
        child.pages = runner.target.allocator.share(parent.pages[:last]) + runner.target.allocator.allocate(own)
        if runner.draft is not None:
            child.draft_pages = (runner.draft.allocator.share(parent.draft_pages[:last])
                                 + runner.draft.allocator.allocate(own))


def fork_kv(runner: ModelRunner, parent: Sequence, children: list[Sequence]) -> None:
    """Fill the children's KV from the parent's (pages from ``fork_pages``): the parent's draft KV
    first when the prefill did not write it, then each child's copy of the last prompt page. Runs
    on the model executor; touches no allocator."""
    last = _last_prompt_page(runner, parent)
    if runner.draft is not None and parent.draft_num_cached < parent.num_prompt_tokens:
        runner.prefill_draft([parent])
    for child in children:
        runner.target.copy_page(parent.pages[last], child.pages[last])
        if runner.draft is not None:
            runner.draft.copy_page(parent.draft_pages[last], child.draft_pages[last])
        child.num_cached = child.draft_num_cached = parent.num_prompt_tokens - 1
        if parent.grammar is not None:  # structured output: its own matcher, at the grammar's start
            child.grammar = parent.grammar.fresh()


def _last_prompt_page(runner: ModelRunner, seq: Sequence) -> int:
    return (seq.num_prompt_tokens - 1) // runner.page_size
