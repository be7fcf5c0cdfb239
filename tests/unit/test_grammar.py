"""Structured output on the tiny model: masks, matchers, the compile cache, and constrained
generation through the colocated engine (the runner's prefill and decode paths)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvferry.common.engine.colocated import ColocatedEngine
from kvferry.common.errors import RequestError
from kvferry.common.sampling.grammar import ANY_JSON, DraftMasks, GrammarCache, GrammarSpec, mask_logits
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.text.tokenizer import Tokenizer
from tests.cluster import tiny_model_dirs, tiny_runner
from tests.json_schema_check import errors

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"type": "string", "enum": ["cat", "dog", "none"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}
ANSWER = r"(yes|no), [0-9]{1,3}"
PROMPTS = ["Hello there", "The capital of France is", "Write a short story about a dog"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dirs()[0])


@pytest.fixture(scope="module")
def cache(tokenizer) -> GrammarCache:
    return GrammarCache(tokenizer, tokenizer.vocab_size)


@pytest.fixture(scope="module")
def engines(tokenizer) -> dict[bool, ColocatedEngine]:
    return {draft: ColocatedEngine(tiny_runner(draft=draft), tokenizer) for draft in (False, True)}


def allowed(matcher, vocab_size: int) -> set[int]:
    logits = mask_logits(torch.zeros(1, vocab_size), [matcher])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def spec(kind: str, text: str) -> GrammarSpec:
    return GrammarSpec(kind, text, f"sampling_params.{kind}")


def test_mask_allows_exactly_the_tokens_that_continue_the_grammar(cache, tokenizer):
    matcher = cache.matcher(spec("regex", "(yes|no)"))
    special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    texts = {i: tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.vocab_size)}
    want = {i for i, text in texts.items()
            if i not in special and text and ("yes".startswith(text) or "no".startswith(text))}
    assert want and allowed(matcher, tokenizer.vocab_size) == want


def test_stop_token_only_where_the_grammar_is_complete(cache, tokenizer):
    matcher = cache.matcher(spec("regex", "(yes|no)"))
    eos = set(tokenizer.eos_token_ids)
    assert not eos & allowed(matcher, tokenizer.vocab_size)
    for token in tokenizer.encode("no", add_special_tokens=False):
        assert matcher.accept(token)
    assert allowed(matcher, tokenizer.vocab_size) == eos  # "no" cannot grow: a stop token only
    assert matcher.accept(tokenizer.eos_token_ids[0]) and matcher.is_terminated


def test_rejected_token_is_an_error_and_special_tokens_never_pass(cache, tokenizer):
    matcher = cache.matcher(spec("json_schema", json.dumps(PERSON)))
    bos = tokenizer.bos_token_id
    assert bos not in allowed(matcher, tokenizer.vocab_size)
    assert not matcher.accept(tokenizer.encode("x", add_special_tokens=False)[0])
    assert "sampling_params.json_schema" in matcher.error and matcher.is_done


def test_tokenizer_info_is_xgrammars_own_but_for_special_tokens(tokenizer):
    """Built from `tokenizers` alone, it equals xgrammar's from_huggingface (through transformers)
    except that special tokens are empty, so that no grammar can produce them as text."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    from kvferry.common.sampling.grammar import tokenizer_info

    hf = PreTrainedTokenizerFast.from_pretrained(tiny_model_dirs()[0])
    size = tokenizer.vocab_size + 8
    theirs = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=size, stop_token_ids=list(tokenizer.eos_token_ids))
    ours = tokenizer_info(tokenizer, size)
    assert (ours.vocab_type, ours.add_prefix_space, ours.stop_token_ids) == (
        theirs.vocab_type, theirs.add_prefix_space, theirs.stop_token_ids)
    special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    differ = {i for i, (a, b) in enumerate(zip(ours.decoded_vocab, theirs.decoded_vocab)) if a != b}
    assert special and differ == special and all(ours.decoded_vocab[i] == b"" for i in special)


def test_model_vocab_past_the_tokenizer_is_masked(tokenizer):
    padded = GrammarCache(tokenizer, tokenizer.vocab_size + 40)
    ids = allowed(padded.matcher(spec("json_schema", ANY_JSON)), tokenizer.vocab_size + 40)
    assert ids and max(ids) < tokenizer.vocab_size


def test_unconstrained_rows_and_batches_are_untouched(cache):
    logits = torch.randn(3, 512)
    assert mask_logits(logits, [None, None, None]) is logits
    masked = mask_logits(logits.clone(), [None, cache.matcher(spec("regex", "a")), None])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert torch.isinf(masked[1]).sum() > 0


