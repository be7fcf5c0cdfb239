"""Incremental detokenization against a real byte-level BPE tokenizer trained here."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvferry.common.text.detok import REPLACEMENT_CHAR, IncrementalDetokenizer, StreamingOutput
from kvferry.common.sampling.sampler import SamplingParams

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Café déjà vu: naïve façade, crème brûlée, São Paulo, Zürich, Ångström.",
    "東京は日本の首都です。北京欢迎你！서울은 한국의 수도입니다.",
    "Emoji time 🎉🚀👍🏽 and family 👨‍👩‍👧 with flags 🇫🇷🇯🇵.",
    "Mixed: 价格 is €42, ½ off — “quoted” ‘text’ … done ✓.",
    "Ελληνικά και русский язык, עברית, العربية.",
]
SPECIAL_TOKENS = ["<|eos|>", "<|pad|>"]
# The tokenizer fixture is module-scoped and read-only, so reusing it across examples is safe.
FIXTURE_OK = [HealthCheck.function_scoped_fixture]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A small vocabulary leaves most multi-byte characters split across several tokens.
    trainer = trainers.BpeTrainer(vocab_size=340, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(SENTENCES * 3, trainer)
    return tok


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], prompt: list[int] | None = None,
            skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok.decode, prompt, skip_special_tokens)
    deltas, start = [], 0
    for size in chunks:
        if start >= len(ids):
            break
        deltas.append(detok.add(ids[start:start + size]))
        start += size
    deltas.append(detok.add(ids[start:]))
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def _check(tok: Tokenizer, ids: list[int], chunks: list[int], prompt: list[int] | None,
           skip_special_tokens: bool) -> None:
    deltas = _stream(tok, ids, chunks, prompt, skip_special_tokens)
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == full
    if REPLACEMENT_CHAR not in full:
        assert not any(REPLACEMENT_CHAR in d for d in deltas), deltas


def test_real_sentences_stream_exactly_one_token_at_a_time(tokenizer):
    for sentence in SENTENCES:
        ids = tokenizer.encode(sentence).ids
        assert len(ids) > 8
        deltas = _stream(tokenizer, ids, [1] * len(ids))
        assert "".join(deltas) == sentence
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_split_emoji_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🎉").ids
    assert len(ids) > 1, "the emoji should span several tokens in this small vocabulary"
    detok = IncrementalDetokenizer(tokenizer.decode)
    deltas = [detok.add([i]) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🎉"


def test_prompt_context_does_not_leak_into_output(tokenizer):
    prompt = tokenizer.encode("Zürich 東京").ids
    output = tokenizer.encode(" 👍🏽 déjà").ids
    assert "".join(_stream(tokenizer, output, [1] * len(output), prompt)) == " 👍🏽 déjà"
    # A prompt cut inside a character gives its bytes no say over the output's first token.
    cut_prompt = tokenizer.encode("東").ids[:1]
    assert "".join(_stream(tokenizer, output, [2] * len(output), cut_prompt)) == " 👍🏽 déjà"


def test_many_random_sequences(tokenizer):
    rng = random.Random(1234)
    vocab_size = tokenizer.get_vocab_size()
    for _ in range(300):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(0, 40))]
        chunks = [rng.randrange(1, 4) for _ in range(len(ids))]
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randrange(0, 8))] or None
        _check(tokenizer, ids, chunks, prompt, skip_special_tokens=rng.random() < 0.5)


@settings(max_examples=300, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.data())
def test_hypothesis_random_ids(tokenizer, data):
    vocab_size = tokenizer.get_vocab_size()
    token = st.integers(min_value=0, max_value=vocab_size - 1)
    ids = data.draw(st.lists(token, max_size=48), label="ids")
    chunks = data.draw(st.lists(st.integers(min_value=1, max_value=5), max_size=48),
                       label="chunks")
    prompt = data.draw(st.one_of(st.none(), st.lists(token, min_size=1, max_size=10)),
                       label="prompt")
    _check(tokenizer, ids, chunks, prompt, data.draw(st.booleans(), label="skip_special"))


ALPHABET = "".join(sorted(set("".join(SENTENCES)))) + "🦀ÿ中"


@settings(max_examples=300, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.data())
def test_hypothesis_valid_text_streams_without_replacement_chars(tokenizer, data):
    # Random ids almost always decode to invalid UTF-8; this draws valid text instead, so the
    # "no U+FFFD in a delta" half of the property is exercised on every example.
    text = data.draw(st.text(alphabet=ALPHABET, max_size=40), label="text")
    ids = tokenizer.encode(text).ids
    chunks = data.draw(st.lists(st.integers(min_value=1, max_value=4), max_size=len(ids)),
                       label="chunks")
    deltas = _stream(tokenizer, ids, chunks)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas), deltas


@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.data())
def test_hypothesis_stop_strings_stream_the_trimmed_text(tokenizer, data):
    sentence = data.draw(st.sampled_from(SENTENCES), label="sentence")
    ids = tokenizer.encode(sentence).ids
    start = data.draw(st.integers(0, len(sentence) - 1), label="start")
    stop = sentence[start:start + data.draw(st.integers(1, 4), label="length")]
    params = SamplingParams(stop=(stop, "never-present"), max_new_tokens=len(ids))
    out = StreamingOutput(tokenizer.decode, params, eos_token_ids=[0])
    sent, step_size = "", data.draw(st.integers(1, 3), label="step")
    for begin in range(0, len(ids), step_size):
        step = out.add(ids[begin:begin + step_size])
        sent += step.delta
        # A delta may never contain the stop string or anything after where it starts.
        assert sentence.startswith(sent) and len(sent) <= sentence.find(stop)
        if step.finish is not None:
            break
    assert out.finish.to_sglang() == {"type": "stop", "matched": stop}
    assert sent == out.text == sentence[:sentence.find(stop)]
    assert out.output_ids == ids[:len(out.output_ids)]
