"""n > 1 completions from one prompt KV (common/engine/fork.py) on the tiny checkpoint: greedy
forks repeat the parent's tokens (the fork's first step recomputes the last prompt token on its
own copy of that page), seeded forks are reproducible, shared pages come back only when the last
holder is done, with and without speculative decoding, at and off page boundaries."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvferry.common.engine.batcher import DecodeBatcher
from kvferry.common.engine.fork import fork, fork_kv, fork_pages, pages_for_group
from kvferry.common.engine.output import OutputTracker
from kvferry.common.engine.sequence import Sequence
from kvferry.common.errors import OverloadedError
from kvferry.common.cache.kv_cache import PageAllocator, PageOwnershipError
from kvferry.common.sampling.sampler import SamplingParams, make_generator
from kvferry.common.text.tokenizer import Tokenizer
from tests.cluster import tiny_model_dirs, tiny_runner
from tests.unit.control_plane import run

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=["plain", "spec"])
def runner(request):
    return tiny_runner(draft=request.param == "spec", max_total_tokens=2048)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(tiny_model_dirs()[0])


POISON = 7.0  # what a child's own copy of the last prompt page holds before the fork fills it


def page_items(kv, page: int) -> list:
    """Page ``page`` of every (layer, K|V) region of one pool."""
    return [t[page] for t in kv.tensors()]


def fork_checked(runner, parent: Sequence, children: list[Sequence]) -> None:
    """``fork`` (fork_pages, fork_kv), with each child's own last prompt page poisoned in between,
    then the KV checked: in the target's pool and the draft's, each child shares the parent's full
    prompt pages and holds a copy of its last one. Fails if either pool's ``copy_page`` in
    ``fork_kv`` is skipped (the draft's: output cannot show it, the target verifies every token)."""
    fork_pages(runner, parent, children)
    last = (parent.num_prompt_tokens - 1) // runner.page_size
    pools = [(runner.target.kv, "pages")] + ([(runner.draft.kv, "draft_pages")] if runner.draft is not None else [])
    for kv, attr in pools:
        for child in children:
            for item in page_items(kv, getattr(child, attr)[last]):
                item.fill_(POISON)
    fork_kv(runner, parent, children)
    for kv, attr in pools:
        mine = getattr(parent, attr)
        for child in children:
            theirs = getattr(child, attr)
            assert theirs[:last] == mine[:last] and theirs[last] != mine[last], (kv.model_name, theirs, mine)
            for a, b in zip(page_items(kv, theirs[last]), page_items(kv, mine[last])):
                assert torch.equal(a, b), f"{kv.model_name}: {child.request_id}'s copy of the last prompt page"


def _complete(runner, tokenizer, prompt: list[int], params: SamplingParams, n: int, seeds=None) -> list[list[int]]:
    """One prefill, n completions through the batcher; the token ids of each."""
    device = runner.target.kv.device
    free_before = runner.free_pages()
    parent = Sequence("p", list(prompt), params, generator=make_generator(params.seed, device))
    runner.admit(parent)
    runner.prefill([parent])
    children = [Sequence(f"c{i}", list(prompt), params) for i in range(1, n)]
    fork_checked(runner, parent, children)
    for i, seq in enumerate([parent] + children):
        seq.generator = make_generator(None if seeds is None else seeds[i], device)

    async def main():
        with ThreadPoolExecutor(1) as executor:
            batcher = DecodeBatcher(runner, executor, max_running=8, on_finish=runner.release)
            batcher.start()
            try:
                jobs = [batcher.submit(s, OutputTracker(s, tokenizer.decode, tokenizer.eos_token_ids),
                                       needs_draft_prefill=False) for s in [parent] + children]
                outs = []
                for job in jobs:
                    ids = []
                    for _ in range(200):
                        out = await asyncio.wait_for(job.queue.get(), 30)
                        ids += out.token_ids
                        if out.finished:
                            break
                    outs.append(ids)
                return outs
            finally:
                await batcher.stop()

    outs = run(main())
    assert runner.free_pages() == free_before, "forked pages were not all returned"
    return outs


@pytest.mark.parametrize("prompt_len", [1, 15, 16, 17, 40])
def test_greedy_forks_repeat_the_parent(runner, tokenizer, prompt_len):
    """Fails if ``fork_kv`` skips either pool's ``copy_page`` of the last prompt page (the draft's
    too, which the output cannot show: ``fork_checked`` compares the pages)."""
    prompt = [(13 * i + 5) % 400 + 5 for i in range(prompt_len)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outs = _complete(runner, tokenizer, prompt, params, n=3)
    assert len(outs[0]) == 12 and outs[1] == outs[0] and outs[2] == outs[0]


def test_seeded_forks_are_reproducible_and_their_own(runner, tokenizer):
    prompt = [(7 * i + 3) % 400 + 5 for i in range(23)]
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    first = _complete(runner, tokenizer, prompt, params, n=4, seeds=[11, 12, 13, 14])
    again = _complete(runner, tokenizer, prompt, params, n=4, seeds=[11, 12, 13, 14])
    assert first == again
    assert len({tuple(o) for o in first}) > 1  # four draws at temperature 1 are not all the same


def test_fork_takes_nothing_when_the_pool_is_short(runner):
    prompt = list(range(5, 45))
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    parent = Sequence("p", prompt, params)
    runner.admit(parent)
    try:
        runner.prefill([parent])
        free = runner.free_pages()
        too_many = [Sequence(f"c{i}", prompt, params) for i in range(1, 1000)]
        with pytest.raises(OverloadedError, match="n=1000 completions need"):
            fork(runner, parent, too_many)
        assert runner.free_pages() == free
        assert pages_for_group(runner, parent, 3) == runner.pages_for(parent) + 2 * (runner.pages_for(parent) - 2)
    finally:
        runner.release(parent)


def test_a_shared_page_is_free_after_its_last_holder():
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.share(pages[:1])
    alloc.free(pages)
    assert alloc.num_free == 3
    alloc.free(pages[:1])
    assert alloc.num_free == 4
    with pytest.raises(PageOwnershipError):
        alloc.free(pages[:1])
    with pytest.raises(PageOwnershipError):
        alloc.share([3])
