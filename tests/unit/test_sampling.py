"""Sampling parameters, the probability transform, the sampler and stop checking."""

from __future__ import annotations

import math

import pytest
import torch

from kvferry.common.errors import RequestError
from kvferry.common.text.detok import StreamingOutput
from kvferry.common.sampling.sampler import Sampler, SamplingParams, make_generator, probs
from kvferry.common.sampling.stops import FinishReason, StopChecker
from kvferry.common.api.sampling_schema import openai_params, sglang_params

torch.set_num_threads(1)

VOCAB_SIZE = 100


@pytest.mark.parametrize(
    ("changes", "field", "allowed"),
    [
        ({"temperature": -0.5}, "temperature", ">= 0"),
        ({"temperature": math.inf}, "temperature", "finite"),
        ({"temperature": math.nan}, "temperature", "finite"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", ">= -1"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"min_p": 1.01}, "min_p", "[0, 1]"),
        ({"max_new_tokens": -1}, "max_new_tokens", ">= 0"),
        ({"seed": -1}, "seed", "[0, 2**63)"),
        ({"seed": 2**63}, "seed", "[0, 2**63)"),
        ({"stop": ("",)}, "stop", "non-empty"),
        ({"stop": tuple(f"s{i}" for i in range(17))}, "stop", "at most 16"),
        ({"n": 0}, "n", "[1, 32]"),
        ({"stop_token_ids": (VOCAB_SIZE,)}, "stop_token_ids", f"[0, {VOCAB_SIZE})"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids", f"[0, {VOCAB_SIZE})"),
    ],
)
def test_validate_names_field_and_range(changes, field, allowed):
    with pytest.raises(RequestError) as info:
        SamplingParams(**changes).validate(VOCAB_SIZE)
    message = str(info.value)
    assert message.startswith(field), message
    assert allowed in message, message


def test_validate_context_limit_names_both_values():
    assert SamplingParams(max_new_tokens=24).validate(VOCAB_SIZE, max_context_tokens=32,
                                                      prompt_tokens=8) is None  # exactly the context
    with pytest.raises(RequestError, match=r"prompt tokens \(9\) \+ max_new_tokens \(24\)"):
        SamplingParams(max_new_tokens=24).validate(VOCAB_SIZE, max_context_tokens=32,
                                                   prompt_tokens=9)


# Each edge value next to the first value past it: the edge is accepted (validate returns None,
# the params keep the value), the one past it is refused naming the field.
EDGES = [
    ("max_new_tokens", 0, -1),
    ("top_k", -1, -2),
    ("temperature", 0.0, -1e-9),
    ("top_p", 1.0, 1.0000001),
    ("top_p", 1e-9, 0.0),
    ("min_p", 1.0, 1.0000001),
    ("min_p", 0.0, -1e-9),
    ("seed", 2**63 - 1, 2**63),
    ("seed", 0, -1),
    ("stop", tuple(f"s{i}" for i in range(16)), tuple(f"s{i}" for i in range(17))),
    ("stop_token_ids", (0, VOCAB_SIZE - 1), (0, VOCAB_SIZE)),
    ("repetition_penalty", 2.0, 2.0000001),
    ("repetition_penalty", 1e-9, 0.0),
    ("frequency_penalty", -2.0, -2.0000001),
    ("presence_penalty", 2.0, 2.0000001),
    ("min_new_tokens", 128, 129),  # max_new_tokens is 128
    ("min_new_tokens", 0, -1),
    ("logit_bias", ((0, -100.0), (VOCAB_SIZE - 1, 100.0)), ((0, -100.0001),)),
    ("logit_bias", tuple((i, 1.0) for i in range(VOCAB_SIZE)), ((VOCAB_SIZE, 1.0),)),
    ("logit_bias", (), ((-1, 1.0),)),
]


@pytest.mark.parametrize("field,edge,past", EDGES, ids=[f"{e[0]}={e[1]!r:.12}" for e in EDGES])
def test_validate_accepts_edges_and_refuses_the_next_value(field, edge, past):
    params = SamplingParams(**{field: edge})
    assert params.validate(VOCAB_SIZE) is None
    assert getattr(params, field) == edge
    with pytest.raises(RequestError, match=rf"^{field} must be"):
        SamplingParams(**{field: past}).validate(VOCAB_SIZE)


def test_validate_accepts_fractional_top_p_as_clients_send_it():
    params = SamplingParams(temperature=0.0, top_p=0.8999999761581421, min_p=1.0)  # float32 0.9
    assert params.validate(VOCAB_SIZE) is None
    assert params.top_p == 0.8999999761581421


def test_from_sglang_maps_fields():
    params = sglang_params({
        "max_new_tokens": 7, "temperature": 0.8999999761581421, "top_p": 0.95, "top_k": 20,
        "min_p": 0.05, "stop": "###", "stop_token_ids": [3, 4], "ignore_eos": True,
        "skip_special_tokens": False, "n": 1, "sampling_seed": 42, "no_stop_trim": True,
        "frequency_penalty": 0.5, "presence_penalty": -1, "repetition_penalty": 1.25,
        "regex": None, "json_schema": None, "spaces_between_special_tokens": False,
        "logit_bias": {"7": -100, "3": 2.5}, "min_new_tokens": 2, "min_tokens": 0,
    })
    assert params == SamplingParams(
        max_new_tokens=7, temperature=0.8999999761581421, top_p=0.95, top_k=20, min_p=0.05,
        stop=("###",), stop_token_ids=(3, 4), ignore_eos=True, skip_special_tokens=False,
        seed=42, no_stop_trim=True, frequency_penalty=0.5, presence_penalty=-1.0,
        repetition_penalty=1.25, logit_bias=((3, 2.5), (7, -100.0)), min_new_tokens=2)
    assert sglang_params({}) == SamplingParams()
    assert sglang_params({"temperature": None, "stop": None}) == SamplingParams()
    assert sglang_params({"seed": 5, "max_new_tokens": 16.0}).seed == 5
    assert sglang_params({"stop": ["a", "b"]}).stop == ("a", "b")


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        ({"temprature": 0.5}, r"unknown keys \['temprature'\]"),
        ({"best_of": 1, "foo": 1, "bar": 2}, r"unknown keys \['bar', 'foo'\]"),
        ({"temperature": "hot"}, r"sampling_params\.temperature must be a number, got str"),
        ({"max_new_tokens": 1.5}, r"sampling_params\.max_new_tokens must be an integer, got float"),
        ({"max_new_tokens": True}, r"max_new_tokens must be an integer, got bool"),
        ({"ignore_eos": "yes"}, r"sampling_params\.ignore_eos must be a boolean, got str"),
        ({"stop": [1]}, r"sampling_params\.stop must be a string or a list of strings, got list"),
        ({"stop_token_ids": ["a"]}, r"sampling_params\.stop_token_ids\[0\] must be an integer"),
        ({"frequency_penalty": 2.5}, r"^frequency_penalty must be in \[-2, 2\] \(0 is off\), got 2\.5"),
        ({"repetition_penalty": 0}, r"^repetition_penalty must be in \(0, 2\] \(1 is off\)"),
        ({"max_new_tokens": 4, "min_new_tokens": 5}, r"^min_new_tokens must be in \[0, max_new_tokens=4\]"),
        ({"min_tokens": 2}, r"min_tokens=2 is not supported; send 0"),
        ({"logit_bias": {"x": 1}}, r"sampling_params\.logit_bias keys must be token ids .*got 'x'"),
        ({"logit_bias": {"5": "up"}}, r"sampling_params\.logit_bias\.5 must be a number, got str"),
        ({"logit_bias": [5]}, r"sampling_params\.logit_bias must be an object from token ids to biases"),
        ({"structural_tag": "a"}, r"structural_tag='a' is not supported"),
        ({"regex": "a+", "ebnf": "root ::= \"a\""}, r"^sampling_params\.regex, sampling_params\.ebnf: a request takes at most one"),
        ({"json_schema": {"type": "object"}}, r"^sampling_params\.json_schema must be a string \(the JSON schema"),
        ({"spaces_between_special_tokens": 1}, r"spaces_between_special_tokens must be a boolean"),
        ({"n": 33}, r"^n must be in \[1, 32\]"),
        ({"top_p": 0}, r"^top_p must be in \(0, 1\]"),
        ({"sampling_seed": -4}, r"^sampling_seed must be in \[0, 2\*\*63\)"),
    ],
)
def test_from_sglang_rejects(body, pattern):
    with pytest.raises(RequestError, match=pattern):
        sglang_params(body)


