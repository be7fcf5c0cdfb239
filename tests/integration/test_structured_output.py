"""Structured output through the real sglang-router in front of one prefill and two decodes (one
with a draft model, behind its own router): OpenAI `response_format` (json_object, json_schema)
on chat and completions, `/generate` `regex`, `json_schema` and `ebnf`, streamed and not; the
official `openai` SDK (its `parse()` with a pydantic model too); and vllm-router.

Every JSON answer parses and validates against its schema, every regex answer matches in full,
and each answer equals the colocated engine's (greedy and seeded sampling). The decode with a
draft speculates under the grammar and gives plain constrained decoding's greedy tokens. Invalid
grammars and two constraints at once are 400s naming the fields.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from kvferry.common.api.sampling_schema import openai_params, sglang_params
from tests.cluster import Cluster, assert_pages_return, metric, ok, post
from tests.json_schema_check import errors

PROMPTS = ["Give me a person as JSON", "The ferry leaves the north pier at seven", "Hello there"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"type": "string", "enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ANSWER = r"(yes|no), [0-9]{1,3}"
SAMPLINGS = [{"temperature": 0}, {"temperature": 1.0, "seed": 11}]
# sglang-router re-serializes sampling_params with its own type, which knows SGLang's name only
GENERATE_SAMPLINGS = [{"temperature": 0}, {"temperature": 1.0, "sampling_seed": 11}]


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_models):
    """(cluster, sglang-router over the plain decode, sglang-router over the decode with a draft,
    the workers, their free pages at the start, vllm-router over the plain decode, the colocated
    HTTP server)."""
    log_dir = tmp_path_factory.mktemp("structured") / "logs"
    c = Cluster(log_dir, *tiny_models)
    try:
        prefill, decode, before = c.pair()
        spec_decode = c.decode(draft=True)
        colocated = c.colocated_server()
        yield (c, c.router([prefill], [decode]), c.router([prefill], [spec_decode]), (prefill, decode), before,
               c.vllm_router([prefill], [decode]), colocated)
    finally:
        c.stop_all()


def chat_text(answer, stream: bool) -> tuple[str, str]:
    """(content, finish_reason) of a chat answer, streamed or not."""
    if not stream:
        choice = answer.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    chunks = [e["choices"][0] for e in answer.events() if e.get("choices")]
    return "".join(c["delta"].get("content") or "" for c in chunks), chunks[-1]["finish_reason"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_chat_json_schema_parses_validates_and_equals_colocated(pd, colocated, tok, stream, sampling):
    router = pd[1]
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 400, "response_format": RESPONSE_FORMAT,
                "stream": stream, **sampling}
        text, finish = chat_text(ok(post(router.url + "/v1/chat/completions", body)), stream)
        assert finish == "stop", text
        assert errors(json.loads(text), PERSON) == [], text
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        ref = colocated(False).generate([ids], openai_params(body, chat=True))[0]
        assert text == ref.text


@pytest.mark.parametrize("stream", [False, True])
def test_completions_json_object(pd, colocated, stream):
    router = pd[1]
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 300, "temperature": 0,
            "response_format": {"type": "json_object"}, "stream": stream}
    answer = ok(post(router.url + "/v1/completions", body))
    if stream:
        text = "".join(e["choices"][0]["text"] for e in answer.events() if e.get("choices"))
    else:
        text = answer.json()["choices"][0]["text"]
    ref = colocated(False).generate([PROMPTS[0]], openai_params(body, chat=False))[0]
    assert text == ref.text
    if ref.finish_reason["type"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # the tiny model may not close its object in time: then the text is a prefix of one
        assert text.lstrip().startswith("{")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", GENERATE_SAMPLINGS, ids=["greedy", "seeded"])
def test_generate_regex_matches_fully(pd, colocated, stream, sampling):
    router = pd[1]
    params = {"max_new_tokens": 40, "regex": ANSWER, **sampling}
    for prompt in PROMPTS:
        answer = ok(post(router.url + "/generate", {"text": prompt, "sampling_params": params, "stream": stream}))
        out = answer.events()[-1] if stream else answer.json()
        assert re.fullmatch(ANSWER, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        ref = colocated(False).generate([prompt], sglang_params(params))[0]
        assert (out["output_ids"], out["text"]) == (ref.output_ids, ref.text)


def test_generate_json_schema_string_and_ebnf(pd, colocated):
    router = pd[1]
    cases = [({"json_schema": json.dumps(PERSON)}, lambda t: errors(json.loads(t), PERSON) == []),
             ({"ebnf": 'root ::= ("red" | "green") " " [0-9]'}, lambda t: re.fullmatch(r"(red|green) [0-9]", t))]
    for constraint, check in cases:
        params = {"max_new_tokens": 400, "temperature": 0, **constraint}
        out = ok(post(router.url + "/generate", {"text": PROMPTS[1], "sampling_params": params})).json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop" and check(out["text"]), out["text"]
        assert out["output_ids"] == colocated(False).generate([PROMPTS[1]], sglang_params(params))[0].output_ids


@pytest.mark.parametrize("stream", [False, True])
def test_decode_with_draft_speculates_under_the_grammar(pd, colocated, stream):
    """The decode's draft proposes and its target verifies under the grammar: the greedy answer is
    plain constrained decoding's, with drafts accepted."""
    spec_router = pd[2]
    for constraint in ({"json_schema": json.dumps(PERSON)}, {"regex": ANSWER}):
        params = {"max_new_tokens": 400, "temperature": 0, **constraint}
        answer = ok(post(spec_router.url + "/generate",
                         {"text": PROMPTS[0], "sampling_params": params, "stream": stream}))
        out = answer.events()[-1] if stream else answer.json()
        assert out["output_ids"] == colocated(False).generate([PROMPTS[0]], sglang_params(params))[0].output_ids
        assert out["meta_info"]["spec_num_accepted"] > 0
    assert errors(json.loads(ok(post(spec_router.url + "/generate", {
        "text": PROMPTS[2], "sampling_params": {"max_new_tokens": 400, "temperature": 1.0, "sampling_seed": 3,
                                                "json_schema": json.dumps(PERSON)}})).json()["text"]), PERSON) == []


