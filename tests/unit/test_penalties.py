"""Penalties, logit bias and min_tokens (common/sampling/penalties.py) against a plain reference of
vLLM's definitions written here, row by row and token by token: the logit maths, the sampler on
mixed batches (rows with and without, greedy and seeded), the device-side token history, the
engine (plain, speculative and overlapped decoding) against a reference decode loop, and the stop
rules before min_tokens."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from kvferry.common.engine.colocated import ColocatedEngine
from kvferry.common.engine.penalty_inputs import decode_adjust, prefill_adjust, record_accepted, verify_logits
from kvferry.common.engine.sequence import Sequence
from kvferry.common.models.llama import SeqChunk
from kvferry.common.sampling.penalties import RowRequest, TokenHistory, build_adjust
from kvferry.common.sampling.sampler import Sampler, SamplingParams, make_generator, probs
from kvferry.common.sampling.stops import StopChecker
from kvferry.common.text.tokenizer import Tokenizer
from tests.cluster import tiny_model_dirs, tiny_runner

torch.set_num_threads(1)

VOCAB = 64
EOS = (1, 4)
ASKING = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6, frequency_penalty=0.4, presence_penalty=-0.75),
    SamplingParams(frequency_penalty=-1.25, logit_bias=((3, 7.5), (9, -100.0))),
    SamplingParams(min_new_tokens=5, stop_token_ids=(7, 11)),
    SamplingParams(min_new_tokens=5, ignore_eos=True, stop_token_ids=(7,), presence_penalty=2.0),
    SamplingParams(logit_bias=((0, 100.0),), repetition_penalty=2.0, min_new_tokens=1),
]


def reference(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams,
              eos=EOS) -> list[float]:
    """vLLM's order and definitions, one token at a time, in Python floats."""
    out = list(logits)
    if len(output) < p.min_new_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            out[t] = -math.inf
    for t, bias in p.logit_bias:
        out[t] += bias
    counts = Counter(output)
    for t, x in enumerate(out):
        if t in counts or t in prompt:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * counts[t]
        if counts[t] > 0:
            x -= p.presence_penalty
        out[t] = x
    return out


def _case(seed: int, num_rows: int = 8):
    rng = random.Random(seed)
    logits = torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    rows = []
    for i in range(num_rows):
        params = rng.choice(ASKING + [SamplingParams()])
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 9))]
        rows.append((params, prompt, output))
    return logits, rows


def _sequences(rows) -> list[Sequence]:
    seqs = []
    for i, (params, prompt, output) in enumerate(rows):
        seq = Sequence(f"r{i}", list(prompt), params, output_ids=list(output))
        seq.num_cached = seq.num_tokens - 1  # decoding: the newest token is fed by this step
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("seed", range(6))
def test_decode_adjust_equals_the_reference(seed):
    logits, rows = _case(seed)
    history = TokenHistory(VOCAB, "cpu", EOS)
    seqs = _sequences(rows)
    adjust = decode_adjust(seqs, history)
    got = adjust.apply(logits) if adjust is not None else logits
    for i, (params, prompt, output) in enumerate(rows):
        want = torch.tensor(reference(logits[i].tolist(), prompt, output, params))
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5, msg=f"row {i}: {params}")
    # rows that ask for nothing are untouched, bit for bit
    for i, (params, _, _) in enumerate(rows):
        if params == SamplingParams():
            assert torch.equal(got[i], logits[i])