@pytest.mark.parametrize("kind,text,words", [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", '{"type": "frog"}', "not a valid JSON schema"),
    ("regex", "(ab", "not a valid regular expression"),
    ("ebnf", "root ::= ", "not a valid EBNF grammar"),
])
def test_invalid_grammar_names_the_field(cache, kind, text, words):
    with pytest.raises(RequestError) as info:
        cache.compile(spec(kind, text))
    message = str(info.value)
    assert message.startswith(f"sampling_params.{kind} ") and words in message
    assert "/project/" not in message  # xgrammar's source-file prefix is dropped


def test_cache_is_a_bounded_lru_keyed_by_kind_and_text(tokenizer):
    cache = GrammarCache(tokenizer, tokenizer.vocab_size, max_entries=2)
    a, b, c = spec("regex", "a"), spec("regex", "b"), spec("ebnf", 'root ::= "a"')
    first = cache.compile(a)
    cache.compile(b)
    assert cache.compile(GrammarSpec("regex", "a", "response_format")) is first  # the field is no part of the key
    cache.compile(c)  # evicts b, the least recently used
    assert len(cache) == 2 and cache.cached(b) is None and cache.cached(a) is first


def test_json_schema_generation_parses_and_validates(engines):
    engine = engines[False]
    schema = spec("json_schema", json.dumps(PERSON))
    for params in (SamplingParams(max_new_tokens=300, temperature=0, grammar=schema),
                   SamplingParams(max_new_tokens=300, temperature=1.0, seed=7, grammar=schema)):
        for result in engine.generate(PROMPTS, params):
            assert result.finish_reason["type"] == "stop", result
            assert errors(json.loads(result.text), PERSON) == []


def test_regex_generation_matches_fully_with_and_without_eos(engines):
    engine = engines[False]
    for ignore_eos in (False, True):
        params = SamplingParams(max_new_tokens=40, temperature=0.8, seed=3, ignore_eos=ignore_eos,
                                grammar=spec("regex", ANSWER))
        for result in engine.generate(PROMPTS, params):
            assert re.fullmatch(ANSWER, result.text), result.text
            assert result.finish_reason["type"] == "stop"


def test_truncated_output_is_a_prefix_the_grammar_accepts(engines, cache, tokenizer):
    params = SamplingParams(max_new_tokens=6, temperature=0, grammar=spec("json_schema", json.dumps(PERSON)))
    for result in engines[False].generate(PROMPTS, params):
        assert result.finish_reason == {"type": "length", "length": 6}
        matcher = cache.matcher(spec("json_schema", json.dumps(PERSON)))
        assert all(matcher.accept(t) for t in result.output_ids)


def test_speculation_under_the_grammar_gives_plain_constrained_decoding(engines):
    """The draft proposes and the target verifies under each row's grammar: greedy tokens are those
    of plain constrained decoding, with drafts proposed for constrained and free rows alike."""
    grammar = spec("json_schema", json.dumps(PERSON))
    constrained = SamplingParams(max_new_tokens=200, temperature=0, grammar=grammar)
    answer = SamplingParams(max_new_tokens=40, temperature=0, grammar=spec("regex", ANSWER))
    free = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    params = [constrained, answer, free]
    plain = engines[False].generate(PROMPTS, params)
    speculative = engines[True].generate(PROMPTS, params)
    assert [r.output_ids for r in speculative] == [r.output_ids for r in plain]
    assert all(r.num_proposed > 0 for r in speculative)
    assert errors(json.loads(speculative[0].text), PERSON) == []


def test_draft_masks_are_the_grammar_after_each_proposal_and_leave_the_matcher_as_it_was(cache, tokenizer):
    matchers = [cache.matcher(spec("regex", "(yes|no), [0-9]+")), None]
    proposals = tokenizer.encode("no, 4", add_special_tokens=False)
    k = len(proposals)
    masks = DraftMasks(matchers, k)
    for step, token in enumerate(proposals):
        drafted = masks.draft(torch.zeros(2, tokenizer.vocab_size), step)
        assert torch.isfinite(drafted[0, token]) and torch.isfinite(drafted[1]).all()
        masks.accept(0, token)
    masks.close()
    verified = masks.verify([torch.zeros(k + 1, tokenizer.vocab_size) for _ in range(2)])
    reference = cache.matcher(spec("regex", "(yes|no), [0-9]+"))
    for j in range(k + 1):  # row j: the grammar after proposals[:j]
        want = allowed(reference, tokenizer.vocab_size)
        assert set(torch.isfinite(verified[0][j]).nonzero().flatten().tolist()) == want
        if j < k:
            assert reference.accept(proposals[j])
    assert torch.isfinite(verified[1]).all()
    fresh = cache.matcher(spec("regex", "(yes|no), [0-9]+"))
    assert allowed(matchers[0], tokenizer.vocab_size) == allowed(fresh, tokenizer.vocab_size)  # rolled back


