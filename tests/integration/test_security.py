"""Authentication on both planes, through real daemons (DESIGN §8).

Control plane: keys made by ``kvferry keygen``; the prefill runs CURVE with an allow-list holding
only the decode's public key. The allowed decode gets correct output; a decode holding a key of its
own (the "intruder") never completes the handshake, so its request fails with a clear error and
none of its frames reaches the prefill. Raw sockets show the same from outside the daemons.

Client plane: with ``--api-key`` every generation and info route answers 401 without the right
Bearer token, the health and metrics routes stay open, and the right token gets through.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from kvferry.common.wire import messages as wire
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.daemon.procs import Proc, http_json
from kvferry.common.transport.zmq import load_keys
from tests.cluster import REPO, SLACK_S, Cluster, metric

pytestmark = pytest.mark.timeout(600)

API_KEY = "s3cret-token"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [5, 17, 99, 260, 311, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
SAMPLING = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
INTRUDER_REGISTER_TIMEOUT_S = 10.0


@dataclass
class Secure:
    prefill: Proc
    decode: Proc
    intruder: Proc
    keys: Path


def keygen(directory: Path, name: str) -> None:
    subprocess.run([sys.executable, "-m", "kvferry.common.cli", "keygen", str(directory), "--name", name], cwd=REPO,
                   check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def secure(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("security")
    keys, authorized = root / "keys", root / "authorized"
    for name in ("prefill", "decode", "intruder"):
        keygen(keys, name)
    authorized.mkdir()
    shutil.copy(keys / "decode.key", authorized / "decode.key")  # the public half only
    cluster = Cluster(root / "logs", *tiny_models)
    try:
        prefill = cluster.prefill(extra=["--curve-secret-key", str(keys / "prefill.key_secret"),
                                         "--curve-authorized-keys", str(authorized), "--api-key", API_KEY])
        client = ["--curve-server-key", str(keys / "prefill.key"), "--api-key", API_KEY]
        decode = cluster.decode(extra=["--curve-secret-key", str(keys / "decode.key_secret"), *client])
        intruder = cluster.decode(extra=["--curve-secret-key", str(keys / "intruder.key_secret"), *client,
                                         "--register-timeout-s", str(INTRUDER_REGISTER_TIMEOUT_S)])
        yield Secure(prefill, decode, intruder, keys)
    finally:
        cluster.stop_all()


def legs(prefill: Proc, decode: Proc, body: dict, path: str = "/generate", headers: dict | None = AUTH):
    """Both legs of one request at once, as sglang-router sends them: (prefill answer, decode answer)."""
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(http_json, p.url + path, {**body, **boot}, timeout_s=60, headers=headers)
                   for p in (prefill, decode)]
        return tuple(f.result() for f in futures)


def test_allowed_decode_gets_correct_output_over_curve(secure, colocated):
    expected = colocated(False).generate([PROMPT], SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                  ignore_eos=True))[0].output_ids
    (ps, pa), (ds, da) = legs(secure.prefill, secure.decode, {"input_ids": PROMPT, "sampling_params": SAMPLING})
    assert ps == 200, pa
    assert ds == 200, da
    assert da["output_ids"] == expected
    completion = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    (ps, pa), (ds, da) = legs(secure.prefill, secure.decode, completion, path="/v1/completions")
    assert (ps, ds) == (200, 200), (pa, da)
    assert da["usage"]["completion_tokens"] == 6


def test_decode_with_unlisted_key_cannot_register(secure):
    registrations = metric(secure.prefill, "kvferry_registrations_total")
    bad_frames = metric(secure.prefill, "kvferry_protocol_errors_total")
    body = {"input_ids": PROMPT, "sampling_params": SAMPLING, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": secure.prefill.bootstrap_port, "bootstrap_room": random.getrandbits(63)}
    started = time.monotonic()
    status, answer = http_json(secure.intruder.url + "/generate", body, timeout_s=60, headers=AUTH)
    elapsed_s = time.monotonic() - started
    assert status == 503, answer
    message = answer["error"]["message"]
    assert f"127.0.0.1:{secure.prefill.bootstrap_port}" in message and "CURVE key" in message, message
    assert elapsed_s < INTRUDER_REGISTER_TIMEOUT_S + SLACK_S, f"the refusal took {elapsed_s:.1f}s"
    # Nothing of the intruder's reached the prefill's handler; its ZAP check logged the key.
    assert metric(secure.prefill, "kvferry_registrations_total") == registrations
    assert metric(secure.prefill, "kvferry_protocol_errors_total") == bad_frames
    intruder_public = load_keys(secure.keys / "intruder.key")[0].decode()
    deadline = time.monotonic() + 10
    while intruder_public not in secure.prefill.tail(200_000) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"refused a CURVE client key={intruder_public}" in secure.prefill.tail(200_000)
    assert secure.intruder.is_alive() and secure.prefill.is_alive()


def raw_ping(port: int, keys: tuple[bytes, bytes, bytes] | None, wait_s: float) -> wire.Message | None:
    """A ping from a raw DEALER (CURVE when ``keys`` = client public, client secret, server public);
    the answer, or None when nothing came back within ``wait_s``."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # a handshake refused before the send leaves the DEALER no pipe, and its send would block for good
        sock.setsockopt(zmq.SNDTIMEO, int(wait_s * 1000))
        if keys is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
        sock.connect(f"tcp://127.0.0.1:{port}")
        try:
            sock.send(wire.encode(wire.Ping(t=1.0)))  # queued until (unless) the handshake completes
        except zmq.Again:
            return None
        return wire.decode(sock.recv()) if sock.poll(int(wait_s * 1000)) else None
    finally:
        ctx.destroy(linger=0)


def test_raw_clients_need_a_listed_curve_key(secure):
    port, keys = secure.prefill.bootstrap_port, secure.keys
    server_public = load_keys(keys / "prefill.key")[0]
    bad_frames = metric(secure.prefill, "kvferry_protocol_errors_total")
    decode_public, decode_secret = load_keys(keys / "decode.key_secret")
    assert raw_ping(port, (decode_public, decode_secret, server_public), 30) == wire.Pong(t=1.0)
    intruder_public, intruder_secret = load_keys(keys / "intruder.key_secret")
    assert raw_ping(port, (intruder_public, intruder_secret, server_public), 2) is None
    assert raw_ping(port, None, 2) is None  # no CURVE at all: the handshake itself fails
    assert metric(secure.prefill, "kvferry_protocol_errors_total") == bad_frames


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions", "/server_info",
                                  "/v1/models"])
@pytest.mark.parametrize("headers", [None, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}, {"Authorization": "Bearer "}],
                         ids=["none", "wrong", "no-scheme", "basic", "empty"])
def test_api_key_is_required_on_every_serving_route(secure, path, headers):
    body = None if path in ("/server_info", "/v1/models") else {"input_ids": [5, 6], "prompt": "hi"}
    for proc in (secure.prefill, secure.decode):
        status, answer = http_json(proc.url + path, body, timeout_s=30, headers=headers)
        assert status == 401, (proc.name, path, answer)
        assert answer["error"]["type"] == "authentication_error" and "API key" in answer["error"]["message"]


def test_health_and_metrics_stay_open_and_the_key_opens_the_rest(secure):
    for proc in (secure.prefill, secure.decode):
        for path in ("/health", "/readiness", "/metrics"):
            assert http_json(proc.url + path, timeout_s=30)[0] == 200, (proc.name, path)
        status, info = http_json(proc.url + "/server_info", timeout_s=30, headers=AUTH)
        assert status == 200 and info["role"] in ("prefill", "decode"), info
