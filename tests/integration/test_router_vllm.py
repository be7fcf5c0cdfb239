"""The real vllm-router (0.1.17, `--vllm-pd-disaggregation`) in front of one prefill and one decode.

The router calls the prefill first (`max_tokens: 1`, `stream: false`,
`kv_transfer_params.do_remote_decode`); the prefill picks the room and answers
`kv_transfer_params: {bootstrap_host, bootstrap_port, bootstrap_room}`, which the router copies
into the decode's body; the decode fetches the KV from there. Answers through the router equal the
colocated engine's greedy output, streaming and not.
"""

from __future__ import annotations


import pytest

from kvferry.common.api.sampling_schema import openai_params, sglang_params
from tests.cluster import Cluster, assert_pages_return, ok, post

PROMPT = "The ferry leaves the north pier at seven"
MESSAGES = [{"role": "user", "content": "Where does the ferry go?"}]


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_models):
    """(prefill, decode, router, free pages of both at the start) for the whole module."""
    c = Cluster(tmp_path_factory.mktemp("router-vllm") / "logs", *tiny_models)
    try:
        prefill, decode, before = c.pair()
        yield prefill, decode, c.vllm_router([prefill], [decode]), before
    finally:
        c.stop_all()


def check_two_stage_id(response_id: str, prefill, decode) -> None:
    """vllm-router names the request after the pair it chose, the same on both legs; kvferry uses
    that X-Request-Id as the request id, so the answer shows the request took the two-stage path."""
    host_port = lambda p: p.url.removeprefix("http://")  # noqa: E731
    assert f"___prefill_addr_{host_port(prefill)}___decode_addr_{host_port(decode)}_" in response_id


@pytest.mark.parametrize("stream", [False, True])
def test_completions(pd, colocated, stream):
    prefill, decode, router, _ = pd
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": stream}
    ref = colocated(False).generate([PROMPT], openai_params(body, chat=False))[0]
    answer = ok(post(router.url + "/v1/completions", body))
    if stream:
        chunks = answer.events()
        assert len(chunks) > 1 and all(c["object"] == "text_completion" for c in chunks)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish, response_id = chunks[-1]["choices"][0]["finish_reason"], chunks[0]["id"]
    else:
        out = answer.json()
        assert out["usage"] == {"prompt_tokens": len(ref.prompt_ids), "completion_tokens": len(ref.output_ids),
                                "total_tokens": len(ref.prompt_ids) + len(ref.output_ids)}
        text, finish, response_id = out["choices"][0]["text"], out["choices"][0]["finish_reason"], out["id"]
    assert text == ref.text
    assert finish == ref.finish_reason["type"]
    check_two_stage_id(response_id, prefill, decode)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions(pd, colocated, tok, stream):
    prefill, decode, router, _ = pd
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 16, "temperature": 0, "stream": stream}
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True), add_special_tokens=False)
    ref = colocated(False).generate([ids], openai_params(body, chat=True))[0]
    answer = ok(post(router.url + "/v1/chat/completions", body))
    if stream:
        chunks = answer.events()
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])
        response_id = chunks[0]["id"]
    else:
        out = answer.json()
        assert out["usage"]["prompt_tokens"] == len(ids)
        assert out["usage"]["completion_tokens"] == len(ref.output_ids)
        text, response_id = out["choices"][0]["message"]["content"], out["id"]
    assert text == ref.text
    check_two_stage_id(response_id, prefill, decode)


def test_generate_with_token_ids(pd, colocated, tok):
    prefill, decode, router, _ = pd
    ids = tok.encode(PROMPT)
    sampling = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    ref = colocated(False).generate([ids], sglang_params(sampling))[0]
    out = ok(post(router.url + "/generate", {"input_ids": ids, "sampling_params": sampling})).json()
    assert (out["output_ids"], out["text"]) == (ref.output_ids, ref.text)
    check_two_stage_id(out["meta_info"]["id"], prefill, decode)


def test_pages_return(pd):
    """The prefill freed every room it held for a later decode, and the decode every sequence."""
    prefill, decode, _, before = pd
    assert_pages_return([prefill, decode], before)