def test_prefill_adjust_counts_the_prompt_only():
    logits, rows = _case(11)
    seqs = [Sequence(f"r{i}", prompt, params) for i, (params, prompt, _) in enumerate(rows)]
    adjust = prefill_adjust(seqs, TokenHistory(VOCAB, "cpu", EOS))
    got = adjust.apply(logits)
    for i, (params, prompt, _) in enumerate(rows):
        want = torch.tensor(reference(logits[i].tolist(), prompt, [], params))
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_verify_positions_count_the_proposals_before_them(seed):
    """A verify step's position j is adjusted as if the proposals d[:j] were output already (their
    counts, and min_tokens' count); record_accepted then counts the step's output tokens."""
    _, rows = _case(200 + seed, num_rows=6)
    rng, k = random.Random(seed), 4
    rows = [(ASKING[i % len(ASKING)], prompt, output) for i, (_, prompt, output) in enumerate(rows)]
    seqs = _sequences(rows)
    proposals = [[rng.choice([3, 7, 9, rng.randrange(VOCAB)]) for _ in range(k)] for _ in seqs]
    target = [torch.randn(k + 1, VOCAB, generator=torch.Generator().manual_seed(seed + i)) * 3 for i in range(len(seqs))]
    history = TokenHistory(VOCAB, "cpu", EOS)
    chosen = verify_logits(seqs, proposals, target, history)
    for i, (params, prompt, output) in enumerate(rows):
        for j in range(k + 1):
            want = torch.tensor(reference(target[i][j].tolist(), prompt, output + proposals[i][:j], params))
            torch.testing.assert_close(chosen[i][j], want, rtol=1e-5, atol=1e-5, msg=f"row {i} position {j}")
    accepted = [d[:2] + [5] for d in proposals]
    record_accepted(seqs, accepted, history)
    for s, (_, _, output), new in zip(seqs, rows, accepted):
        if s.history_row is not None:
            assert history.counts[s.history_row].tolist() == [Counter(output + new)[t] for t in range(VOCAB)]


def test_a_batch_that_asks_for_nothing_builds_nothing():
    history = TokenHistory(VOCAB, "cpu", EOS)
    seqs = _sequences([(SamplingParams(temperature=t), [1, 2], [3]) for t in (0.0, 0.7)])
    assert decode_adjust(seqs, history) is None
    assert prefill_adjust(seqs, history) is None
    assert verify_logits(seqs, [[1, 2], [3, 4]], [torch.zeros(3, VOCAB)] * 2, history) is None
    assert history.num_rows == 0  # nothing allocated either
    # min_tokens already reached and nothing else: no change left to make
    assert build_adjust([RowRequest(0, SamplingParams(min_new_tokens=2), 2)], history) is None


@pytest.mark.parametrize("seed", range(4))
def test_sampler_on_a_mixed_batch(seed):
    """Greedy and seeded rows, with and without adjustments: each row's token is the one the
    reference logits give (argmax, or the same seeded draw from `probs`), and its logprob stays
    log_softmax of the raw logits."""
    logits, rows = _case(100 + seed)
    temps = [0.0 if i % 2 == 0 else 0.8 for i in range(len(rows))]
    rows = [(SamplingParams(**{**_fields(p), "temperature": t, "top_k": 20, "seed": 7 + i}), prompt, output)
            for i, ((p, prompt, output), t) in enumerate(zip(rows, temps))]
    seqs = _sequences(rows)
    history = TokenHistory(VOCAB, "cpu", EOS)
    generators = [make_generator(p.seed, "cpu") for p, _, _ in rows]
    tokens, logprobs = Sampler().sample(logits, [p for p, _, _ in rows], generators, decode_adjust(seqs, history))
    for i, (params, prompt, output) in enumerate(rows):
        ref = torch.tensor([reference(logits[i].tolist(), prompt, output, params)])
        if params.is_greedy:
            want = int(ref.argmax())
        else:
            want = int(torch.multinomial(probs(ref, [params])[0], 1, generator=make_generator(params.seed, "cpu")))
        assert int(tokens[i]) == want, (i, params)
        assert float(logprobs[i]) == pytest.approx(float(torch.log_softmax(logits[i], -1)[want]), abs=1e-5)


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in ("repetition_penalty", "frequency_penalty", "presence_penalty",
                                       "logit_bias", "min_new_tokens", "stop_token_ids", "ignore_eos")}


