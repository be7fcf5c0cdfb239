"""n > 1 through real routers in front of a real prefill/decode pair: the prefill computes the
prompt once, the decode forks its KV into n completions (common/engine/fork.py), and every answer
equals the colocated server's (greedy and seeded), on `/generate` (a list of n objects, as SGLang
answers), `/v1/completions` and `/v1/chat/completions` (n choices; usage counts each prompt once),
streamed and not, through sglang-router and vllm-router, with the official openai SDK; every page
comes back, shared ones included."""

from __future__ import annotations

import openai
import pytest

from tests.cluster import Cluster, assert_pages_return, ok, post

PROMPT = "The ferry leaves the north pier at seven"
MESSAGES = [{"role": "user", "content": "Where does the ferry go?"}]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "n": 3}
SEEDED = {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 5, "n": 4}


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_models):
    """(cluster, prefill, decode, sglang-router, vllm-router, colocated server, free pages at the start)."""
    c = Cluster(tmp_path_factory.mktemp("n-completions") / "logs", *tiny_models)
    try:
        prefill, decode, before = c.pair()
        routers = c.router([prefill], [decode]), c.vllm_router([prefill], [decode])
        yield (c, prefill, decode, *routers, c.colocated_server(), before)
    finally:
        c.stop_all()


def generate(url: str, sampling: dict, stream: bool) -> list[tuple[list[int], str]]:
    """(output ids, text) of each of the n outputs of a /generate answer."""
    answer = ok(post(url + "/generate", {"text": PROMPT, "sampling_params": sampling, "stream": stream}))
    if not stream:
        objs = answer.json()
        assert isinstance(objs, list) and len(objs) == sampling["n"], objs
        return [(o["output_ids"], o["text"]) for o in objs]
    last = {}
    for event in answer.events():  # cumulative objects, each tagged with its output's index
        last[event["index"]] = (event["output_ids"], event["text"])
    assert sorted(last) == list(range(sampling["n"])), sorted(last)
    return [last[i] for i in range(sampling["n"])]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_generate_n_equals_colocated(pd, sampling, stream):
    _, prefill, decode, router, _, colocated, before = pd
    want = generate(colocated.url, sampling, stream)
    got = generate(router.url, sampling, stream)
    assert got == want
    if sampling["temperature"] == 0:
        assert all(out == got[0] for out in got) and len(got[0][0]) == sampling["max_new_tokens"]
    else:
        assert len({tuple(ids) for ids, _ in got}) > 1, got  # n seeded draws, not n copies
    assert_pages_return([prefill, decode], before)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_openai_sdk_n_choices_equal_colocated(pd, chat, stream):
    _, prefill, decode, router, _, colocated, before = pd

    def choices(url: str) -> tuple[list[str], list[str], object]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120, max_retries=0)
        args = {"model": "tiny", "max_tokens": 8, "temperature": 1.0, "seed": 9, "n": 3,
                "extra_body": {"ignore_eos": True}}
        if chat:
            resp = client.chat.completions.create(messages=MESSAGES, stream=stream, **args)
        else:
            resp = client.completions.create(prompt=PROMPT, stream=stream, **args)
        if not stream:
            texts = [c.message.content if chat else c.text for c in sorted(resp.choices, key=lambda c: c.index)]
            return texts, [c.finish_reason for c in resp.choices], resp.usage
        texts, finishes = [""] * 3, [None] * 3
        for chunk in resp:
            for c in chunk.choices:
                texts[c.index] += (c.delta.content or "") if chat else c.text
                finishes[c.index] = c.finish_reason or finishes[c.index]
        return texts, finishes, None

    want, got = choices(colocated.url), choices(router.url)
    assert got[0] == want[0] and got[1] == want[1] and all(f == "length" for f in got[1])
    if not stream:
        one = openai.OpenAI(base_url=colocated.url + "/v1", api_key="none", timeout=120, max_retries=0)
        args = {"model": "tiny", "max_tokens": 8, "temperature": 0}
        single = (one.chat.completions.create(messages=MESSAGES, **args) if chat
                  else one.completions.create(prompt=PROMPT, **args)).usage
        assert got[2].prompt_tokens == single.prompt_tokens  # the prompt counts once
        assert got[2].completion_tokens == 3 * 8 and got[2].total_tokens == single.prompt_tokens + 24
    assert_pages_return([prefill, decode], before)


def test_completions_prompt_list_with_n_orders_choices_by_prompt(pd):
    _, prefill, decode, router, _, colocated, before = pd
    body = {"model": "tiny", "prompt": [PROMPT, "A second prompt"], "max_tokens": 6, "temperature": 0, "n": 2}
    got = ok(post(router.url + "/v1/completions", body)).json()
    want = ok(post(colocated.url + "/v1/completions", body)).json()
    texts = [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])]
    assert texts == [c["text"] for c in sorted(want["choices"], key=lambda c: c["index"])]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]
    assert_pages_return([prefill, decode], before)


def test_vllm_router_serves_n(pd):
    _, prefill, decode, _, vllm_router, colocated, before = pd
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 4, "n": 2}
    got = ok(post(vllm_router.url + "/v1/completions", body)).json()
    want = ok(post(colocated.url + "/v1/completions", body)).json()
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    assert len(got["choices"]) == 2
    assert_pages_return([prefill, decode], before)


def test_n_out_of_range_is_a_400_naming_it(pd):
    router = pd[3]
    answer = post(router.url + "/generate", {"text": PROMPT, "sampling_params": {"n": 33, "max_new_tokens": 2}})
    assert answer.status == 400 and "n must be in [1, 32]" in answer.raw, answer.raw[:500]
    answer = post(router.url + "/v1/completions", {"model": "tiny", "prompt": PROMPT, "n": 0})
    assert answer.status == 400 and "n must be in [1, 32]" in answer.raw, answer.raw[:500]


def test_forks_with_a_draft_on_the_decode(pd):
    """Speculative decoding on the decode: the draft's prompt KV is filled once and forked too;
    greedy forks equal the colocated server's (which runs no draft), and each fork's draft accepts
    as many tokens as the unforked request's (they generate the same tokens from the same draft
    KV). Fails if the fork skips the draft's copy of the last prompt page (``copy_page`` in
    ``fork_kv``): the target still verifies every token, but that fork's draft proposes from
    another page and accepts fewer."""
    c, prefill, _, _, _, colocated, _ = pd
    decode = c.decode(draft=True)
    router = c.router([prefill], [decode])
    want = generate(colocated.url, GREEDY, False)
    for stream in (False, True):
        assert generate(router.url, GREEDY, stream) == want
    long = {**GREEDY, "max_new_tokens": 24, "ignore_eos": True}
    accepted = []
    for n in (1, 3):
        objs = ok(post(router.url + "/generate", {"text": PROMPT, "sampling_params": {**long, "n": n}})).json()
        accepted.append([o["meta_info"]["spec_num_accepted"] for o in (objs if n > 1 else [objs])])
    assert accepted[1] == accepted[0] * 3, accepted
    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "n": 2}
    got = ok(post(router.url + "/v1/chat/completions", chat)).json()["choices"]
    ref = ok(post(colocated.url + "/v1/chat/completions", chat)).json()["choices"]
    assert [x["message"]["content"] for x in got] == [x["message"]["content"] for x in ref]
