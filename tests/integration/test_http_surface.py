"""The HTTP surface of the daemon pair, driven the way sglang-router drives it: the same body, plus
bootstrap_host/port/room, sent to the prefill and the decode at once. Every answer is checked
against the colocated engine: SGLang `/generate`, `/v1/completions`, `/v1/chat/completions`,
streaming and not, logprobs, usage, incremental detokenization, concurrency, and the errors."""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.api.sampling_schema import openai_params, sglang_params
from tests.cluster import Cluster, free_pages

PROMPT = "The ferry leaves the north pier at seven"
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_models):
    """One prefill and one decode for the whole module. The short transfer wait bounds how long
    the prefill holds a room whose decode never asks for it (the geometry case)."""
    c = Cluster(tmp_path_factory.mktemp("http") / "logs", *tiny_models)
    try:
        procs = [c.prefill(extra=["--transfer-wait-timeout-s", "4"], start=False), c.decode(start=False)]
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready(180)
        yield c, *procs
    finally:
        c.stop_all()


def sse_events(raw: str) -> list:
    """`data: {...}` events separated by blank lines, the last one `data: [DONE]`."""
    assert raw.endswith("\n\n"), raw[-200:]
    events = []
    for block in raw[:-2].split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def call(url: str, body: dict, timeout_s: float = 120.0):
    """POST JSON; returns (status, parsed JSON, or the list of SSE payloads for a stream)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, ctype, raw = resp.status, resp.headers.get("content-type", ""), resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, ctype, raw = exc.code, exc.headers.get("content-type", ""), exc.read().decode()
    return status, sse_events(raw) if ctype.startswith("text/event-stream") else json.loads(raw)


def route(prefill, decode, path: str, body: dict):
    """Both legs at once with a fresh room, as sglang-router sends them: (prefill, decode) answers."""
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    out: dict[str, tuple] = {}

    def leg(name: str, proc) -> None:
        out[name] = call(proc.url + path, {**body, **boot})

    threads = [threading.Thread(target=leg, args=a) for a in (("prefill", prefill), ("decode", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(130)
    return out["prefill"], out["decode"]


def ok(answer):
    status, body = answer
    assert status == 200, body
    return body


def reference(colocated, prompt, params: SamplingParams, **kw):
    return colocated(False).generate([prompt], params, **kw)[0]


def test_generate_json_and_stream(pd, colocated):
    _, prefill, decode = pd
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    ref = reference(colocated, PROMPT, sglang_params(body["sampling_params"]))
    first, out = map(ok, route(prefill, decode, "/generate", body))
    assert (out["text"], out["output_ids"]) == (ref.text, ref.output_ids)
    meta = out["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ref.prompt_ids), len(ref.output_ids))
    assert meta["finish_reason"] == ref.finish_reason
    assert first["output_ids"] == ref.output_ids[:1] and first["meta_info"]["prompt_tokens"] == len(ref.prompt_ids)

    _, events = map(ok, route(prefill, decode, "/generate", {**body, "stream": True}))
    assert len(events) > 1
    for ev in events:  # cumulative: every event repeats the text and ids so far
        assert ref.text.startswith(ev["text"]) and ref.output_ids[:len(ev["output_ids"])] == ev["output_ids"]
    last = events[-1]
    assert (last["text"], last["output_ids"]) == (ref.text, ref.output_ids)
    assert last["meta_info"]["finish_reason"] == ref.finish_reason
    assert last["meta_info"]["completion_tokens"] == len(ref.output_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs(pd, colocated, stream):
    _, prefill, decode = pd
    rng = random.Random(3)
    ids = [rng.randrange(5, 512) for _ in range(40)]
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "stream": stream,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    ref = reference(colocated, ids, sglang_params(body["sampling_params"]), return_logprob=True)
    first, out = map(ok, route(prefill, decode, "/generate", body))
    # The prefill answers one JSON object even to a stream, so that sglang-router can merge its
    # input_token_logprobs into the decode's chunks (docs/routers.md).
    assert isinstance(first, dict)
    out = out[-1] if stream else out
    got = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in got] == ref.output_ids
    assert [lp for lp, _, _ in got] == pytest.approx(ref.output_logprobs, abs=1e-4)
    # The decode returns the prompt logprobs the prefill sent it; the prefill's answer lists none,
    # so sglang-router, which prepends the prefill's list, shows them once.
    assert first["meta_info"]["input_token_logprobs"] == []
    prompt_lps = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in prompt_lps] == ids
    assert prompt_lps[0][0] is None  # the first prompt token has no logprob
    assert [lp for lp, _, _ in prompt_lps[1:]] == pytest.approx(ref.input_logprobs[1:], abs=1e-4)
    assert first["meta_info"]["output_token_logprobs"][0][:2] == pytest.approx(got[0][:2], abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_completions(pd, colocated, stream):
    _, prefill, decode = pd
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    ref = reference(colocated, PROMPT, openai_params(body, chat=False))
    usage = {"prompt_tokens": len(ref.prompt_ids), "completion_tokens": len(ref.output_ids),
             "total_tokens": len(ref.prompt_ids) + len(ref.output_ids)}
    _, out = map(ok, route(prefill, decode, "/v1/completions", body))
    if not stream:
        assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
        assert out["choices"][0]["text"] == ref.text
        assert out["choices"][0]["finish_reason"] == ref.finish_reason["type"]
        assert out["usage"] == usage
        return
    *chunks, tail = out
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == ref.finish_reason["type"]
    assert tail["choices"] == [] and tail["usage"] == usage


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_apply_the_template(pd, colocated, tok, stream):
    _, prefill, decode = pd
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "stream": stream}
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True), add_special_tokens=False)
    ref = reference(colocated, ids, openai_params(body, chat=True))
    _, out = map(ok, route(prefill, decode, "/v1/chat/completions", body))
    if not stream:
        assert out["object"] == "chat.completion"
        assert out["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
        assert out["choices"][0]["finish_reason"] == ref.finish_reason["type"]
        assert out["usage"]["prompt_tokens"] == len(ids)  # the server rendered the same template
        assert out["usage"]["completion_tokens"] == len(ref.output_ids)
        return
    assert all(c["object"] == "chat.completion.chunk" for c in out)
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in out[1:]) == ref.text
    assert out[-1]["choices"][0]["finish_reason"] == ref.finish_reason["type"]


def test_incremental_detokenization_of_multibyte_characters(pd, colocated):
    """A hot sampled request emits raw UTF-8 bytes; pick a seed whose output joins some into a
    real multi-byte character. No streamed text may show a character before its last byte."""
    _, prefill, decode = pd
    sampling = {"max_new_tokens": 64, "temperature": 4.0}
    for seed in range(60):
        params = sglang_params({**sampling, "seed": seed})
        ref = reference(colocated, PROMPT, params)
        if any(ord(c) > 127 and c != "\ufffd" for c in ref.text):
            break  # tiny-model tokens past ASCII are single bytes: that character spans tokens
    else:
        pytest.fail("no seed in 0..59 produced a multi-byte character; the tiny model changed?")
    body = {"text": PROMPT, "stream": True, "sampling_params": {**sampling, "seed": seed}}
    _, events = map(ok, route(prefill, decode, "/generate", body))
    assert all(ref.text.startswith(ev["text"]) for ev in events)  # never retracted
    assert events[-1]["text"] == ref.text and events[-1]["output_ids"] == ref.output_ids
    body = {"prompt": PROMPT, "stream": True, "max_tokens": 64, "temperature": 4.0, "seed": seed}
    _, chunks = map(ok, route(prefill, decode, "/v1/completions", body))
    # A delta sent before a character's last byte would carry U+FFFD where the text has the character.
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text


def test_sixteen_concurrent_requests_mixed(pd, colocated):
    """Greedy and seeded sampling, different prompt and output lengths, streaming and not, all
    at once: each equals the colocated engine (same seeds: the prefill samples the first token
    with the request's seed, the decode continues with decode_seed(seed), as the engine does)."""
    _, prefill, decode = pd
    rng = random.Random(16)
    prompts, samplings = [], []
    for i in range(16):
        prompts.append([rng.randrange(5, 512) for _ in range(rng.randrange(3, 400))])
        s = {"max_new_tokens": rng.randrange(4, 40), "ignore_eos": True}
        s.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i})
        samplings.append(s)
    refs = colocated(False).generate(prompts, [sglang_params(s) for s in samplings])

    def one(i: int):
        body = {"input_ids": prompts[i], "sampling_params": samplings[i], "stream": i % 4 < 2}
        _, out = map(ok, route(prefill, decode, "/generate", body))
        return out[-1] if body["stream"] else out

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(one, range(16)))
    assert [o["output_ids"] for o in outs] == [r.output_ids for r in refs]
    assert [o["text"] for o in outs] == [r.text for r in refs]
    assert [o["meta_info"]["finish_reason"] for o in outs] == [r.finish_reason for r in refs]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(p) for p in prompts]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