def test_history_counts_picks_on_the_device_and_reuses_rows():
    history = TokenHistory(VOCAB, "cpu", EOS)
    seqs = _sequences([(SamplingParams(frequency_penalty=1.0), [5, 6], [7, 7]), (SamplingParams(), [1], [2]),
                       (SamplingParams(repetition_penalty=1.5), [8], [])])
    adjust = decode_adjust(seqs, history)
    assert [s.history_row for s in seqs] != [None, None, None] and seqs[1].history_row is None
    adjust.record(torch.tensor([7, 9, 3]))
    a, c = seqs[0].history_row, seqs[2].history_row
    assert history.counts[a, 7] == 3 and history.counts[a].sum() == 3
    assert history.counts[c].nonzero().flatten().tolist() == [3]
    assert history.in_prompt[a].nonzero().flatten().tolist() == [5, 6]
    rows_before = history.num_rows
    history.release(a)
    assert history.acquire([1], [2, 2]) == a and history.num_rows == rows_before
    assert history.counts[a, 2] == 2 and history.counts[a, 7] == 0
    for _ in range(20):  # grows past its first rows, keeping theirs
        history.acquire([], [])
    assert history.num_rows >= 22 and history.counts[c, 3] == 1


# -- the engine against a reference decode loop ------------------------------------------------

ENGINE_PARAMS = [
    SamplingParams(max_new_tokens=12, temperature=0.0, repetition_penalty=1.8),
    SamplingParams(max_new_tokens=12, temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_new_tokens=12, temperature=0.0, logit_bias=((300, 8.0), (301, 4.0)), presence_penalty=2.0),
    SamplingParams(max_new_tokens=12, temperature=0.0, repetition_penalty=0.5, min_new_tokens=6),
]
PROMPTS = [[(11 * i + 5 * j) % 400 + 5 for j in range(5 + 7 * i)] for i in range(len(ENGINE_PARAMS))]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(tiny_model_dirs()[0])


@pytest.fixture(scope="module")
def engines(tokenizer):
    return {"plain": ColocatedEngine(tiny_runner(draft=False, max_total_tokens=8192), tokenizer),
            "speculative": ColocatedEngine(tiny_runner(draft=True, max_total_tokens=8192), tokenizer)}


def reference_greedy(runner, prompt: list[int], params: SamplingParams, eos) -> list[int]:
    """Each token from a forward over the whole text so far, adjusted by `reference`."""
    out: list[int] = []
    while len(out) < params.max_new_tokens:
        seq = Sequence("reference", prompt + out, SamplingParams())
        runner.admit(seq, prompt_only=True)
        try:
            logits = runner.target.forward([SeqChunk(seq.prompt_ids, 0, seq.pages)])[0]
        finally:
            runner.release(seq)
        adjusted = reference(logits.tolist(), prompt, out, params, eos)
        out.append(max(range(len(adjusted)), key=adjusted.__getitem__))
        is_stop = out[-1] in params.stop_token_ids or (out[-1] in eos and not params.ignore_eos)
        if is_stop and len(out) > params.min_new_tokens:
            break
    return out


@pytest.mark.parametrize("kind", ["plain", "speculative"])
def test_engine_greedy_equals_the_reference_loop(engines, tokenizer, kind):
    """One batch mixing every kind of request; the speculative engine verifies each draft position
    under the adjustments, so its tokens are the plain ones."""
    got = engines[kind].generate(PROMPTS, ENGINE_PARAMS)
    runner = engines["plain"].runner
    for prompt, params, result in zip(PROMPTS, ENGINE_PARAMS, got):
        assert result.output_ids == reference_greedy(runner, prompt, params, tokenizer.eos_token_ids), params
    assert runner.history.num_free == runner.history.num_rows  # every row back with its pages


def test_the_penalties_change_greedy_output(engines):
    plain = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    base = engines["plain"].generate(PROMPTS[:1], plain)[0].output_ids
    for params in ENGINE_PARAMS[:2]:
        assert engines["plain"].generate(PROMPTS[:1], params)[0].output_ids != base, params