def test_from_openai_maps_fields():
    body = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 9, "temperature": 0.5,
            "top_p": 0.9, "stop": "\n", "seed": 3, "n": 1, "top_k": 5, "min_p": 0.1,
            "ignore_eos": True, "stop_token_ids": [2], "frequency_penalty": 0,
            "logit_bias": {}, "user": "u", "logprobs": None}
    assert openai_params(body, chat=False) == SamplingParams(
        max_new_tokens=9, temperature=0.5, top_p=0.9, stop=("\n",), seed=3, top_k=5, min_p=0.1,
        ignore_eos=True, stop_token_ids=(2,))
    asking = {"repetition_penalty": 0.5, "presence_penalty": 2, "frequency_penalty": -2,
              "logit_bias": {"11": 100.0}, "min_tokens": 3, "max_tokens": 5}
    assert openai_params(asking, chat=True) == SamplingParams(
        max_new_tokens=5, repetition_penalty=0.5, presence_penalty=2.0, frequency_penalty=-2.0,
        logit_bias=((11, 100.0),), min_new_tokens=3)
    chat = {"messages": [], "max_tokens": 9, "max_completion_tokens": 11, "stop": ["a", "b"]}
    params = openai_params(chat, chat=True)
    assert (params.max_new_tokens, params.stop) == (11, ("a", "b"))
    assert openai_params({}, chat=False).max_new_tokens == 16
    assert openai_params({}, chat=True).max_new_tokens == 128
    assert openai_params({}, chat=True, default_max_new_tokens=50).max_new_tokens == 50
    assert openai_params({"response_format": {"type": "text"}}, chat=True)


