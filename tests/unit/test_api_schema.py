"""Request parsing and response shaping of kvferry.common.api: pure functions, no server."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.common.api.backend import BootstrapInfo, GenerateEvent
from kvferry.common.api.openai_schema import parse_openai
from kvferry.common.api.logprobs import chat_logprobs, clean_logprob, completion_logprobs, sglang_logprobs
from kvferry.common.api.responses import ItemOutput, error_info, generate_response, openai_response
from kvferry.common.api.schema import (
    FieldError, ParseContext, PromptItem, error_param, parse_generate, resolve_bootstrap,
)
from kvferry.common.errors import (
    OverloadedError, PeerUnavailableError, RequestError, TransferError,
)
from kvferry.common.sampling.sampler import SamplingParams


class CharTokenizer:
    """One token per character (its code point); enough to check what parsing does."""

    vocab_size = 1000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True):
        text = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        return self.encode(text + ("[assistant]" if add_generation_prompt else ""))


def ctx(role: str = "colocated", max_context_tokens: int = 4096) -> ParseContext:
    return ParseContext(role=role, tokenizer=CharTokenizer(), max_context_tokens=max_context_tokens,
                        vocab_size=1000, default_bootstrap_port=8998, request_id="base")


BOOT = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}


def test_generate_single_text_is_tokenized_with_defaults():
    req = parse_generate(ctx(), {"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    assert not req.is_batch and not req.stream and not req.return_logprob
    (item,) = req.items
    assert item.prompt_ids == [ord("h"), ord("i")]
    assert item.params.max_new_tokens == 3 and item.request_id == "base"
    assert item.logprob_start_len == 2  # SGLang's default -1: output logprobs only
    assert item.bootstrap is None


def test_generate_batch_broadcasts_sampling_params_and_takes_rid_list():
    req = parse_generate(ctx(), {"input_ids": [[1, 2], [3]], "rid": ["a", "b"],
                                 "sampling_params": {"temperature": 0.5, "max_new_tokens": 1}})
    assert req.is_batch
    assert [i.request_id for i in req.items] == ["a", "b"]
    assert [i.prompt_ids for i in req.items] == [[1, 2], [3]]
    assert all(i.params.temperature == 0.5 for i in req.items)


def test_generate_batch_sampling_params_per_prompt():
    req = parse_generate(ctx(), {"text": ["a", "b"], "sampling_params": [
        {"max_new_tokens": 1}, {"max_new_tokens": 2}]})
    assert [i.params.max_new_tokens for i in req.items] == [1, 2]
    assert [i.request_id for i in req.items] == ["base-0", "base-1"]


@pytest.mark.parametrize("body, param", [
    ({"text": "a", "input_ids": [1]}, "text"),
    ({}, "text"),
    ({"text": ""}, "text"),
    ({"text": []}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, -2]}, "input_ids[1]"),
    ({"input_ids": [1, 1000]}, "input_ids[1]"),
    ({"input_ids": [[1], [True]]}, "input_ids[1][0]"),
    ({"text": "a", "stream": "yes"}, "stream"),
    ({"text": "a", "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"text": "a", "top_logprobs_num": "2"}, "top_logprobs_num"),
    ({"text": "a", "logprob_start_len": 5}, "logprob_start_len"),
    ({"text": "a", "return_hidden_states": True}, "return_hidden_states"),
    ({"text": "a", "lora_path": "x"}, "lora_path"),
    ({"text": "a", "bogus": 1, "zzz": 2}, "bogus"),
    ({"text": "a", "rid": ["x"]}, "rid"),
    ({"text": ["a", "b"], "rid": "x"}, "rid"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "a", "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 5000}}, "sampling_params.max_new_tokens"),
    ({"text": "a", "max_tokens": 1}, "max_tokens"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"top_k": "x"}]}, "sampling_params[1].top_k"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"top_p": 2}]}, "sampling_params[1].top_p"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [1, None]}},
     "sampling_params.stop_token_ids[1]"),
    ({"text": "a", "sampling_params": "greedy"}, "sampling_params"),
    ({"text": "a", "sampling_params": {"wobble": 1}}, "sampling_params"),
    ({"text": "a", "sampling_params": {"frequency_penalty": 2.5}},
     "sampling_params.frequency_penalty"),
    ({"text": "a", "sampling_params": {"logit_bias": {"1": -101}}}, "sampling_params.logit_bias"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}},
     "sampling_params.min_new_tokens"),
    ({"text": "a", "return_logprob": 1}, "return_logprob"),
    ({"text": "a", "log_metrics": "yes"}, "log_metrics"),
    ({"text": "a", "kv_transfer_params": [1]}, "kv_transfer_params"),
    ({"text": "a", "max_tokens": "1", "kv_transfer_params": {"do_remote_decode": True}},
     "max_tokens"),
])
def test_generate_rejects_naming_the_field(body, param):
    with pytest.raises(RequestError) as info:
        parse_generate(ctx(), body)
    assert error_param(info.value) == param, str(info.value)


def test_generate_prompt_longer_than_context_names_the_field():
    with pytest.raises(FieldError) as info:
        parse_generate(ctx(max_context_tokens=3), {"text": "abcd"})
    assert info.value.param == "text" and "4 tokens" in str(info.value)


def test_generate_tolerates_fields_sglang_router_adds():
    # The body sglang-router 0.3.2 forwards for {"text": "hello", ...} (captured on loopback).
    body = {"text": "hello", "model": None, "sampling_params": {"temperature": 0.0,
            "max_new_tokens": 4}, "return_text_in_logprobs": False, "stream": False,
            "log_metrics": True, "return_hidden_states": False, "background": False,
            "no_logs": False, "return_bytes": False, "return_entropy": False, **BOOT}
    req = parse_generate(ctx("decode"), body)
    assert req.items[0].bootstrap == BootstrapInfo("10.0.0.1", 8998, 7)


def test_generate_vllm_prefill_hints_only_with_kv_transfer_params():
    body = {"text": "hello", "max_tokens": 1, "min_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "remote_host": None}}
    req = parse_generate(ctx("prefill"), body)
    assert req.items[0].bootstrap is None
    assert req.kv_transfer_params == body["kv_transfer_params"]


def test_bootstrap_lists_for_batches_and_null_port_means_default():
    body = {"input_ids": [[1], [2]], "bootstrap_host": ["h", "h"],
            "bootstrap_port": [None, None], "bootstrap_room": [1, 2]}
    req = parse_generate(ctx("prefill"), body)
    assert [i.bootstrap for i in req.items] == [BootstrapInfo("h", 8998, 1),
                                                BootstrapInfo("h", 8998, 2)]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_missing_bootstrap_fields_are_listed(role):
    with pytest.raises(FieldError) as info:
        resolve_bootstrap(ctx(role), {}, None)
    assert info.value.param == "bootstrap_host,bootstrap_port,bootstrap_room"
    with pytest.raises(FieldError) as info:
        resolve_bootstrap(ctx(role), {"bootstrap_port": 1}, None)
    assert info.value.param == "bootstrap_host,bootstrap_room"
    assert "bootstrap_host, bootstrap_room" in str(info.value)


def test_bootstrap_resolution_order():
    assert resolve_bootstrap(ctx("colocated"), {}, None) is None
    kv = {"bootstrap_host": "p", "bootstrap_port": 9, "bootstrap_room": 3}
    assert resolve_bootstrap(ctx("decode"), {}, kv) == BootstrapInfo("p", 9, 3)
    # Explicit fields win over kv_transfer_params.
    assert resolve_bootstrap(ctx("decode"), BOOT, kv) == BootstrapInfo("10.0.0.1", 8998, 7)
    # A vllm-router prefill leg: the backend picks the room.
    assert resolve_bootstrap(ctx("prefill"), {}, {"do_remote_decode": True}) is None
    with pytest.raises(FieldError) as info:
        resolve_bootstrap(ctx("decode"), {}, {"do_remote_decode": True})
    assert "bootstrap_room" in str(info.value)
    with pytest.raises(FieldError) as info:
        resolve_bootstrap(ctx("decode"), {}, {"bootstrap_host": "p", "bootstrap_port": 9})
    assert info.value.param == "kv_transfer_params.bootstrap_room"


@pytest.mark.parametrize("fields, param", [
    ({**BOOT, "bootstrap_port": 0}, "bootstrap_port"),
    ({**BOOT, "bootstrap_port": True}, "bootstrap_port"),
    ({**BOOT, "bootstrap_room": -1}, "bootstrap_room"),
    ({**BOOT, "bootstrap_room": 2**64}, "bootstrap_room"),
    ({**BOOT, "bootstrap_host": ""}, "bootstrap_host"),
])
def test_bad_bootstrap_values(fields, param):
    with pytest.raises(FieldError) as info:
        resolve_bootstrap(ctx("decode"), fields, None)
    assert info.value.param == param


def test_openai_completion_prompt_forms():
    c = ctx()
    assert parse_openai(c, {"prompt": "ab"}, False).items[0].prompt_ids == [97, 98]
    assert parse_openai(c, {"prompt": [5, 6]}, False).items[0].prompt_ids == [5, 6]
    two = parse_openai(c, {"prompt": ["a", "b"], "rid": "r"}, False).items
    assert [i.prompt_ids for i in two] == [[97], [98]]
    assert [i.request_id for i in two] == ["r-0", "r-1"]
    assert len(parse_openai(c, {"prompt": [[1], [2, 3]]}, False).items) == 2
    # OpenAI's default limit for completions is 16 tokens.
    assert parse_openai(c, {"prompt": "a"}, False).items[0].params.max_new_tokens == 16


def test_openai_completion_takes_max_completion_tokens_when_max_tokens_is_absent():
    req = parse_openai(ctx(), {"prompt": "a", "max_completion_tokens": 3}, False)
    assert req.items[0].params.max_new_tokens == 3


def test_openai_chat_applies_the_template_and_joins_text_parts():
    body = {"messages": [{"role": "system", "content": "s"},
                         {"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 2, "max_tokens": 9}
    req = parse_openai(ctx(), body, True)
    assert CharTokenizer().decode(req.items[0].prompt_ids) == "[system]s[user]a\nb[assistant]"
    assert req.items[0].params.max_new_tokens == 2


def test_openai_tolerates_router_fields():
    chat = {"messages": [{"role": "user", "content": "hi"}], "model": "m", "logprobs": False,
            "max_completion_tokens": 4, "stream": False, "no_stop_trim": False,
            "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
            "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
            "include_reasoning": True, "logit_bias": {}, "response_format": {"type": "text"},
            "tool_choice": "none", "parallel_tool_calls": True, "user": "u", **BOOT}
    assert parse_openai(ctx("prefill"), chat, True).model == "m"
    completion = {"model": "m", "prompt": "hello", "max_tokens": 4, "stream": False,
                  "echo": False, "no_stop_trim": False, "ignore_eos": False,
                  "skip_special_tokens": True, "return_hidden_states": False,
                  "stream_options": {"include_usage": True}, **BOOT}
    req = parse_openai(ctx("decode"), completion, False)
    assert req.include_usage and req.items[0].bootstrap.room == 7


def test_sglang_router_bodies_are_accepted_as_sent():
    # Bodies sglang-router 0.3.2 sent to a prefill worker for plain client requests (captured
    # on loopback): every field it adds must be tolerated.
    rooms = [7209904482939410603, 6128566809250743898]
    generate = {"model": None, "input_ids": [[1, 2], [3, 4]],
                "sampling_params": {"max_new_tokens": 4}, "return_logprob": True,
                "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                "return_hidden_states": False, "background": False, "no_logs": False,
                "return_bytes": False, "return_entropy": False,
                "bootstrap_host": ["127.0.0.1"] * 2, "bootstrap_port": [18998] * 2,
                "bootstrap_room": rooms}
    assert [i.bootstrap.room for i in parse_generate(ctx("prefill"), generate).items] == rooms
    completion = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "n": 1,
                  "temperature": 0.20000000298023224, "stream": True,
                  "stream_options": {"include_usage": True}, "logprobs": 0, "echo": False,
                  "stop": "x", "user": "u", "seed": 1, "top_k": 3, "min_p": 0.10000000149011612,
                  "stop_token_ids": [5], "no_stop_trim": False, "ignore_eos": True,
                  "skip_special_tokens": True, "return_hidden_states": False, "rid": "abc",
                  "max_completion_tokens": 3, **BOOT}
    req = parse_openai(ctx("prefill"), completion, False)
    assert req.logprobs and req.items[0].request_id == "abc"
    assert req.items[0].params.max_new_tokens == 4  # completions read max_tokens first
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
            "model": "tiny", "frequency_penalty": 0.0, "logprobs": True,
            "max_completion_tokens": 4, "n": 1, "presence_penalty": 0.0, "seed": 7,
            "stop": ["a", "b"], "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0.0, "top_logprobs": 0, "top_p": 1.0, "top_k": 3, "min_p": 0.0,
            "stop_token_ids": [5], "no_stop_trim": False, "ignore_eos": False,
            "continue_final_message": False, "skip_special_tokens": True,
            "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
            **BOOT}
    assert parse_openai(ctx("decode"), chat, True).items[0].params.stop == ("a", "b")


def test_vllm_prefill_leg_drops_min_tokens_only_there():
    kv = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
          "remote_block_ids": None, "remote_host": None, "remote_port": None}
    body = {"prompt": "a", "max_tokens": 1, "min_tokens": 1, "kv_transfer_params": kv}
    req = parse_openai(ctx("prefill"), body, False)
    assert req.kv_transfer_params == kv and req.items[0].bootstrap is None
    assert parse_openai(ctx("colocated"), {"prompt": "a", "min_tokens": 3}, False).items[0].params.min_new_tokens == 3
    with pytest.raises(RequestError) as info:  # past max_tokens (16 by default)
        parse_openai(ctx("colocated"), {"prompt": "a", "min_tokens": 17}, False)
    assert error_param(info.value) == "min_tokens"


@pytest.mark.parametrize("is_chat, body, param", [
    (False, {"prompt": "a", "logprobs": 21}, "logprobs"),
    (False, {"prompt": "a", "logprobs": -1}, "logprobs"),
    (False, {"prompt": "a", "n": 33}, "n"),
    (True, {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    (False, {"prompt": "a", "echo": 1}, "echo"),
    (False, {}, "prompt"),
    (False, {"prompt": []}, "prompt"),
    (False, {"prompt": "a", "temperature": -1}, "temperature"),
    (False, {"prompt": "a", "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    (False, {"prompt": ["a", "b"], "kv_transfer_params": {}}, "kv_transfer_params"),
    (True, {"messages": []}, "messages"),
    (True, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (True, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    (True, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 1}, "top_logprobs"),  # no logprobs
    (True, {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (True, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice"),
    (True, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools"),
    (True, {"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt"),
    (False, {"prompt": "a", "stream_options": []}, "stream_options"),
    # fails if stream_options ignores keys it does not know (the top level refuses them)
    (False, {"prompt": "a", "stream_options": {"include_usage": True, "usage_every": 2}}, "stream_options"),
    (True, {"messages": [{"role": "user", "content": "x"}], "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats"),
    (False, {"prompt": "a", "presence_penalty": -2.5}, "presence_penalty"),
    (True, {"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}, "repetition_penalty"),
    (False, {"prompt": "a", "logit_bias": {"1": "x"}}, "logit_bias.1"),
    (False, {"prompt": "a", "logit_bias": {"100000": 1}}, "logit_bias"),
    (False, {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    (True, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}, "ebnf": "x"},
     "ebnf,response_format"),
    (False, {"prompt": "a", "stop_token_ids": [1, "x"]}, "stop_token_ids[1]"),
    (False, {"prompt": "a", "max_completion_tokens": -1}, "max_completion_tokens"),
    (True, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
     "max_completion_tokens"),
    (True, {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    (True, {"messages": [{"role": "user", "content": "x"}], "user": 5}, "user"),
    (False, {"prompt": "a", "model": 5}, "model"),
])
def test_openai_rejects_naming_the_field(is_chat, body, param):
    with pytest.raises(RequestError) as info:
        parse_openai(ctx(), body, is_chat)
    assert error_param(info.value) == param, str(info.value)


def test_rendered_chat_text_is_encoded_without_adding_special_tokens():
    class WithBos(CharTokenizer):
        def encode(self, text, add_special_tokens=True):
            return ([1] if add_special_tokens else []) + super().encode(text)

        def apply_chat_template(self, messages, add_generation_prompt=True):
            return "<s>" + "".join(m["content"] for m in messages)

    c = ParseContext("colocated", WithBos(), 1000, None, 8998, "r")
    chat = parse_openai(c, {"messages": [{"role": "user", "content": "x"}]}, True)
    assert chat.items[0].prompt_ids == [ord(ch) for ch in "<s>x"]
    completion = parse_openai(c, {"prompt": "x"}, False)
    assert completion.items[0].prompt_ids == [1, ord("x")]


def test_chat_template_errors_become_400():
    class Strict(CharTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True):
            raise ValueError("conversation roles must alternate")

    c = ParseContext("colocated", Strict(), 100, None, 8998, "r")
    with pytest.raises(FieldError) as info:
        parse_openai(c, {"messages": [{"role": "user", "content": "x"}]}, True)
    assert info.value.param == "messages" and "alternate" in str(info.value)


def _out(prompt_ids, events, start=0) -> ItemOutput:
    out = ItemOutput(PromptItem("r", prompt_ids, SamplingParams(), None, start))
    for ev in events:
        out.add(ev)
    return out


def test_sglang_logprob_entries_and_clamping():
    assert sglang_logprobs([5, 6], [None, -math.inf], None) == [[None, 5, None],
                                                                [-999999999.0, 6, None]]
    assert sglang_logprobs([65], [-0.25], CharTokenizer()) == [[-0.25, 65, "A"]]
    assert clean_logprob(math.nan) is None


def test_generate_response_single_has_meta_and_top_level_kv():
    req = parse_generate(ctx(), {"text": "abc", "return_logprob": True, "logprob_start_len": 0})
    ev = GenerateEvent([1, 2], [-0.1, -0.2], "xy", True, {"type": "length", "length": 2},
                       {"input_token_logprobs": [None, -1.0, -2.0],
                        "kv_transfer_params": {"bootstrap_room": 1}})
    out = _out([97, 98, 99], [ev])
    body = generate_response([out], req, CharTokenizer(), 0.5)
    assert body["text"] == "xy" and body["output_ids"] == [1, 2]
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 2}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 2, 0)
    assert meta["e2e_latency"] == 0.5
    assert meta["input_token_logprobs"] == [[None, 97, None], [-1.0, 98, None], [-2.0, 99, None]]
    assert meta["output_token_logprobs"] == [[-0.1, 1, None], [-0.2, 2, None]]
    assert body["kv_transfer_params"] == {"bootstrap_room": 1}


def test_openai_response_shapes():
    ev = GenerateEvent([65, 66], [-0.5, -1.0], "AB", True, {"type": "stop", "matched": 2}, {})
    body = openai_response([_out([1, 2, 3], [ev])], is_chat=True, logprobs=True, model="m",
                           response_id="chatcmpl-x", created=1, tokenizer=CharTokenizer())
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-x"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "AB"}
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == 2
    assert choice["logprobs"]["content"][1] == {"token": "B", "logprob": -1.0, "bytes": [66],
                                                "top_logprobs": []}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert "kv_transfer_params" not in body


def test_completion_logprobs_offsets_continue():
    lp = completion_logprobs(CharTokenizer(), [65, 66], [-1.0, -2.0], 3)
    assert lp == {"tokens": ["A", "B"], "token_logprobs": [-1.0, -2.0], "top_logprobs": None,
                  "text_offset": [3, 4]}
    assert chat_logprobs(CharTokenizer(), [], []) == {"content": []}


@pytest.mark.parametrize("exc, status, kind", [
    (RequestError("top_p must be in (0, 1], got 2"), 400, "invalid_request_error"),
    (OverloadedError("queue full"), 503, "overloaded_error"),
    (PeerUnavailableError("prefill gone"), 503, "peer_unavailable_error"),
    (TransferError("write failed"), 502, "transfer_error"),
    (TimeoutError(), 504, "timeout_error"),
    (KeyError("x"), 500, "internal_server_error"),
])
def test_error_info(exc, status, kind):
    got_status, body, headers = error_info(exc, 7.0)
    assert got_status == status and body["error"]["code"] == status
    assert body["error"]["type"] == kind
    assert ("Retry-After" in headers) == (status == 503)
    if isinstance(exc, RequestError):
        assert body["error"]["param"] == "top_p"


@given(st.lists(st.tuples(st.lists(st.integers(0, 999), max_size=3), st.text(max_size=4)),
                min_size=1, max_size=8))
def test_accumulated_output_is_the_concatenation_of_deltas(steps):
    events = [GenerateEvent(ids, [], text, i == len(steps) - 1,
                            {"type": "length", "length": 1} if i == len(steps) - 1 else None)
              for i, (ids, text) in enumerate(steps)]
    out = _out([1], events)
    assert out.text == "".join(t for _, t in steps)
    assert out.token_ids == [t for ids, _ in steps for t in ids]
    assert out.finished and out.num_completion_tokens == len(out.token_ids)