@pytest.mark.parametrize("path,body,param,words", [
    ("/generate", {"text": "x", "sampling_params": {"regex": "(ab"}}, "sampling_params.regex",
     "not a valid regular expression"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{nope"}}, "sampling_params.json_schema",
     "not valid JSON"),
    ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= "}}, "sampling_params.ebnf",
     "not a valid EBNF grammar"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
     "sampling_params.regex,sampling_params.ebnf", "at most one output constraint"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "t", "schema": {"type": "frog"}}}},
     "response_format.json_schema.schema", "not a valid JSON schema"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "response_format": {"type": "json_object"}, "regex": "a"},
     "regex,response_format", "at most one output constraint"),
])
def test_invalid_constraints_are_400s_naming_the_field(pd, path, body, param, words):
    """Through the router (which rewraps a worker's error without its param), and at a worker."""
    _, router, _, workers, before, *_ = pd
    answer = post(router.url + path, body)
    assert answer.status == 400 and words in answer.raw and param.split(",")[0] in answer.raw, answer.raw[:500]
    prefill = workers[0]
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": 7}
    answer = post(prefill.url + path, {**body, **boot})
    assert answer.status == 400, answer.raw[:500]
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert_pages_return(list(workers), before)


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_router(pd, colocated, tok, stream):
    """vllm-router's two stages: the prefill leg (max_tokens 1) samples the first token under the
    grammar, the decode leg goes on from it."""
    vllm = pd[5]
    messages = [{"role": "user", "content": PROMPTS[0]}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 400, "temperature": 0,
            "response_format": RESPONSE_FORMAT, "stream": stream}
    text, finish = chat_text(ok(post(vllm.url + "/v1/chat/completions", body)), stream)
    assert finish == "stop" and errors(json.loads(text), PERSON) == [], text
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert text == colocated(False).generate([ids], openai_params(body, chat=True))[0].text
    params = {"max_new_tokens": 40, "temperature": 0, "regex": ANSWER}
    answer = ok(post(vllm.url + "/generate", {"text": PROMPTS[1], "sampling_params": params, "stream": stream}))
    out = answer.events()[-1] if stream else answer.json()
    assert re.fullmatch(ANSWER, out["text"]), out["text"]