@pytest.mark.parametrize(
    ("body", "chat", "pattern"),
    [
        ({"max_tokens": "10"}, False, r"^max_tokens must be an integer, got str"),
        ({"max_tokens": -1}, False, r"^max_tokens must be >= 0"),
        ({"max_completion_tokens": -1}, True, r"^max_completion_tokens must be >= 0"),
        ({"n": 0}, True, r"^n must be in \[1, 32\]"),
        ({"stop": 5}, True, r"^stop must be a string or a list of strings, got int"),
        ({"seed": "x"}, True, r"^seed must be an integer, got str"),
        ({"temperature": -1}, True, r"^temperature must be >= 0"),
        ({"presence_penalty": -2.5}, True, r"^presence_penalty must be in \[-2, 2\]"),
        ({"logit_bias": {"5": 101}}, False, r"^logit_bias must be an object of biases in \[-100, 100\], got \{'5': 101"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, False, r"^logit_bias must be an object of at most 300"),
        ({"min_tokens": 17}, False, r"^min_tokens must be in \[0, max_tokens=16\]"),
        ({"min_tokens": 9, "max_completion_tokens": 8}, True, r"^min_tokens must be in \[0, max_completion_tokens=8\]"),
        ({"best_of": 3}, False, r"best_of=3 is not supported"),
        ({"response_format": {"type": "regex"}}, True, r"^response_format\.type must be one of \['text', 'json_object'"),
        ({"guided_regex": "a"}, True, r"guided_regex='a' is not supported"),
    ],
)
def test_from_openai_rejects(body, chat, pattern):
    with pytest.raises(RequestError, match=pattern):
        openai_params(body, chat=chat)


def _logits(batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_probs_and_sampler_are_argmax():
    logits = _logits(6, 50)
    greedy = [SamplingParams(temperature=0.0)] * 6
    expected = logits.argmax(dim=-1)
    assert torch.equal(probs(logits, greedy), torch.nn.functional.one_hot(expected, 50).float())
    token_ids, logprobs = Sampler().sample(logits, greedy, [None] * 6)
    assert torch.equal(token_ids, expected)
    expected_logprobs = torch.log_softmax(logits, -1).gather(-1, expected[:, None])[:, 0]
    assert torch.allclose(logprobs, expected_logprobs)


@pytest.mark.parametrize("params", [SamplingParams(top_k=1, temperature=1.3),
                                    SamplingParams(top_p=1e-6, temperature=1.3),
                                    SamplingParams(min_p=1.0, temperature=1.3)])
def test_degenerate_filters_equal_greedy(params):
    logits = _logits(8, 40, seed=1)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), 40).float()
    assert torch.allclose(probs(logits, [params] * 8), one_hot)
    generators = [make_generator(i, "cpu") for i in range(8)]
    token_ids, _ = Sampler().sample(logits, [params] * 8, generators)
    assert torch.equal(token_ids, logits.argmax(-1))


