"""A prompt prefilled over prefix-cached pages (the extend path) gives what a full prefill gives.

A runner with the prefix cache runs P1 (prefill, greedy decode steps), caches its pages and
releases it; P2, sharing a prefix of several pages with P1, is admitted with a hit, so its prefill
computes only the uncached suffix over P1's pages. A fresh runner without a cache prefills P2
whole in one forward (``logprob_start_len`` 1: every prompt row's logits). Compared:

- the hit (``cached_tokens``) and that the cached run's forward really starts there;
- the first token and its logprob, the last prompt row's logits (plain prefill: the head pass);
- every logits row of the uncached suffix and its prompt logprobs (a second admission asking for
  prompt logprobs from the hit on, ``prefill_worker.pipeline._max_hit``'s limit);
- greedy decode steps after it (tokens exactly, logprobs within the bound);
- with the draft (``draft=True``): the draft's last prompt row from ``prefill_draft`` over the
  draft's cached pages, and the speculative steps' tokens.

Cases (page size ps, P1 = 4ps - 3 prompt tokens + 8 decoded): the hit ends on a page boundary where
P2 diverges (``boundary``, P2 = 5ps tokens), P2 diverges mid-page so the shared partial page is
recomputed (``mid_page``), P2 repeats P1's prompt (``repeat``: all but the last page hit), and P2
continues P1's conversation so the hit holds KV written by decode (and spec) steps
(``conversation``).

Bounds, torch path on CPU in float32 (O(10) logits of the tiny checkpoint): where the hit's K/V came
from P1's prefill, the suffix's logits rows, its prompt logprobs and the draft's last row are
bitwise equal to the full prefill's (asserted equal: each side runs one forward of its own shape,
and each output row sums in the same order); every other value within max abs 1e-4. Not bitwise
there: the last row of a plain prefill comes from a one-row lm_head GEMM against the full
prefill's n-row one, and in ``conversation`` decode steps wrote some of the hit's K/V one row at a
time; measured here at most 7e-6.
``tests/gpu/test_prefix_extend_gpu.py`` runs the same on CUDA with the Triton kernels.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
import torch

from kvferry.common.engine.sequence import Sequence
from kvferry.common.sampling.sampler import SamplingParams

CPU_TOL = 1e-4
NUM_P1_OUT = 8  # P1's decoded tokens: its last three prompt-page positions are written by decode
NUM_P2_OUT = 6
CASES = ["boundary", "mid_page", "repeat", "conversation", "long_turn"]
# Bitwise on the CPU where the hit's K/V came from P1's prefill: the suffix's rows (one all-logits
# forward each side) and the draft's last row (a last-row forward each side)
CPU_EXACT = frozenset({"suffix_rows", "prompt_logprobs", "draft_last_row"})


@dataclass
class Record:
    """Each forward of a slot: (start, number of tokens) of its chunks, and its logits on the CPU
    in float32 (a [V] row per chunk, or with ``all_logits`` a [rows, V] per chunk)."""

    calls: list[tuple[list[tuple[int, int]], bool, list[torch.Tensor]]] = field(default_factory=list)


def record(slot) -> Record:
    """Wrap ``slot.forward`` (a ``ModelSlot``) so that every call is kept in the returned Record."""
    rec, inner = Record(), slot.forward

    def forward(chunks, *, all_logits=False, feed=None):
        out = inner(chunks, all_logits=all_logits, feed=feed)
        rows = [o.float().cpu().clone() for o in out]
        rec.calls.append(([(c.start_pos, len(c.token_ids)) for c in chunks], all_logits, rows))
        return out

    slot.forward = forward
    return rec


def params(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def decode_until(runner, seq: Sequence, num: int) -> None:
    """Greedy steps until ``seq`` has ``num`` output tokens (a speculative step may add several)."""
    while len(seq.output_ids) < num:
        for tok, lp, *_ in runner.decode([seq])[0]:
            seq.output_ids.append(tok)
            seq.output_logprobs.append(lp)


def fresh_tokens(rng: random.Random, num: int, avoid: int | None = None) -> list[int]:
    """``num`` random ids of the tiny vocabulary (past its special tokens), the first not ``avoid``."""
    out = [rng.randrange(5, 500) for _ in range(num)]
    if out and out[0] == avoid:
        out[0] = 5 + (avoid - 4) % 495
    return out


def p1_prompt(ps: int, seed: int = 0) -> list[int]:
    return fresh_tokens(random.Random(seed), 4 * ps - 3)


def prompts(ps: int, case: str, p1_out: list[int], seed: int = 0) -> tuple[list[int], list[int], int]:
    """(P1's prompt, P2, the hit P2's admission must find), for page size ``ps``; P1 decoded ``p1_out``."""
    rng = random.Random(seed + 1)
    p1 = p1_prompt(ps, seed)
    p1_all = p1 + p1_out
    if case == "boundary":  # diverges right after 3 whole pages; 5 whole pages in all
        shared = 3 * ps
        return p1, p1[:shared] + fresh_tokens(rng, 2 * ps, avoid=p1_all[shared]), 3 * ps
    if case == "mid_page":  # diverges half way into page 4: that page is recomputed, last page partial
        shared = 3 * ps + ps // 2
        return p1, p1[:shared] + fresh_tokens(rng, ps + 7, avoid=p1_all[shared]), 3 * ps
    if case == "repeat":  # the same prompt: every whole page but the one holding its last token
        return p1, list(p1), 3 * ps
    if case == "conversation":  # P1's prompt and answer, then more: 4 pages, 3 positions decode wrote
        assert len(p1_all) > 4 * ps, "P1 must have decoded past its last prompt page"
        return p1, p1_all + fresh_tokens(rng, 9), 4 * ps
    if case == "long_turn":  # the conversation's next turn of 300 tokens: one chunk past 256 (SDPA on CUDA)
        assert len(p1_all) > 4 * ps, "P1 must have decoded past its last prompt page"
        return p1, p1_all + fresh_tokens(rng, 300), 4 * ps
    raise ValueError(case)


@dataclass
class Run:
    seq: Sequence
    prompt_rows: torch.Tensor | None  # [n - first row, V]: the logits of the asked prompt rows
    last_row: torch.Tensor            # [V]: the last prompt row's logits, the first token's
    draft_last: torch.Tensor | None   # [V]: the draft's last prompt row (prefill_draft)
    target_chunks: list[tuple[int, int]]  # (start, tokens) of the prefill's target forwards


def prefill_and_decode(runner, prompt: list[int], *, max_hit: int, logprob_start: int | None,
                       num_out: int, rid: str, cache: bool = False) -> Run:
    """Admit ``prompt`` (a hit of at most ``max_hit`` tokens), prefill it (with its draft), decode to
    ``num_out`` tokens (0: none), release it; ``cache``: put its pages into the prefix cache first
    (the target's and the draft's KV, as a daemon does with a finished sequence).
    ``logprob_start``: ask for prompt logprobs from there."""
    seq = Sequence(rid, list(prompt), params(max(num_out, 1)))
    if logprob_start is not None:
        seq.input_logprobs, seq.logprob_start_len = [], logprob_start
    runner.admit(seq, max_hit=max_hit)
    target, draft = record(runner.target), record(runner.draft) if runner.draft is not None else None
    try:
        runner.prefill([seq], with_draft=True)
    finally:
        del runner.target.forward  # the class's forward again
        if runner.draft is not None:
            del runner.draft.forward
    prompt_rows = next((rows[0] for _, all_logits, rows in target.calls if all_logits), None)
    _, all_logits, out = target.calls[-1]
    last_row = out[0][-1] if all_logits else out[0]  # [rows, V] per chunk, or a [V] row per chunk
    draft_last = draft.calls[-1][2][0] if draft is not None and draft.calls else None
    if num_out:
        decode_until(runner, seq, num_out)
    if cache:
        assert runner.cache_tokens(seq) > 0
    runner.release(seq)
    chunks = [c for chunks, _, _ in target.calls for c in chunks]
    return Run(seq, prompt_rows, last_row, draft_last, chunks)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def compare_extend(make_runner, ps: int, case: str, tol: float, exact: frozenset[str] = frozenset(),
                   relative: bool = False) -> dict[str, float]:
    """The whole comparison for one case (``make_runner(cache=...)`` gives a fresh runner); returns
    the largest differences seen. Those named in ``exact`` must be 0 (bitwise), the rest <= ``tol``
    (``relative``: ``tol`` times the reference's largest abs logit, returned as ``logit_scale``)."""
    runner = make_runner(cache=True)
    p1 = p1_prompt(ps)
    first = prefill_and_decode(runner, p1, max_hit=len(p1) - 1, logprob_start=None, num_out=NUM_P1_OUT, rid="p1",
                               cache=True)
    assert first.seq.cached_tokens == 0
    p1_out = first.seq.output_ids[:NUM_P1_OUT]
    assert len(p1_out) == NUM_P1_OUT
    p1_again, p2, hit = prompts(ps, case, p1_out)
    assert p1_again == p1
    n = len(p2)
    # the reference: P2 prefilled whole on a runner without a cache, every prompt row's logits
    ref = prefill_and_decode(make_runner(cache=False), p2, max_hit=0, logprob_start=1, num_out=NUM_P2_OUT, rid="ref")
    assert ref.seq.cached_tokens == 0 and ref.target_chunks == [(0, n)]
    assert ref.prompt_rows.shape[0] == n

    # plain prefill over the hit, then decode
    got = prefill_and_decode(runner, p2, max_hit=n - 1, logprob_start=None, num_out=NUM_P2_OUT, rid="p2")
    assert got.seq.cached_tokens == hit and got.target_chunks == [(hit, n - hit)]
    # the same with prompt logprobs from the hit on: all the suffix's rows in one extend forward
    rows = prefill_and_decode(runner, p2, max_hit=hit, logprob_start=hit + 1, num_out=0, rid="p2-rows")
    assert rows.seq.cached_tokens == hit and rows.target_chunks == [(hit, n - hit)]

    assert got.seq.output_ids[:NUM_P2_OUT] == ref.seq.output_ids[:NUM_P2_OUT]
    assert rows.seq.output_ids[0] == ref.seq.output_ids[0]
    diffs = {
        "last_row": max_diff(got.last_row, ref.prompt_rows[-1]),
        "suffix_rows": max_diff(rows.prompt_rows, ref.prompt_rows[hit:]),
        "first_logprob": abs(got.seq.output_logprobs[0] - ref.seq.output_logprobs[0]),
        "prompt_logprobs": max(abs(a - b) for a, b in zip(rows.seq.input_logprobs[hit + 1:],
                                                         ref.seq.input_logprobs[hit + 1:])),
        "decode_logprobs": max(abs(a - b) for a, b in zip(got.seq.output_logprobs[:NUM_P2_OUT],
                                                         ref.seq.output_logprobs[:NUM_P2_OUT])),
    }
    assert rows.seq.input_logprobs[:hit + 1] == [None] * (hit + 1) and len(rows.seq.input_logprobs) == n
    assert all(v is not None for v in ref.seq.input_logprobs[1:])
    if ref.draft_last is not None:
        assert got.draft_last is not None
        diffs["draft_last_row"] = max_diff(got.draft_last, ref.draft_last)
    scale = float(ref.prompt_rows.abs().max())
    bound = tol * scale if relative else tol
    for name, value in diffs.items():
        assert math.isfinite(value) and value <= (0.0 if name in exact else bound), (case, ps, name, value, bound)
    diffs["logit_scale"] = scale
    return diffs


@pytest.fixture(scope="module")
def make_cpu_runner():
    from tests.cluster import tiny_runner

    def make(*, draft: bool, cache: bool):
        runner = tiny_runner(draft=draft, max_total_tokens=2048)
        if cache:
            runner.enable_prefix_cache()
        return runner
    return make


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("draft", [False, True], ids=["plain", "draft"])
def test_extend_over_cached_pages_equals_full_prefill(make_cpu_runner, draft, case):
    """Fails if the extend path reads the cached pages at the wrong positions or the hit's pages
    hold other KV (e.g. the draft's KV left out of the cache: ``draft_last_row``)."""
    def make(*, cache):
        return make_cpu_runner(draft=draft, cache=cache)
    diffs = compare_extend(make, 16, case, CPU_TOL, CPU_EXACT if case not in ("conversation", "long_turn")
                           else frozenset())
    print(case, draft, {k: f"{v:.2e}" for k, v in diffs.items()})
