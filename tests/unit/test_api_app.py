"""The HTTP layer end to end: every route, through httpx's ASGI transport and a real uvicorn.

`EchoBackend` is a small deterministic Backend of our own: it answers a prompt with the prompt's
tokens reversed, one event per token, and records how each request's generator ended.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvferry.common.api import GenerateEvent, GenerateInput, create_app
from kvferry.common.api.limits import max_prompt_chars
from kvferry.common.errors import FailCode, OverloadedError, TransferError

pytestmark = pytest.mark.anyio
KEY = "s3cret"
BOOT = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 11}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class ByteTokenizer:
    """Byte-level BPE without merges: one token per UTF-8 byte, a real `tokenizers` object."""

    vocab_size = 256

    def __init__(self) -> None:
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        self._tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                           use_regex=False)
        self._tok.decoder = decoders.ByteLevel()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return self.encode(text + ("<|assistant|>" if add_generation_prompt else ""))


class EchoBackend:
    def __init__(self, role: str = "colocated", model_path: str = "", delay_s: float = 0.0):
        self.role, self.model_path, self.delay_s = role, model_path, delay_s
        self.tokenizer = ByteTokenizer()
        self.model_name, self.max_context_tokens = "echo-model", 512
        self.is_ready_flag = True
        self.fail_before: Exception | None = None
        self.fail_after: tuple[int, Exception] | None = None
        self.reply_kv: dict | None = None
        self.inputs: list[GenerateInput] = []
        self.ended: dict[str, str] = {}  # request_id → "finished" or the exception that ended it
        self.metrics: bytes | None = None
        self.health_error: Exception | None = None

    def is_ready(self) -> bool:
        return self.is_ready_flag

    def server_info(self) -> dict:
        return {"num_reqs": 2, "num_tokens": 40, "model_path": "org/remote-model"}

    def metrics_text(self) -> bytes | None:
        return self.metrics

    async def health_generate(self) -> None:
        if self.health_error is not None:
            raise self.health_error

    async def generate(self, inp: GenerateInput):
        self.inputs.append(inp)
        sent_final = False
        try:
            async for ev in self._events(inp):
                sent_final = ev.finished
                yield ev
        except BaseException as exc:
            self.ended[inp.request_id] = "finished" if sent_final else type(exc).__name__
            raise
        self.ended[inp.request_id] = "finished"

    def _final_meta(self, inp: GenerateInput) -> dict:
        meta: dict = {"spec_accept_rate": 0.5}
        if inp.return_logprob:
            positions = range(inp.logprob_start_len, len(inp.prompt_ids))
            meta["input_token_logprobs"] = [None if j == 0 else -float(j) for j in positions]
        if self.reply_kv is not None:
            meta["kv_transfer_params"] = self.reply_kv
        return meta

    async def _events(self, inp: GenerateInput):
        if self.fail_before is not None:
            raise self.fail_before
        out = list(reversed(inp.prompt_ids))[:inp.params.max_new_tokens]
        reason = ({"type": "length", "length": len(out)} if len(out) == inp.params.max_new_tokens
                  else {"type": "stop", "matched": 0})
        if not out:
            yield GenerateEvent([], [], "", True, reason, self._final_meta(inp))
        for i, token_id in enumerate(out):
            await asyncio.sleep(self.delay_s)
            if self.fail_after is not None and i == self.fail_after[0]:
                raise self.fail_after[1]
            last = i == len(out) - 1
            yield GenerateEvent([token_id], [-0.5 - i] if inp.return_logprob else [],
                                self.tokenizer.decode([token_id]), last, reason if last else None,
                                self._final_meta(inp) if last else {})


def client_for(backend: EchoBackend, api_key: str | None = None,
               timeout_s: float = 10.0) -> httpx.AsyncClient:
    app = create_app(backend, api_key=api_key, request_timeout_s=timeout_s)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def sse_events(text: str) -> list:
    """The JSON objects of an SSE body; asserts it ends with exactly one [DONE]."""
    lines = [ln for ln in text.split("\n\n") if ln]
    assert lines[-1] == "data: [DONE]" and text.count("[DONE]") == 1
    assert all(ln.startswith("data: ") for ln in lines)
    return [json.loads(ln[len("data: "):]) for ln in lines[:-1]]


def rev(text: str) -> str:
    return text[::-1]


# --- SGLang /generate -------------------------------------------------------------------------

async def test_generate_non_stream_shape():
    backend = EchoBackend()
    async with client_for(backend) as c:
        r = await c.post("/generate", json={"text": "hello", "rid": "r1",
                                            "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200
    body = r.json()
    assert body["text"] == "oll" and body["output_ids"] == backend.tokenizer.encode("oll")
    meta = body["meta_info"]
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 3}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (5, 3, 0)
    assert meta["e2e_latency"] >= 0 and meta["spec_accept_rate"] == 0.5
    assert "input_token_logprobs" not in meta and backend.ended == {"r1": "finished"}


async def test_generate_batch_returns_a_list_in_prompt_order():
    backend = EchoBackend()
    async with client_for(backend) as c:
        r = await c.post("/generate", json={"input_ids": [[1, 2, 3], [4, 5]], "rid": ["a", "b"]})
    body = r.json()
    assert [o["output_ids"] for o in body] == [[3, 2, 1], [5, 4]]
    assert [o["meta_info"]["id"] for o in body] == ["a", "b"]
    assert [o["meta_info"]["finish_reason"]["type"] for o in body] == ["stop", "stop"]


async def test_generate_logprobs_in_sglang_format():
    backend = EchoBackend()
    async with client_for(backend) as c:
        r = await c.post("/generate", json={"text": "abc", "return_logprob": True,
                                            "logprob_start_len": 0,
                                            "return_text_in_logprobs": True})
    meta = r.json()["meta_info"]
    a, b, cc = backend.tokenizer.encode("abc")
    assert meta["input_token_logprobs"] == [[None, a, "a"], [-1.0, b, "b"], [-2.0, cc, "c"]]
    assert meta["output_token_logprobs"] == [[-0.5, cc, "c"], [-1.5, b, "b"], [-2.5, a, "a"]]
    assert backend.inputs[0].return_logprob and backend.inputs[0].logprob_start_len == 0
    async with client_for(backend) as c:
        r = await c.post("/generate", json={"text": "abc", "return_logprob": True})
    meta = r.json()["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs"][0][2] is None


async def test_generate_stream_is_cumulative_and_ends_with_done():
    backend = EchoBackend()
    async with client_for(backend) as c:
        r = await c.post("/generate", json={"text": "abcd", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert [e["text"] for e in events] == ["d", "dc", "dcb", "dcba"]
    assert [len(e["output_ids"]) for e in events] == [1, 2, 3, 4]
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * 3
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert "e2e_latency" in events[-1]["meta_info"] and "e2e_latency" not in events[0]["meta_info"]
    assert all("index" not in e for e in events)


async def test_generate_batch_stream_carries_index():
    backend = EchoBackend()
    async with client_for(backend) as c:
        r = await c.post("/generate", json={"text": ["ab", "xyz"], "stream": True})
    events = sse_events(r.text)
    final = {e["index"]: e["text"] for e in events if e["meta_info"]["finish_reason"]}
    assert final == {0: "ba", 1: "zyx"} and len(events) == 5


# --- OpenAI ---------------------------------------------------------------------------------

async def test_completions_non_stream():
    backend = EchoBackend()
    async with client_for(backend) as c:
        r = await c.post("/v1/completions", json={"model": "mine", "prompt": "hello",
                                                  "max_tokens": 2, "logprobs": 0})
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "mine" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["text"] == "ol" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"tokens": ["o", "l"], "token_logprobs": [-0.5, -1.5],
                                  "top_logprobs": None, "text_offset": [0, 1]}
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


async def test_completions_batch_prompts_give_one_choice_each():
    async with client_for(EchoBackend()) as c:
        r = await c.post("/v1/completions", json={"prompt": ["ab", "cd"]})
    body = r.json()
    assert [(ch["index"], ch["text"]) for ch in body["choices"]] == [(0, "ba"), (1, "dc")]
    assert body["usage"]["prompt_tokens"] == 4


async def test_completions_stream_with_usage():
    async with client_for(EchoBackend()) as c:
        r = await c.post("/v1/completions", json={
            "prompt": "abc", "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "cba"
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"] == []
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


async def test_chat_applies_template_non_stream():
    backend = EchoBackend()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    async with client_for(backend) as c:
        r = await c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5,
                                                       "logprobs": True, "top_logprobs": 0})
    expected_prompt = backend.tokenizer.apply_chat_template(messages)
    assert backend.inputs[0].prompt_ids == expected_prompt
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "echo-model"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": ">|tna"}
    assert choice["logprobs"]["content"][0] == {"token": ">", "logprob": -0.5, "bytes": [62],
                                                "top_logprobs": []}
    assert body["usage"]["prompt_tokens"] == len(expected_prompt)


async def test_chat_stream_role_first_then_content_then_usage():
    async with client_for(EchoBackend()) as c:
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert content == ">|t"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 3


async def test_chat_stream_continuous_usage_stats_puts_running_usage_on_every_chunk():
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it): every chunk carries the
    usage so far, the role chunk 0 completion tokens; the last chunk still carries the totals.
    Fails if the option is dropped (chunks then carry "usage": null)."""
    async with client_for(EchoBackend()) as c:
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = sse_events(r.text)
    prompt = events[-1]["usage"]["prompt_tokens"]
    assert events[0]["usage"] == {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
    running = [e["usage"]["completion_tokens"] for e in events[1:-1]]
    assert running == [1, 2, 3]
    assert all(e["usage"]["total_tokens"] == prompt + e["usage"]["completion_tokens"] for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3


async def test_completions_stream_continuous_usage_stats_without_include_usage_as_vllm():
    """vLLM reads a missing ``include_usage`` as true once ``stream_options`` is sent: the running
    usage and the last totals chunk both come; ``include_usage: false`` turns both off."""
    async with client_for(EchoBackend()) as c:
        r = await c.post("/v1/completions", json={
            "prompt": "abc", "stream": True, "stream_options": {"continuous_usage_stats": True}})
        off = await c.post("/v1/completions", json={
            "prompt": "abc", "stream": True,
            "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
    events = sse_events(r.text)
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [1, 2, 3]
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert all("usage" not in e for e in sse_events(off.text))


async def test_a_peer_named_cancel_is_logged_at_info_and_counted_by_the_route(caplog):
    """A request failed because the other daemon's client left (code ``cancelled``) is logged at
    INFO, not WARNING (fails if it is logged as a failure); a body refused before any generator
    opened is counted by the route through ``count_outcome``."""
    backend = EchoBackend()
    backend.fail_before = TransferError("prefill failed the transfer: prefill cancelled", code=FailCode.CANCELLED)
    counted: list[str] = []
    backend.count_outcome = counted.append
    with caplog.at_level(logging.INFO, logger="kvferry.common.api.app"):
        async with client_for(backend) as c:
            r = await c.post("/generate", json={"text": "ab"})
            bad = await c.post("/generate", json={"text": "ab", "wobble": 1})
    assert r.status_code == 502 and bad.status_code == 400
    (line,) = [rec for rec in caplog.records if "prefill cancelled" in rec.getMessage()]
    assert line.levelno == logging.INFO
    assert counted == ["refused"]  # the 502 was the generator's own to count (EchoBackend does not)


# --- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    ("/generate", {"text": "a", "unknown_field": 1}, "unknown_field"),
    ("/generate", {"text": ""}, "text"),
    ("/generate", {"text": "a" * 600}, "text"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": -1}},
     "sampling_params.temperature"),
    ("/generate", {"text": "a", "top_logprobs_num": 21}, "top_logprobs_num"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "logprobs": 25}, "logprobs"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 40}, "n"),
])
async def test_bad_requests_are_400_naming_the_field(path, body, param):
    async with client_for(EchoBackend()) as c:
        r = await c.post(path, json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["code"] == 400 and param.split(".")[-1] in error["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
async def test_body_must_be_a_json_object(raw):
    async with client_for(EchoBackend()) as c:
        r = await c.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] is None


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_pd_roles_list_missing_bootstrap_fields(role):
    async with client_for(EchoBackend(role)) as c:
        r = await c.post("/generate", json={"text": "a", "bootstrap_room": 5})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "bootstrap_host,bootstrap_port"
        r = await c.post("/v1/completions", json={"prompt": "a"})
        message = r.json()["error"]["message"]
        assert r.status_code == 400
        assert all(k in message for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
        r = await c.post("/generate", json={"text": "ab", **BOOT})
        assert r.status_code == 200


async def test_colocated_ignores_bootstrap_and_pd_roles_pass_it_on():
    colocated, decode = EchoBackend(), EchoBackend("decode")
    async with client_for(colocated) as c:
        assert (await c.post("/generate", json={"text": "a", **BOOT})).status_code == 200
    async with client_for(decode) as c:
        body = {"text": "a", **BOOT, "bootstrap_port": None}
        assert (await c.post("/generate", json=body)).status_code == 200
    assert colocated.inputs[0].bootstrap is None
    boot = decode.inputs[0].bootstrap
    assert (boot.host, boot.port, boot.room) == ("127.0.0.1", 8998, 11)


async def test_api_key():
    backend = EchoBackend()
    async with client_for(backend, api_key=KEY) as c:
        body = {"text": "ab"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):
            r = await c.post("/generate", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert (await c.get("/model_info")).status_code == 401
        ok = await c.post("/generate", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
        for path in ("/health", "/readiness", "/metrics", "/health_generate"):
            assert (await c.get(path)).status_code == 200, path
    assert len(backend.inputs) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_overloaded_is_503_with_retry_after(stream):
    backend = EchoBackend()
    backend.fail_before = OverloadedError("decode queue is full (64 requests)")
    async with client_for(backend) as c:
        r = await c.post("/v1/completions", json={"prompt": "ab", "stream": stream, "rid": "q"})
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["type"] == "overloaded_error"
    assert backend.ended == {"q": "OverloadedError"}


async def test_error_mid_stream_is_a_final_error_event():
    backend = EchoBackend()
    backend.fail_after = (2, TransferError("room 11: KV write to decode failed"))
    async with client_for(backend) as c:
        r = await c.post("/generate", json={"text": "abcd", "stream": True, "rid": "s"})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert [e["text"] for e in events[:-1]] == ["d", "dc"]
    assert events[-1]["error"]["code"] == 502 and "KV write" in events[-1]["error"]["message"]
    assert events[-1]["error"]["type"] == "transfer_error"
    assert backend.ended == {"s": "TransferError"}


async def test_error_in_one_prompt_of_a_batch_closes_the_others():
    backend = EchoBackend(delay_s=0.01)
    backend.fail_after = (1, TransferError("boom"))
    async with client_for(backend) as c:
        r = await c.post("/generate", json={"input_ids": [[1, 2, 3], [4, 5, 6]],
                                            "rid": ["x", "y"]})
    assert r.status_code == 502
    assert set(backend.ended) == {"x", "y"} and "finished" not in backend.ended.values()


async def test_deadline_gives_504_and_closes_the_backend():
    backend = EchoBackend(delay_s=0.2)
    async with client_for(backend, timeout_s=0.3) as c:
        r = await c.post("/generate", json={"text": "abcdef", "rid": "slow"})
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        assert backend.ended["slow"] == "CancelledError"
        r = await c.post("/generate", json={"text": "abcdef", "rid": "slow2", "stream": True})
        events = sse_events(r.text)
        assert events[-1]["error"]["code"] == 504 and events[0]["text"] == "f"
        assert backend.ended["slow2"] == "CancelledError"


async def test_unknown_route_is_a_json_404():
    async with client_for(EchoBackend()) as c:
        r = await c.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


async def test_openapi_documents_the_three_request_bodies():
    async with client_for(EchoBackend()) as c:
        r = await c.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    schemas = doc["components"]["schemas"]

    def body_schema(path: str) -> dict:
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return schemas[ref["$ref"].rsplit("/", 1)[-1]]

    fields = {path: set(body_schema(path)["properties"])
              for path in ("/generate", "/v1/completions", "/v1/chat/completions")}
    assert {"text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
            "rid", "kv_transfer_params", "bootstrap_host", "bootstrap_port",
            "bootstrap_room"} <= fields["/generate"]
    openai = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
              "min_p", "stop", "seed", "n", "stream", "stream_options", "logprobs",
              "kv_transfer_params", "bootstrap_room"}
    assert openai | {"prompt"} <= fields["/v1/completions"]
    assert openai | {"messages", "top_logprobs"} <= fields["/v1/chat/completions"]
    sampling = body_schema("/generate")["properties"]["sampling_params"]
    assert "SGLangSampling" in json.dumps(sampling)
    assert {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
            "ignore_eos", "sampling_seed"} <= set(schemas["SGLangSampling"]["properties"])
    assert schemas["SGLangSampling"]["properties"]["top_p"]["description"]
    assert "ChatMessage" in json.dumps(body_schema("/v1/chat/completions")["properties"]["messages"])


# --- PD fields and routers ------------------------------------------------------------------

async def test_kv_transfer_params_round_trip():
    prefill, decode = EchoBackend("prefill"), EchoBackend("decode")
    chosen = {"bootstrap_host": "10.1.1.1", "bootstrap_port": 9000, "bootstrap_room": 77}
    prefill.reply_kv = chosen
    # vllm-router's prefill leg, as captured on loopback.
    kv_in = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
             "remote_block_ids": None, "remote_host": None, "remote_port": None}
    leg = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False,
           "min_tokens": 1, "max_tokens": 1, "logprobs": False, "no_stop_trim": False,
           "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
           "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
           "include_reasoning": True, "kv_transfer_params": kv_in}
    async with client_for(prefill) as c:
        r = await c.post("/v1/chat/completions", json=leg,
                         headers={"X-Request-Id": "___prefill_addr_a___decode_addr_b_1"})
    assert r.status_code == 200, r.text
    assert r.json()["kv_transfer_params"] == chosen
    assert prefill.inputs[0].bootstrap is None and prefill.inputs[0].kv_transfer_params == kv_in
    assert prefill.inputs[0].request_id == "___prefill_addr_a___decode_addr_b_1"
    decode_leg = {**leg, "max_tokens": 4, "kv_transfer_params": r.json()["kv_transfer_params"]}
    del decode_leg["min_tokens"]
    async with client_for(decode) as c:
        r = await c.post("/v1/chat/completions", json=decode_leg)
    assert r.status_code == 200, r.text
    boot = decode.inputs[0].bootstrap
    assert (boot.host, boot.port, boot.room) == ("10.1.1.1", 9000, 77)
    assert "kv_transfer_params" not in r.json()
    async with client_for(prefill) as c:
        r = await c.post("/generate", json={"text": "hi", "sampling_params": {},
                                            "max_tokens": 1, "min_tokens": 1,
                                            "kv_transfer_params": kv_in})
    assert r.json()["kv_transfer_params"] == chosen


# --- info routes ----------------------------------------------------------------------------

async def test_health_readiness_and_health_generate():
    backend = EchoBackend()
    async with client_for(backend) as c:
        assert (await c.get("/health")).json() == {"status": "ok"}
        assert (await c.get("/health_generate")).status_code == 200
        backend.health_error = TransferError("probe failed")
        assert (await c.get("/health_generate")).status_code == 502
        backend.is_ready_flag = False
        for path in ("/health", "/readiness", "/health_generate"):
            assert (await c.get(path)).status_code == 503, path


async def test_model_info_never_reports_a_non_local_path(tmp_path):
    remote = EchoBackend(model_path="meta-llama/Llama-3.1-8B")
    async with client_for(remote) as c:
        for path in ("/model_info", "/get_model_info"):
            info = (await c.get(path)).json()
            assert info["model_path"] == "" and info["tokenizer_path"] == ""
            assert info["is_generation"] is True
        assert "root" not in (await c.get("/v1/models")).json()["data"][0]
        for path in ("/server_info", "/get_server_info"):
            assert (await c.get(path)).json()["model_path"] == ""
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    local = EchoBackend(model_path=str(tmp_path))
    async with client_for(local) as c:
        info = (await c.get("/model_info")).json()
        models_card = (await c.get("/v1/models")).json()["data"][0]
    assert info["model_path"] == str(tmp_path) and info["model_type"] == "llama"
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert models_card["root"] == str(tmp_path) and models_card["id"] == "echo-model"
    assert models_card["owned_by"] == "kvferry"


async def test_server_info_load_metrics_version_flush():
    backend = EchoBackend("decode")
    async with client_for(backend) as c:
        info = (await c.get("/server_info")).json()
        assert info["role"] == "decode" and info["disaggregation_mode"] == "decode"
        assert info["served_model_name"] == "echo-model" and info["version"]
        assert info["num_reqs"] == 2 and info["tp_size"] == 1
        load = (await c.get("/get_load")).json()
        assert load == [{"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 0, "num_tokens": 40}]
        default_metrics = await c.get("/metrics")
        assert default_metrics.headers["content-type"].startswith("text/plain")
        assert b"python_info" in default_metrics.content or b"# HELP" in default_metrics.content
        backend.metrics = b"kvferry_requests_total 3.0\n"
        assert (await c.get("/metrics")).content == b"kvferry_requests_total 3.0\n"
        assert (await c.get("/version")).json()["version"] == info["version"]
        assert (await c.post("/flush_cache")).status_code == 200


# --- a real uvicorn server ------------------------------------------------------------------

class ServerThread:
    """uvicorn (uvloop) serving `app` on a free loopback port, in a thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, loop="uvloop", log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_real_server_stream_and_disconnects():
    backend = EchoBackend(delay_s=0.05)
    app = create_app(backend, api_key=KEY, request_timeout_s=30)
    auth = {"Authorization": f"Bearer {KEY}"}
    with ServerThread(app) as server, httpx.Client(base_url=server.url, headers=auth) as c:
        r = c.post("/v1/completions", json={"prompt": "abc", "rid": "full"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "cba"
        # Streaming client leaves after the first event: the backend generator must be closed.
        body = {"text": "x" * 100, "stream": True, "rid": "gone"}
        with c.stream("POST", "/generate", json=body) as r:
            first = next(r.iter_lines())
            assert json.loads(first[len("data: "):])["text"] == "x"
        assert wait_until(lambda: "gone" in backend.ended), backend.ended
        assert backend.ended["gone"] in ("CancelledError", "GeneratorExit")
        # A non-streaming client that gives up is noticed too.
        with pytest.raises(httpx.ReadTimeout):
            c.post("/generate", json={"text": "y" * 100, "rid": "impatient"}, timeout=0.3)
        assert wait_until(lambda: "impatient" in backend.ended), backend.ended
        assert backend.ended["impatient"] == "CancelledError"
        assert len(backend.tokenizer.encode("x" * 100)) == 100


# --- bounds before any work (--max-request-bytes, prompt length, tokenizing off the loop) --------

def limited_client(backend: EchoBackend, max_request_bytes: int) -> httpx.AsyncClient:
    app = create_app(backend, api_key=None, request_timeout_s=10, max_request_bytes=max_request_bytes)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def assert_too_large(r: httpx.Response, limit: int) -> None:
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == 413 and error["type"] == "invalid_request_error" and error["param"] is None
    assert "--max-request-bytes" in error["message"] and str(limit) in error["message"], error


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
async def test_body_over_max_request_bytes_is_413_naming_the_limit(path):
    backend = EchoBackend()
    data = json.dumps({"text": "x" * 300, "prompt": "x" * 300}).encode()
    async with limited_client(backend, 256) as c:
        r = await c.post(path, content=data, headers={"Content-Type": "application/json"})
    assert_too_large(r, 256)
    assert backend.inputs == []


async def test_chunked_body_is_cut_off_at_max_request_bytes():
    """No Content-Length: the body is counted while it is read."""
    backend = EchoBackend()
    received: list[int] = []

    async def chunks():
        for _ in range(64):
            received.append(1)
            yield b" " * 64

    async with limited_client(backend, 1000) as c:
        r = await c.post("/generate", content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_too_large(r, 1000)
    assert backend.inputs == []


async def test_body_at_max_request_bytes_is_served():
    backend = EchoBackend()
    data = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 2}}).encode()
    async with limited_client(backend, len(data)) as c:
        r = await c.post("/generate", content=data, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "ol"


class RecordingTokenizer(ByteTokenizer):
    """Records the thread of every encode."""

    def __init__(self) -> None:
        super().__init__()
        self.encode_threads: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encode_threads.append(threading.get_ident())
        return super().encode(text, add_special_tokens)


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "hello"}),
    ("/v1/completions", {"prompt": "hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
])
async def test_tokenizing_runs_off_the_event_loop(path, body):
    backend = EchoBackend()
    backend.tokenizer = RecordingTokenizer()
    async with client_for(backend) as c:
        r = await c.post(path, json=body)
    assert r.status_code == 200, r.text
    assert backend.tokenizer.encode_threads
    assert threading.get_ident() not in backend.tokenizer.encode_threads


@pytest.mark.parametrize("path,body,field", [
    ("/generate", lambda n: {"text": "a" * n}, "text"),
    ("/v1/completions", lambda n: {"prompt": "a" * n}, "prompt"),
    ("/v1/chat/completions", lambda n: {"messages": [{"role": "user", "content": "a" * n}]}, "messages"),
])
async def test_text_that_cannot_fit_the_context_is_refused_before_tokenizing(path, body, field):
    """The byte tokenizer's longest token decodes to 3 bytes (a lone byte of a multi-byte
    character decodes to U+FFFD), the context is 512 tokens: a text of more than 4 * 3 * 512
    characters cannot fit whatever it tokenizes to."""
    backend = EchoBackend()
    backend.tokenizer = RecordingTokenizer()
    assert max_prompt_chars(backend.tokenizer, 256, 512) == 4 * 3 * 512
    async with client_for(backend) as c:
        r = await c.post(path, json=body(4 * 3 * 512 + 1))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "512 tokens" in error["message"], error
    assert backend.tokenizer.encode_threads == []  # never tokenized
    assert backend.inputs == []


async def test_input_ids_over_the_context_are_refused_by_length_first():
    """The length is checked before each id: a long list is refused for its length, not for the
    bad id near its end."""
    backend = EchoBackend()
    async with client_for(backend) as c:
        r = await c.post("/generate", json={"input_ids": [1] * 600 + [-1]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "input_ids" and "601 tokens" in error["message"], error