def test_min_tokens_holds_back_a_forced_eos(engines, tokenizer):
    eos = tokenizer.eos_token_ids[0]
    forced = SamplingParams(max_new_tokens=10, temperature=0.0, logit_bias=((eos, 100.0),))
    early = engines["plain"].generate(PROMPTS[:1], forced)[0]
    assert early.output_ids == [eos] and early.finish_reason == {"type": "stop", "matched": eos}
    for kind in ("plain", "speculative"):
        late = engines[kind].generate(PROMPTS[:1], SamplingParams(**{**_kw(forced), "min_new_tokens": 5}))[0]
        assert len(late.output_ids) == 6 and late.output_ids[-1] == eos, kind
        assert not set(late.output_ids[:5]) & set(tokenizer.eos_token_ids)
        assert late.finish_reason == {"type": "stop", "matched": eos}


def _kw(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


def test_overlapped_decoding_equals_one_step_at_a_time(tokenizer):
    """The history is counted on the device, so a step launched before the previous step's token
    reached the host sees it (tests/unit/test_batcher.py drives the batcher both ways). Fails if
    ``DecodeBatcher._can_overlap`` returns False: ``_generate`` asserts two steps were launched and
    unread at once."""
    from tests.unit.test_batcher import _generate

    runner = tiny_runner(draft=False)
    params = [SamplingParams(**{**_kw(p), "max_new_tokens": 9 + i}) for i, p in enumerate(ENGINE_PARAMS)]
    params.append(SamplingParams(max_new_tokens=8, temperature=0.9, seed=5, frequency_penalty=2.0,
                                 logit_bias=((17, 3.0),)))
    want, _ = _generate(runner, tokenizer, overlap=False, params=params)
    got, _ = _generate(runner, tokenizer, overlap=True, params=params)
    assert {rid: ids for rid, (ids, _, _) in got.items()} == {rid: ids for rid, (ids, _, _) in want.items()}


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "speculative"])
def test_forked_completions_repeat_the_parent_under_penalties(tokenizer, draft):
    """n > 1 (common/engine/fork.py): a fork samples its own first token at its first decode step,
    with no output yet (its history starts from the prompt alone, min_tokens counts from 0), so
    greedy forks repeat the parent's tokens. Fails, with a draft, if the fork skips the draft's
    ``copy_page`` (``_complete`` forks through test_fork.fork_checked, which checks the KV)."""
    from tests.unit.test_fork import _complete

    runner = tiny_runner(draft=draft, max_total_tokens=2048)
    eos = tokenizer.eos_token_ids[0]
    forced = SamplingParams(max_new_tokens=10, temperature=0.0, logit_bias=((eos, 100.0),), min_new_tokens=5,
                            repetition_penalty=1.5)
    for params in (ENGINE_PARAMS[1], ENGINE_PARAMS[3], forced):
        outs = _complete(runner, tokenizer, PROMPTS[2], params, n=3)
        assert outs[1] == outs[0] and outs[2] == outs[0], params
    assert len(outs[0]) == 6 and outs[0][-1] == eos
    assert runner.history.num_free == runner.history.num_rows


# -- stops before min_tokens --------------------------------------------------------------------

def test_no_stop_is_honoured_before_min_tokens():
    checker = StopChecker(SamplingParams(min_new_tokens=3, stop=("ab",), stop_token_ids=(9,)), eos_token_ids=(1,))
    assert checker.check_token(1) is None and checker.check_token(9) is None
    assert checker.check_text("xab") is None  # a stop string inside the first 3 tokens' text
    assert checker.check_token(5) is None
    assert checker.check_text("xabyy") is None  # its old match is not found later either
    assert checker.check_token(9).matched == 9  # the fourth token
    late = StopChecker(SamplingParams(min_new_tokens=1, stop=("ab",)), eos_token_ids=(1,))
    late.check_token(5)
    assert late.check_text("a") is None
    late.check_token(6)
    assert late.check_text("ab")[0].matched == "ab"  # ends after the first token: honoured
