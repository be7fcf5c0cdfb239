"""The real sglang-router (0.3.2, `--pd-disaggregation`) in front of one prefill and one decode.

Every answer the client gets through the router is compared with the colocated engine (greedy):
`/generate` with text and with token ids, batches, `/v1/completions`, `/v1/chat/completions`, SSE
streams (whose final text equals the non-stream text), the prompt logprobs the router merges from
the prefill's answer, and the errors the router turns into stream events. A decode with a draft
model (decode-only speculative decoding) behind its own router gives the same greedy tokens.
"""

from __future__ import annotations

import json

import pytest

from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.api.sampling_schema import openai_params, sglang_params
from tests.cluster import Cluster, assert_pages_return, ok, post

PROMPT = "The ferry leaves the north pier at seven"
MESSAGES = [{"role": "user", "content": "Where does the ferry go?"}]
GREEDY = {"max_new_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_models):
    """(cluster, prefill, decode, router, free pages of both at the start) for the whole module."""
    c = Cluster(tmp_path_factory.mktemp("router-sglang") / "logs", *tiny_models)
    try:
        prefill, decode, before = c.pair()
        yield c, prefill, decode, c.router([prefill], [decode]), before
    finally:
        c.stop_all()


def reference(colocated, prompt, params: SamplingParams, draft: bool = False, **kw):
    return colocated(draft).generate([prompt], params, **kw)[0]


@pytest.mark.parametrize("prompt_key", ["text", "input_ids"])
def test_generate_equals_colocated(pd, colocated, tok, prompt_key):
    router = pd[3]
    prompt = PROMPT if prompt_key == "text" else tok.encode(PROMPT)
    ref = reference(colocated, prompt, sglang_params(GREEDY))
    out = ok(post(router.url + "/generate", {prompt_key: prompt, "sampling_params": GREEDY})).json()
    assert (out["output_ids"], out["text"]) == (ref.output_ids, ref.text)
    assert out["meta_info"]["prompt_tokens"] == len(ref.prompt_ids)
    assert out["meta_info"]["finish_reason"] == ref.finish_reason


def test_generate_stream_ends_with_the_non_stream_text(pd, colocated):
    router = pd[3]
    body = {"text": PROMPT, "sampling_params": GREEDY}
    plain = ok(post(router.url + "/generate", body)).json()
    answer = ok(post(router.url + "/generate", {**body, "stream": True}))
    events = answer.events()
    assert len(events) > 1  # really streamed, token by token
    for ev in events:  # cumulative: each event repeats the text so far
        assert plain["text"].startswith(ev["text"]), ev
    assert (events[-1]["text"], events[-1]["output_ids"]) == (plain["text"], plain["output_ids"])
    ref = reference(colocated, PROMPT, sglang_params(GREEDY))
    assert plain["output_ids"] == ref.output_ids


@pytest.mark.parametrize("stream", [False, True])
def test_completions(pd, colocated, stream):
    router = pd[3]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": stream}
    ref = reference(colocated, PROMPT, openai_params(body, chat=False))
    answer = ok(post(router.url + "/v1/completions", body))
    if stream:
        chunks = answer.events()
        assert all(c["object"] == "text_completion" for c in chunks)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        out = answer.json()
        assert out["object"] == "text_completion"
        assert out["usage"]["prompt_tokens"] == len(ref.prompt_ids)
        assert out["usage"]["completion_tokens"] == len(ref.output_ids)
        text, finish = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
    assert text == ref.text
    assert finish == ref.finish_reason["type"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions(pd, colocated, tok, stream):
    router = pd[3]
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "stream": stream}
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True), add_special_tokens=False)
    # The router renames max_tokens to max_completion_tokens; the limit is the same.
    ref = reference(colocated, ids, openai_params(body, chat=True))
    answer = ok(post(router.url + "/v1/chat/completions", body))
    if stream:
        chunks = answer.events()
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])
    else:
        out = answer.json()
        assert out["choices"][0]["message"]["role"] == "assistant"
        assert out["usage"]["prompt_tokens"] == len(ids)
        text = out["choices"][0]["message"]["content"]
    assert text == ref.text


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_merged_by_the_router(pd, colocated, tok, stream):
    """The router puts the prefill's `input_token_logprobs` in front of the decode's: the decode
    returns the prompt logprobs the prefill sent it and the prefill's list is empty, so there is one
    entry per prompt token, equal to the colocated engine's prompt logprobs. On a stream that needs
    the prefill to answer one JSON object; the router then merges it into every chunk."""
    router = pd[3]
    ids = tok.encode(PROMPT)
    body = {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0,
            "stream": stream}
    ref = reference(colocated, ids, sglang_params(GREEDY), return_logprob=True)
    answer = ok(post(router.url + "/generate", body))
    outs = answer.events() if stream else [answer.json()]
    for out in outs:
        merged = out["meta_info"]["input_token_logprobs"]
        assert len(merged) == len(ids), merged
        assert [t for _, t, _ in merged] == ids
        for (got, _, _), want in zip(merged, ref.input_logprobs):
            assert (got is None) == (want is None), (got, want)
            if want is not None:
                assert got == pytest.approx(want, abs=1e-4)
    last = outs[-1]
    assert last["output_ids"] == ref.output_ids
    assert [lp for lp, _, _ in last["meta_info"]["output_token_logprobs"]] == \
        pytest.approx(ref.output_logprobs, abs=1e-4)