@pytest.mark.parametrize("given", [{}, {"bootstrap_host": "127.0.0.1"}, {"bootstrap_room": 7}])
def test_missing_bootstrap_fields_are_400(pd, path, given):
    _, prefill, decode = pd
    body = {"input_ids": [5, 6, 7]} if path == "/generate" else {"prompt": [5, 6, 7], "max_tokens": 2}
    missing = [k for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room") if k not in given]
    for proc in (prefill, decode):
        status, out = call(proc.url + path, {**body, **given})
        assert status == 400, out
        assert out["error"]["type"] == "invalid_request_error"
        assert out["error"]["param"] == ",".join(missing)
        assert all(k in out["error"]["message"] for k in missing)


def test_geometry_rejection_names_the_reason_and_prefill_keeps_serving(pd, colocated):
    c, prefill, decode = pd
    other = c.decode(extra=["--dtype", "bfloat16"])
    before = free_pages(prefill)
    body = {"input_ids": list(range(5, 45)), "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    try:
        with ThreadPoolExecutor(1) as pool:
            rejected = pool.submit(route, prefill, other, "/generate", body)
            # While that room waits, the prefill serves a matching decode.
            _, out = map(ok, route(prefill, decode, "/generate", body))
            (p_status, p_out), (d_status, d_out) = rejected.result(timeout=60)
    finally:
        other.stop(20)
    ref = reference(colocated, body["input_ids"], SamplingParams(max_new_tokens=4, temperature=0))
    assert out["output_ids"] == ref.output_ids
    assert d_status == 502 and d_out["error"]["type"] == "geometry_mismatch_error"
    message = d_out["error"]["message"]
    assert "kv_dtype" in message and "float32" in message and "bfloat16" in message
    # No decode ever asked for that room: the prefill gives it up after its transfer wait.
    assert p_status == 502 and p_out["error"]["type"] == "transfer_error", p_out
    assert free_pages(prefill) == before
    _, again = map(ok, route(prefill, decode, "/generate", body))
    assert again["output_ids"] == ref.output_ids