def test_top_k_top_p_min_p_keep_the_right_tokens():
    base = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[None, :]
    logits = base.repeat(4, 1)
    out = probs(logits, [SamplingParams(top_k=2), SamplingParams(top_p=0.7),
                         SamplingParams(min_p=0.25), SamplingParams(top_k=3, top_p=0.9)])
    torch.testing.assert_close(out[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(out[1], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # min_p 0.25 of the top 0.5 drops everything under 0.125.
    torch.testing.assert_close(out[2], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    # top-k 3 renormalizes to 0.526/0.316/0.158; the first two hold 0.842 < 0.9, so 3 stay.
    torch.testing.assert_close(out[3], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_probs_rows_are_independent_of_batch():
    logits = _logits(5, 30, seed=2)
    params = [SamplingParams(temperature=0.7, top_k=10), SamplingParams(temperature=0.0),
              SamplingParams(top_p=0.8), SamplingParams(min_p=0.1, temperature=2.0),
              SamplingParams(temperature=1.0)]
    batched = probs(logits, params)
    for i, p in enumerate(params):
        torch.testing.assert_close(batched[i], probs(logits[i:i + 1], [p])[0])
    torch.testing.assert_close(batched.sum(-1), torch.ones(5))
    expected_row0 = torch.softmax(logits[0] / 0.7, -1)
    expected_row0[expected_row0 < expected_row0.topk(10).values[-1]] = 0
    torch.testing.assert_close(batched[0], expected_row0 / expected_row0.sum())


def test_sampled_frequencies_match_probs():
    # 40,000 draws of an 8-token vocabulary with a fixed seed. Tolerance: chi-square p-value above
    # 1e-3 over the kept tokens, total variation below 0.01, and no draw outside the kept set.
    num_draws, vocab = 40_000, 8
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -4.0]])
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.97, seed=7)
    target = probs(logits, [params])[0].double()
    generator = make_generator(params.seed, "cpu")
    token_ids, _ = Sampler().sample(logits.expand(num_draws, vocab), [params] * num_draws,
                                    [generator] * num_draws)
    counts = torch.bincount(token_ids, minlength=vocab).double()
    kept = target > 0
    assert counts[~kept].sum() == 0
    expected = target[kept] * num_draws
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum()
    dof = int(kept.sum()) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), chi2 / 2)
    assert p_value > 1e-3, (chi2, counts, expected)
    assert 0.5 * (counts / num_draws - target).abs().sum() < 0.01


def _run_steps(rows: list[tuple[SamplingParams, int]], position: int, num_steps: int) -> list[int]:
    """Sample num_steps tokens for a batch; return row `position`'s tokens. Each row's logits
    depend only on the row's own id, so the tracked row sees the same logits in any batch."""
    generators = [make_generator(p.seed, "cpu") if p.seed is not None else None for p, _ in rows]
    sampler, tokens = Sampler(), []
    for step in range(num_steps):
        logits = torch.cat([_logits(1, 50, seed=1000 * row_id + step) for _, row_id in rows])
        token_ids, _ = sampler.sample(logits, [p for p, _ in rows], generators)
        tokens.append(int(token_ids[position]))
    return tokens


def test_seeded_request_is_reproducible_whatever_its_neighbours():
    tracked = (SamplingParams(temperature=1.0, top_p=0.95, seed=1234), 0)
    alone = _run_steps([tracked], 0, 20)
    neighbours = [(SamplingParams(temperature=0.0), 1), (SamplingParams(temperature=1.5), 2),
                  (SamplingParams(temperature=0.9, seed=99), 3)]
    assert _run_steps(neighbours[:2] + [tracked] + neighbours[2:], 2, 20) == alone
    assert _run_steps([tracked] + neighbours, 0, 20) == alone
    other_seed = (SamplingParams(temperature=1.0, top_p=0.95, seed=4321), 0)
    assert _run_steps([other_seed], 0, 20) != alone


TOY_VOCAB = ["<eos>", "Hel", "lo", " wo", "rld", "!", " E", "ND", "E", "N", "D", "\n"]
EOS = 0


def toy_decode(ids: list[int], skip_special_tokens: bool = True) -> str:
    return "".join(TOY_VOCAB[i] for i in ids if not (skip_special_tokens and i == EOS))