def test_sampled_speculation_under_the_grammar_stays_inside_it(engines):
    params = SamplingParams(max_new_tokens=300, temperature=1.0, seed=5,
                            grammar=spec("json_schema", json.dumps(PERSON)))
    for result in engines[True].generate(PROMPTS, params):
        assert result.finish_reason["type"] == "stop" and result.num_proposed > 0
        assert errors(json.loads(result.text), PERSON) == []
    for result in engines[True].generate(PROMPTS, SamplingParams(max_new_tokens=40, temperature=0.9, seed=2,
                                                                 grammar=spec("regex", ANSWER))):
        assert re.fullmatch(ANSWER, result.text), result.text


def test_request_fields_become_one_grammar_spec():
    from kvferry.common.api.sampling_schema import openai_params, sglang_params

    assert sglang_params({"regex": "a+"}).grammar == GrammarSpec("regex", "a+", "sampling_params.regex")
    assert sglang_params({"json_schema": ANY_JSON, "regex": None}).grammar.text == ANY_JSON
    assert sglang_params({"ebnf": 'root ::= "a"'}).grammar.kind == "ebnf"
    assert sglang_params({}).grammar is None
    assert openai_params({"response_format": {"type": "text"}}, chat=True).grammar is None
    json_object = openai_params({"response_format": {"type": "json_object"}}, chat=False).grammar
    assert json_object == GrammarSpec("json_schema", '{"type": "object"}', "response_format")
    body = {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "schema": PERSON, "strict": True, "description": None}}}
    schema = openai_params(body, chat=True).grammar
    assert (schema.kind, json.loads(schema.text), schema.field) == ("json_schema", PERSON,
                                                                    "response_format.json_schema.schema")
    assert openai_params({"regex": "[0-9]"}, chat=False).grammar == GrammarSpec("regex", "[0-9]", "regex")


def test_min_tokens_with_a_constraint_is_refused_naming_it():
    """min_tokens masks the stop tokens; a grammar complete before then would leave no token."""
    from kvferry.common.api.sampling_schema import openai_params, sglang_params

    with pytest.raises(RequestError, match=r"^sampling_params\.min_new_tokens cannot be combined with an output"):
        sglang_params({"regex": "a", "min_new_tokens": 2})
    with pytest.raises(RequestError, match=r"^min_tokens cannot be combined with an output constraint \(response"):
        openai_params({"response_format": {"type": "json_object"}, "min_tokens": 1}, chat=True)
    assert openai_params({"regex": "a", "min_tokens": 0}, chat=False).grammar is not None


def test_forked_completions_each_follow_the_grammar(engines, tokenizer):
    """n > 1: a fork (common/engine/fork.py) gets its own matcher at the grammar's start, and its
    first token, sampled by its first decode step, is masked and then advances it."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from kvferry.common.engine.batcher import DecodeBatcher
    from kvferry.common.engine.output import OutputTracker
    from kvferry.common.engine.sequence import Sequence
    from kvferry.common.sampling.sampler import make_generator
    from tests.unit.control_plane import run
    from tests.unit.test_fork import fork_checked

    engine = engines[True]
    runner = engine.runner
    params = SamplingParams(max_new_tokens=40, temperature=1.0, grammar=spec("regex", ANSWER))
    prompt = tokenizer.encode(PROMPTS[0])
    parent = engine.new_sequence(prompt, params)
    runner.admit(parent)
    runner.prefill([parent])
    children = [Sequence(f"c{i}", list(prompt), params, generator=make_generator(i, "cpu")) for i in range(3)]
    fork_checked(runner, parent, children)  # fails if the draft's KV is not forked (output cannot show it)
    assert all(c.grammar is not None and c.grammar is not parent.grammar for c in children)

    async def main():
        with ThreadPoolExecutor(1) as executor:
            batcher = DecodeBatcher(runner, executor, max_running=8, on_finish=runner.release)
            batcher.start()
            try:
                trackers = [OutputTracker(s, tokenizer.decode, tokenizer.eos_token_ids) for s in [parent] + children]
                jobs = [batcher.submit(t.seq, t, needs_draft_prefill=False) for t in trackers]
                for job in jobs:
                    for _ in range(100):
                        if (await asyncio.wait_for(job.queue.get(), 30)).finished:
                            break
                return [t.text for t in trackers]
            finally:
                await batcher.stop()

    for text in run(main()):
        assert re.fullmatch(ANSWER, text), text


def test_cache_reports_each_lookup(tokenizer):
    seen = []
    cache = GrammarCache(tokenizer, tokenizer.vocab_size, observe=lambda result, s: seen.append(result))
    cache.compile(spec("regex", "ab"))
    cache.matcher(spec("regex", "ab"))
    with pytest.raises(RequestError):
        cache.compile(spec("regex", "(ab"))
    assert seen == ["compiled", "cached", "invalid"]