def test_batched_input_ids(pd, colocated, tok):
    """A list of token-id prompts is one request with lists of bootstrap values; the answer is a
    list in prompt order, each equal to the colocated engine's."""
    router = pd[3]
    prompts = [tok.encode(p) for p in ("a short one", PROMPT, "Hello there, ferry")]
    refs = colocated(False).generate(prompts, sglang_params(GREEDY))
    outs = ok(post(router.url + "/generate", {"input_ids": prompts, "sampling_params": GREEDY})).json()
    assert isinstance(outs, list) and len(outs) == len(prompts)
    assert [o["output_ids"] for o in outs] == [r.output_ids for r in refs]
    assert [o["text"] for o in outs] == [r.text for r in refs]


def test_text_batch_is_refused_by_the_router(pd):
    """sglang-router 0.3.2 cannot parse a `text` list and says so itself (docs/routers.md)."""
    router = pd[3]
    answer = post(router.url + "/generate", {"text": ["one", "two"], "sampling_params": GREEDY})
    assert 400 <= answer.status < 500, answer
    assert "text" in answer.raw and "expected a string" in answer.raw, answer.raw


def test_stream_error_reaches_the_client_whole(pd):
    """A client error on a stream: the decode answers 400 chunked (no Content-Length), so the
    router's SSE error event, longer than the decode's body, is not cut short."""
    router = pd[3]
    body = {"text": PROMPT, "stream": True, "sampling_params": {**GREEDY, "top_p": 2.0}}
    answer = post(router.url + "/generate", body)
    assert answer.status == 400 and answer.is_sse, answer
    prefix = "data: {'error': "  # the router's own framing, not JSON
    assert answer.raw.startswith(prefix), answer.raw
    wrapped = json.loads(answer.raw[len(prefix):].rstrip()[:-1])
    assert wrapped["status"] == 400
    error = wrapped["message"]["error"]
    assert error["param"] == "sampling_params.top_p" and "2.0" in error["message"]


def test_pages_return_after_the_module(pd):
    """Everything above left no page allocated on either side (bounded wait: the decode frees a
    finished sequence's pages just after its last event)."""
    _, prefill, decode, router, before = pd
    ok(post(router.url + "/generate", {"text": PROMPT, "sampling_params": GREEDY}))
    assert_pages_return([prefill, decode], before)


def test_decode_only_speculative_behind_the_router(pd, colocated, tok):
    """A decode with a draft (the prefill has none) behind its own router: the prefill writes the
    target KV only, the decode fills the draft's prompt KV itself, and greedy tokens are those of
    plain greedy decoding."""
    c, prefill, *_ = pd
    decode = c.decode(draft=True)
    router = c.router([prefill], [decode])
    prompts = [tok.encode(PROMPT), tok.encode("Hello there, ferry")]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    for ids in prompts:
        out = ok(post(router.url + "/generate", {"input_ids": ids, "sampling_params": params})).json()
        plain = reference(colocated, ids, sglang_params(params))
        speculative = reference(colocated, ids, sglang_params(params), draft=True)
        assert out["output_ids"] == plain.output_ids == speculative.output_ids
        assert out["meta_info"]["spec_num_proposed"] > 0
        assert out["meta_info"]["spec_accept_rate"] == pytest.approx(speculative.acceptance_rate)