class Person(BaseModel):
    """What the SDK's parse() turns into a strict json_schema response_format."""

    name: Annotated[str, Field(max_length=8)]
    age: Annotated[int, Field(ge=0, le=120)]
    pet: Literal["cat", "dog", "none"]


def test_openai_sdk(pd):
    """The official SDK through sglang-router: chat with a json_schema response_format, parse() with
    a pydantic model, completions with json_object (extra_body), and an invalid schema's 400."""
    client = openai.OpenAI(base_url=pd[1].url + "/v1", api_key="none", timeout=120, max_retries=0)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=400, temperature=0,
                                          response_format=RESPONSE_FORMAT)
    assert errors(json.loads(chat.choices[0].message.content), PERSON) == []
    parsed = client.chat.completions.parse(model="tiny", messages=messages, max_tokens=400, temperature=0,
                                           response_format=Person)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and person.pet in ("cat", "dog", "none"), parsed.choices[0].message.content
    completion = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=200, temperature=0,
                                           extra_body={"regex": ANSWER})
    assert re.fullmatch(ANSWER, completion.choices[0].text), completion.choices[0].text
    bad = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "frog"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, response_format=bad)
    assert "response_format.json_schema.schema is not a valid JSON schema" in str(info.value)


@pytest.mark.parametrize("stream", [False, True])
def test_colocated_http_server_answers_the_same(pd, stream):
    """The colocated HTTP server (common/engine/colocated_server.py) compiles and applies the grammar
    too, and answers what the pair answers through the router."""
    router, colocated = pd[1], pd[6]
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 400,
            "temperature": 0, "response_format": RESPONSE_FORMAT, "stream": stream}
    texts = [chat_text(ok(post(p.url + "/v1/chat/completions", body)), stream)[0] for p in (router, colocated)]
    assert texts[0] == texts[1] and errors(json.loads(texts[1]), PERSON) == []
    gen = {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 40, "temperature": 0, "regex": ANSWER},
           "stream": stream}
    outs = [ok(post(p.url + "/generate", gen)) for p in (router, colocated)]
    ids = [(o.events()[-1] if stream else o.json())["output_ids"] for o in outs]
    assert ids[0] == ids[1]
    bad = post(colocated.url + "/generate", {"text": "x", "sampling_params": {"regex": "(ab"}})
    assert bad.status == 400 and bad.json()["error"]["param"] == "sampling_params.regex"


def test_metrics_count_grammars(pd):
    """/metrics: kvferry_grammars_total by result (compiled, cached, invalid) on both daemons."""
    router, (prefill, decode) = pd[1], pd[3]

    def counts() -> dict:
        return {(proc.name, result): metric(proc, "kvferry_grammars_total", result=result)
                for proc in (prefill, decode) for result in ("compiled", "cached", "invalid")}

    before = counts()
    regex = f"(maybe|never) {len(before)}[0-9]"  # a grammar no other test asks for
    for _ in range(2):
        ok(post(router.url + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 8, "regex": regex}}))
    assert post(router.url + "/generate", {"text": "x", "sampling_params": {"regex": "(x"}}).status == 400
    after = counts()
    for proc in (prefill, decode):
        assert [after[proc.name, r] - before[proc.name, r] for r in ("compiled", "cached", "invalid")] == [1, 1, 1]


def test_n_completions_each_follow_the_grammar(pd):
    """n > 1: every completion of the prompt (forks of its KV on the decode) has its own matcher;
    through the decode with a draft too."""
    for router in (pd[1], pd[2]):
        params = {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 8, "n": 3, "regex": ANSWER}
        outs = ok(post(router.url + "/generate", {"text": PROMPTS[2], "sampling_params": params})).json()
        assert isinstance(outs, list) and len(outs) == 3, outs
        for out in outs:
            assert re.fullmatch(ANSWER, out["text"]), out["text"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 400, "n": 2,
                "temperature": 1.0, "seed": 3, "response_format": RESPONSE_FORMAT}
        for choice in ok(post(router.url + "/v1/chat/completions", chat)).json()["choices"]:
            assert errors(json.loads(choice["message"]["content"]), PERSON) == []
