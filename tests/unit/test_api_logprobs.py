"""Top logprobs and echo through the HTTP app (common/api), over a scripted backend: the three answer
shapes, streamed and not, the fields the backend is asked with, and the 400s naming each field."""

from __future__ import annotations

import pytest

from kvferry.common.api.backend import GenerateEvent, GenerateInput
from tests.unit.test_api_app import ByteTokenizer, EchoBackend, client_for, sse_events

pytestmark = pytest.mark.anyio
PROMPT = "abc"
X, Y, Z, B, C = (ByteTokenizer().encode(ch)[0] for ch in "xyzbc")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class TopBackend(EchoBackend):
    """Outputs "xy"; each token's alternatives are itself and then "z"; the prompt's logprobs (and
    alternatives) are -1, -2, ... per position, None for the first."""

    async def _events(self, inp: GenerateInput):
        n = len(inp.prompt_ids)
        meta = {}
        if inp.return_logprob and inp.logprob_start_len < n:
            positions = range(inp.logprob_start_len, n)
            meta["input_token_logprobs"] = [None if j == 0 else -float(j) for j in positions]
            if inp.top_logprobs_num:
                meta["input_top_logprobs"] = [None if j == 0 else [(inp.prompt_ids[j], -float(j))] for j in positions]
        out = [X, Y]
        for i, token in enumerate(out):
            tops = [[(token, -0.25 - i), (Z, -2.0)][:inp.top_logprobs_num]] if inp.top_logprobs_num else []
            last = i == len(out) - 1
            yield GenerateEvent([token], [-0.25 - i], self.tokenizer.decode([token]), last,
                                {"type": "length", "length": 2} if last else None, meta if i == 0 else {}, tops)


async def post(path: str, body: dict, backend: TopBackend | None = None):
    backend = backend or TopBackend()
    async with client_for(backend) as c:
        r = await c.post(path, json=body)
    assert r.status_code == 200, r.text
    return r, backend


async def test_generate_top_logprobs_and_input_top_logprobs():
    r, backend = await post("/generate", {"text": PROMPT, "return_logprob": True, "logprob_start_len": 1,
                                          "top_logprobs_num": 2, "return_text_in_logprobs": True})
    assert backend.inputs[0].top_logprobs_num == 2 and backend.inputs[0].logprob_start_len == 1
    meta = r.json()["meta_info"]
    assert meta["output_top_logprobs"] == [[[-0.25, X, "x"], [-2.0, Z, "z"]], [[-1.25, Y, "y"], [-2.0, Z, "z"]]]
    assert meta["input_token_logprobs"] == [[-1.0, B, "b"], [-2.0, C, "c"]]
    assert meta["input_top_logprobs"] == [[[-1.0, B, "b"]], [[-2.0, C, "c"]]]


async def test_generate_without_top_logprobs_has_no_top_keys():
    r, _ = await post("/generate", {"text": PROMPT, "return_logprob": True})
    assert "output_top_logprobs" not in r.json()["meta_info"]


async def test_completions_top_logprobs_legacy_shape():
    r, backend = await post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": 2})
    assert backend.inputs[0].top_logprobs_num == 2 and backend.inputs[0].logprob_start_len == 3
    lp = r.json()["choices"][0]["logprobs"]
    assert lp == {"tokens": ["x", "y"], "token_logprobs": [-0.25, -1.25],
                  "top_logprobs": [{"x": -0.25, "z": -2.0}, {"y": -1.25, "z": -2.0}], "text_offset": [0, 1]}


@pytest.mark.parametrize("logprobs", [0, 1])
async def test_completions_echo_prepends_the_prompt_and_its_logprobs(logprobs):
    r, backend = await post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "echo": True,
                                                "logprobs": logprobs})
    assert backend.inputs[0].logprob_start_len == 0 and backend.inputs[0].return_logprob
    choice = r.json()["choices"][0]
    assert choice["text"] == "abcxy"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "c", "x", "y"] and lp["text_offset"] == [0, 1, 2, 3, 4]
    assert lp["token_logprobs"] == [None, -1.0, -2.0, -0.25, -1.25]
    if logprobs:
        assert lp["top_logprobs"] == [None, {"b": -1.0}, {"c": -2.0}, {"x": -0.25}, {"y": -1.25}]
    else:
        assert lp["top_logprobs"] is None


async def test_completions_echo_without_logprobs_asks_for_no_prompt_logprobs():
    r, backend = await post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "echo": True})
    assert not backend.inputs[0].return_logprob
    assert r.json()["choices"][0]["text"] == "abcxy" and r.json()["choices"][0]["logprobs"] is None


async def test_completions_echo_stream_sends_the_prompt_first_and_equals_the_answer():
    body = {"prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1}
    whole, _ = await post("/v1/completions", body)
    r, _ = await post("/v1/completions", {**body, "stream": True})
    events = sse_events(r.text)
    chunks = [e["choices"][0] for e in events]
    assert chunks[0]["text"] == "abcx" and "".join(c["text"] for c in chunks) == "abcxy"
    lp = whole.json()["choices"][0]["logprobs"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((c["logprobs"][key] for c in chunks), []) == lp[key]


async def test_chat_top_logprobs_streamed_and_not():
    body = {"messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 2, "logprobs": True,
            "top_logprobs": 1}
    r, backend = await post("/v1/chat/completions", body)
    assert backend.inputs[0].top_logprobs_num == 1
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "x", "logprob": -0.25, "bytes": [120],
                          "top_logprobs": [{"token": "x", "logprob": -0.25, "bytes": [120]}]}
    streamed, _ = await post("/v1/chat/completions", {**body, "stream": True})
    got = [c for e in sse_events(streamed.text)[1:] if e["choices"][0]["logprobs"]
           for c in e["choices"][0]["logprobs"]["content"]]
    assert got == content


@pytest.mark.parametrize("path, body, param", [
    ("/generate", {"text": "a", "top_logprobs_num": -1}, "top_logprobs_num"),
    ("/generate", {"text": "a", "top_logprobs_num": 2.5}, "top_logprobs_num"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "echo": "yes"}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
                              "top_logprobs": 30}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "echo": True}, "echo"),
])
async def test_bad_values_are_400_naming_the_field(path, body, param):
    async with client_for(TopBackend()) as c:
        r = await c.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


class OtherTopBackend(TopBackend):
    """Each token's only alternative is "z", more likely than the token itself."""

    async def _events(self, inp: GenerateInput):
        async for ev in super()._events(inp):
            ev.top_logprobs = [[(Z, -0.1)] for _ in ev.token_ids] if inp.top_logprobs_num else []
            yield ev


async def test_completions_top_logprobs_add_the_chosen_token_as_openai_documents():
    r, _ = await post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": 1}, OtherTopBackend())
    assert r.json()["choices"][0]["logprobs"]["top_logprobs"] == [{"z": -0.1, "x": -0.25}, {"z": -0.1, "y": -1.25}]
    chat, _ = await post("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "max_tokens": 2,
                                                  "logprobs": True, "top_logprobs": 1}, OtherTopBackend())
    assert [[t["token"] for t in c["top_logprobs"]] for c in chat.json()["choices"][0]["logprobs"]["content"]] == \
        [["z"], ["z"]]  # chat lists exactly top_logprobs entries
