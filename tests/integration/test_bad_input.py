"""Bad HTTP input through the real daemons: every case is a 4xx whose error names the field, and
both daemons keep serving afterwards (correct output, all pages back).

The prefill runs with the default pool, so its context is the tiny model's
max_position_embeddings (4096); the decode runs with ``--max-total-tokens 1024``, which caps its
context at 1024 tokens. Both take bodies of at most ``MAX_REQUEST_BYTES`` (``--max-request-bytes``).
The decode connects only to the bootstrap hosts of ``KVFERRY_ALLOWED_BOOTSTRAP_HOSTS``.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.daemon.procs import Proc, http_json
from tests.cluster import Cluster, free_pages

pytestmark = pytest.mark.timeout(600)

PROMPT = [5, 17, 99, 260, 311, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
SAMPLING = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
CONTEXT = {"prefill": 4096, "decode": 1024}
MAX_REQUEST_BYTES = 65536  # above every other case's body (the longest, 4,097 ids, is ~20 KB)


@dataclass
class Pair:
    prefill: Proc
    decode: Proc
    pages: tuple[dict, dict]

    def procs(self, role: str) -> list[tuple[str, Proc]]:
        both = [("prefill", self.prefill), ("decode", self.decode)]
        return [(r, p) for r, p in both if role in ("both", r)]

    def boot(self) -> dict:
        return {"bootstrap_host": "127.0.0.1", "bootstrap_port": self.prefill.bootstrap_port,
                "bootstrap_room": random.getrandbits(63)}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_models):
    cluster = Cluster(tmp_path_factory.mktemp("bad_input") / "logs", *tiny_models)
    try:
        limit = ["--max-request-bytes", str(MAX_REQUEST_BYTES)]
        prefill = cluster.prefill(extra=["--transfer-wait-timeout-s", "10"] + limit)
        decode = cluster.decode(extra=["--max-total-tokens", "1024"],
                                env={"KVFERRY_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES),
                                     "KVFERRY_ALLOWED_BOOTSTRAP_HOSTS": "localhost, 127.0.0.1"})
        yield Pair(prefill, decode, (free_pages(prefill), free_pages(decode)))
    finally:
        cluster.stop_all()


def post_raw(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def assert_refused(status: int, answer, field: str, where: str) -> None:
    """400, an OpenAI-style error object, and the field named (as `param` or in the message)."""
    assert status == 400, (where, status, answer)
    error = answer["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error", (where, error)
    assert field in (error["param"] or "") or field in error["message"], (where, field, error)


def long_prompt(n: int) -> list[int]:
    return [5 + i % 500 for i in range(n)]


# (case id, route, role, body without bootstrap fields, field the error must name)
CASES = [
    ("input_ids-str", "/generate", "both", {"input_ids": "1 2 3", "sampling_params": SAMPLING}, "input_ids"),
    ("input_ids-item", "/generate", "both", {"input_ids": [5, "6"], "sampling_params": SAMPLING}, "input_ids[1]"),
    ("input_ids-negative", "/generate", "both", {"input_ids": [5, -6]}, "input_ids[1]"),
    ("input_ids-vocab", "/generate", "both", {"input_ids": [5, 512]}, "input_ids[1]"),
    ("input_ids-empty", "/generate", "both", {"input_ids": []}, "input_ids"),
    ("no-prompt", "/generate", "both", {"sampling_params": SAMPLING}, "text"),
    ("sampling-str", "/generate", "both", {"input_ids": PROMPT, "sampling_params": "greedy"}, "sampling_params"),
    ("stream-str", "/generate", "both", {"input_ids": PROMPT, "stream": "yes"}, "stream"),
    ("max_new-str", "/generate", "both", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": "8"}},
     "max_new_tokens"),
    ("unknown-top", "/generate", "both", {"input_ids": PROMPT, "frobnicate": 1}, "frobnicate"),
    ("unknown-sampling", "/generate", "both", {"input_ids": PROMPT, "sampling_params": {"wobble": 1}}, "wobble"),
    ("unknown-openai", "/v1/completions", "both", {"prompt": PROMPT, "wobble": True}, "wobble"),
    ("too-long-model", "/generate", "both", {"input_ids": long_prompt(4097)}, "input_ids"),
    ("too-long-pool", "/generate", "decode", {"input_ids": long_prompt(1025)}, "input_ids"),
    ("prompt-plus-output", "/generate", "decode",
     {"input_ids": long_prompt(1000), "sampling_params": {"max_new_tokens": 100}}, "sampling_params.max_new_tokens"),
    ("prompt-plus-output-openai", "/v1/completions", "decode", {"prompt": long_prompt(1000), "max_tokens": 100},
     "max_tokens"),
    ("max_new-negative", "/generate", "both", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}},
     "max_new_tokens"),
    ("max_new-huge", "/generate", "both", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2**40}},
     "max_new_tokens"),
    ("max_tokens-negative", "/v1/completions", "both", {"prompt": PROMPT, "max_tokens": -3}, "max_tokens"),
    ("temperature", "/generate", "both", {"input_ids": PROMPT, "sampling_params": {"temperature": -1}},
     "temperature"),
    ("top_p", "/generate", "both", {"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p"),
    ("top_k", "/generate", "both", {"input_ids": PROMPT, "sampling_params": {"top_k": -5}}, "top_k"),
    ("min_p", "/generate", "both", {"input_ids": PROMPT, "sampling_params": {"min_p": 2}}, "min_p"),
    ("temperature-openai", "/v1/completions", "both", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("top_p-chat", "/v1/chat/completions", "both", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0},
     "top_p"),
    ("messages-shape", "/v1/chat/completions", "both", {"messages": "hi"}, "messages"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_body_is_refused_naming_the_field(pair, case):
    _, path, role, body, field = case
    for name, proc in pair.procs(role):
        assert_refused(*http_json(proc.url + path, {**body, **pair.boot()}, timeout_s=30), field, f"{name}{path}")


@pytest.mark.parametrize("data", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b"42", b'"text"'],
                         ids=["broken", "empty", "not-utf8", "array", "number", "string"])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_body_that_is_not_a_json_object_is_refused(pair, data, path):
    for name, proc in pair.procs("both"):
        status, answer = post_raw(proc.url + path, data)
        assert status == 400, (name, path, answer)
        assert "JSON" in answer["error"]["message"], (name, path, answer)


def assert_too_large(status: int, answer, where: str) -> None:
    assert status == 413, (where, status, answer)
    message = answer["error"]["message"]
    assert answer["error"]["code"] == 413 and "--max-request-bytes" in message, (where, answer)
    assert str(MAX_REQUEST_BYTES) in message, (where, answer)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_body_over_max_request_bytes_is_413(pair, path):
    """A body over the limit (the prefill's from its flag, the decode's from the environment) is
    answered 413 naming the limit; a prompt that fits is still served afterwards (last test)."""
    text = "a" * (MAX_REQUEST_BYTES + 1)
    body = {"text": text} if path == "/generate" else {"prompt": text}
    for name, proc in pair.procs("both"):
        status, answer = post_raw(proc.url + path, json.dumps({**body, **pair.boot()}).encode())
        assert_too_large(status, answer, f"{name}{path}")


def test_declared_body_over_max_request_bytes_is_413_before_it_is_sent(pair):
    """A Content-Length over the limit is answered at once: the daemon does not wait for the body."""
    for name, proc in pair.procs("both"):
        host, port = proc.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {10 * MAX_REQUEST_BYTES}\r\n\r\n{{".encode())
            response = http.client.HTTPResponse(conn)
            response.begin()
            assert_too_large(response.status, json.loads(response.read()), name)


BOOTSTRAP_CASES = [
    ("none", {}, "bootstrap_host"),
    ("host-only", {"bootstrap_host": "127.0.0.1"}, "bootstrap_port"),
    ("no-room", {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}, "bootstrap_room"),
    ("host-int", {"bootstrap_host": 7, "bootstrap_port": 8998, "bootstrap_room": 1}, "bootstrap_host"),
    ("port-zero", {"bootstrap_host": "127.0.0.1", "bootstrap_port": 0, "bootstrap_room": 1}, "bootstrap_port"),
    ("port-str", {"bootstrap_host": "127.0.0.1", "bootstrap_port": "8998", "bootstrap_room": 1}, "bootstrap_port"),
    ("room-negative", {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": -1},
     "bootstrap_room"),
    ("room-huge", {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 2**64},
     "bootstrap_room"),
]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
@pytest.mark.parametrize("case", BOOTSTRAP_CASES, ids=[c[0] for c in BOOTSTRAP_CASES])
def test_missing_or_bad_bootstrap_fields_are_refused(pair, case, path):
    _, fields, field = case
    body = {"input_ids": PROMPT} if path == "/generate" else {"prompt": PROMPT}
    for name, proc in pair.procs("both"):
        assert_refused(*http_json(proc.url + path, {**body, **fields}, timeout_s=30), field, f"{name}{path}")


def test_bootstrap_host_outside_the_decodes_allow_list_is_refused(pair):
    """A request naming a bootstrap host the decode is not configured to trust is a 400 naming
    --allowed-bootstrap-hosts, answered without connecting there; its pages go back (last test)."""
    for path, body in (("/generate", {"input_ids": PROMPT}), ("/v1/completions", {"prompt": PROMPT})):
        body = {**body, **pair.boot(), "bootstrap_host": "10.255.255.1"}
        assert_refused(*http_json(pair.decode.url + path, body, timeout_s=30), "--allowed-bootstrap-hosts",
                       f"decode{path}")


def test_daemons_keep_serving_after_bad_input(pair, colocated):
    """Runs last: both daemons answer health, a real request is correct, every page is free."""
    expected = colocated(False).generate([PROMPT], SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                  ignore_eos=True))[0].output_ids
    for proc in (pair.prefill, pair.decode):
        assert proc.is_alive(), proc.tail()
        assert http_json(proc.url + "/health", timeout_s=30)[0] == 200
    boot = pair.boot()
    with ThreadPoolExecutor(2) as pool:
        legs = [pool.submit(http_json, p.url + "/generate", {"input_ids": PROMPT, "sampling_params": SAMPLING, **boot},
                            timeout_s=60) for p in (pair.prefill, pair.decode)]
        (ps, pa), (ds, da) = (leg.result() for leg in legs)
    assert ps == 200 and ds == 200, (pa, da)
    assert da["output_ids"] == expected
    assert (free_pages(pair.prefill), free_pages(pair.decode)) == pair.pages