def _stream(params: SamplingParams, ids: list[int], step: int = 1) -> tuple[StreamingOutput, str]:
    out, sent = StreamingOutput(toy_decode, params, eos_token_ids=[EOS]), ""
    for start in range(0, len(ids), step):
        result = out.add(ids[start:start + step])
        sent += result.delta
        if result.finish is not None:
            break
    return out, sent


def test_eos_stops_and_ignore_eos_continues():
    out, sent = _stream(SamplingParams(max_new_tokens=10), [1, 2, EOS, 5])
    assert out.finish.to_sglang() == {"type": "stop", "matched": EOS}
    assert (out.finish.openai, out.output_ids, sent, out.text) == ("stop", [1, 2, EOS], "Hello",
                                                                    "Hello")
    out, sent = _stream(SamplingParams(max_new_tokens=4, ignore_eos=True), [1, 2, EOS, 5, 5])
    assert out.finish.to_sglang() == {"type": "length", "length": 4}
    assert (out.finish.openai, out.output_ids, sent) == ("length", [1, 2, EOS, 5], "Hello!")


def test_stop_token_id_is_trimmed_from_text():
    params = SamplingParams(stop_token_ids=(11,))
    out, sent = _stream(params, [1, 2, 11, 3])
    assert out.finish == FinishReason("stop", matched=11)
    assert (out.output_ids, sent) == ([1, 2, 11], "Hello")
    out, sent = _stream(SamplingParams(stop_token_ids=(11,), no_stop_trim=True), [1, 2, 11, 3])
    assert sent == "Hello\n"


def test_stop_string_across_tokens_is_trimmed_and_never_streamed():
    params = SamplingParams(stop=("END",))
    ids = [1, 2, 8, 9, 10, 5]  # "Hello" + "E" + "N" + "D": the stop spans three tokens
    deltas = []
    out = StreamingOutput(toy_decode, params, eos_token_ids=[EOS])
    for token_id in ids:
        step = out.add([token_id])
        deltas.append(step.delta)
        if step.finish:
            break
    assert deltas == ["Hel", "lo", "", "", ""]
    assert out.finish.to_sglang() == {"type": "stop", "matched": "END"}
    assert out.text == "Hello" and out.output_ids == [1, 2, 8, 9, 10]
    # A partial match that breaks off is released: "E" then "!" is plain text.
    out, sent = _stream(SamplingParams(stop=("END",), max_new_tokens=4), [1, 8, 5, 2])
    assert (sent, out.finish.openai) == ("HelE!lo", "length")
    out, sent = _stream(SamplingParams(stop=("END",), no_stop_trim=True), ids)
    assert sent == "HelloEND"


def test_several_tokens_per_step_stop_at_the_first_finish():
    out = StreamingOutput(toy_decode, SamplingParams(), eos_token_ids=[EOS])
    step = out.add([1, 2, EOS, 3, 4])
    assert (step.delta, step.num_tokens, step.finish.matched) == ("Hello", 3, EOS)
    with pytest.raises(RuntimeError, match="already finished"):
        out.add([1])
    out = StreamingOutput(toy_decode, SamplingParams(max_new_tokens=3), eos_token_ids=[EOS])
    step = out.add([1, 2, 3, 4])
    assert (step.delta, step.num_tokens, step.finish.length) == ("Hello wo", 3, 3)
    out = StreamingOutput(toy_decode, SamplingParams(max_new_tokens=0), eos_token_ids=[EOS])
    assert out.finish.to_sglang() == {"type": "length", "length": 0}


def test_stop_checker_check_on_running_text():
    checker = StopChecker(SamplingParams(stop=("rld!",), max_new_tokens=5), eos_token_ids=[EOS])
    assert checker.check([1, 2], "Hello") is None
    assert checker.check([3, 4], "Hello world") is None
    decision = checker.check([5], "Hello world!")
    assert (decision.reason.matched, decision.num_tokens, decision.text) == ("rld!", 1, "Hello wo")
    checker = StopChecker(SamplingParams(max_new_tokens=3), eos_token_ids=[EOS])
    decision = checker.check([1, 2, 3, 4], "Hello world")
    assert (decision.reason.type, decision.num_tokens) == ("length", 3)
    checker = StopChecker(SamplingParams(stop_token_ids=(4,)), eos_token_ids=[EOS])
    assert checker.check([1, 4, 2], "x").num_tokens == 2
