"""Fixtures shared by the integration and fault suites: the tiny checkpoint, a colocated reference
engine, and a cluster of real daemon processes on loopback."""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvferry.common.daemon.procs import Proc, free_port, http_json, router_proc, vllm_router_proc, worker_proc

REPO = Path(__file__).resolve().parents[1]
TINY_DIR = REPO / ".tiny" / "seed0"
# The one margin a wall-clock check in the suite allows over the daemon deadline it derives from
# (scheduling noise on a loaded 2-core CI machine); every such check uses it.
SLACK_S = 2.0


def tiny_model_dirs() -> tuple[str, str]:
    """The embedded tiny checkpoint (target, draft), made once per machine under .tiny/."""
    from kvferry.common.models.tiny import ensure_tiny_model

    target, draft = ensure_tiny_model(TINY_DIR, seed=0)
    return str(target), str(draft)


def tiny_runner(*, draft: bool, max_total_tokens: int = 4096):
    """A ModelRunner over the tiny checkpoint (with its draft or not), one thread, 16-token pages."""
    from kvferry.common.engine.factory import build_runner

    torch.set_num_threads(1)
    target, draft_dir = tiny_model_dirs()
    return build_runner(target, draft_dir if draft else None, page_size=16, max_total_tokens=max_total_tokens)


@pytest.fixture(scope="session")
def tiny_models() -> tuple[str, str]:
    return tiny_model_dirs()


@pytest.fixture(scope="session")
def tok(tiny_models):
    """The tiny checkpoint's tokenizer."""
    from kvferry.common.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_models[0])


class Cluster:
    """Real prefill/decode/router processes; everything is stopped at teardown."""

    def __init__(self, log_dir: Path, target: str, draft: str):
        self.log_dir, self.target, self.draft = log_dir, target, draft
        self.procs: list[Proc] = []
        # DEBUG: the prefill logs which path each room took (room_event reads those lines).
        self.env = {"OMP_NUM_THREADS": "1", "KVFERRY_HEARTBEAT_INTERVAL_S": "0.5", "KVFERRY_LOG_LEVEL": "debug"}

    def prefill(self, *, draft: bool = False, extra: list[str] | None = None, port: int | None = None,
                bootstrap_port: int | None = None, start: bool = True, env: dict | None = None) -> Proc:
        p = worker_proc("prefill", self.target, port=port, log_dir=self.log_dir,
                        draft=self.draft if draft else None, bootstrap_port=bootstrap_port,
                        pick_bootstrap_port=bootstrap_port is None, extra=extra, env={**self.env, **(env or {})})
        return self._add(p, start)

    def decode(self, *, draft: bool = False, extra: list[str] | None = None, port: int | None = None,
               start: bool = True, env: dict | None = None) -> Proc:
        p = worker_proc("decode", self.target, port=port, log_dir=self.log_dir,
                        draft=self.draft if draft else None, extra=extra, env={**self.env, **(env or {})})
        return self._add(p, start)

    def colocated_server(self, *, draft: bool = False, max_total_tokens: int = 16384) -> Proc:
        """The colocated server over the same checkpoint: the daemons' HTTP layer, prefill scheduler
        and continuous batcher in one process (``common/engine/colocated_server.py``)."""
        port = free_port()
        args = [sys.executable, "-m", "kvferry.common.engine.colocated_server", "--model", self.target, "--port", str(port),
                "--max-total-tokens", str(max_total_tokens), *(["--draft-model", self.draft] if draft else [])]
        return self._add(Proc(f"colocated:{port}", args, f"http://127.0.0.1:{port}",
                              self.log_dir / f"colocated-{port}.log", env=dict(self.env), picked=("--port",)), True)

    def router(self, prefills: list[Proc], decodes: list[Proc], extra: list[str] | None = None) -> Proc:
        p = router_proc([(x.url, x.bootstrap_port) for x in prefills], [x.url for x in decodes],
                        port=None, log_dir=self.log_dir, extra=extra)
        return self._add(p, True, ready_path="/readiness")

    def vllm_router(self, prefills: list[Proc], decodes: list[Proc], extra: list[str] | None = None) -> Proc:
        """vllm-router (two-stage PD); the workers must already answer /health."""
        p = vllm_router_proc([(x.url, x.bootstrap_port) for x in prefills], [x.url for x in decodes],
                             port=None, log_dir=self.log_dir, extra=extra)
        return self._add(p, True, ready_path="/readiness")

    def pair(self) -> tuple[Proc, Proc, dict]:
        """A prefill and a decode started side by side; returns them and their free pages now."""
        prefill, decode = self.prefill(start=False), self.decode(start=False)
        for p in (prefill, decode):
            p.start()
        for p in (prefill, decode):
            p.wait_ready(180)
        return prefill, decode, {p.name: free_pages(p) for p in (prefill, decode)}

    def _add(self, p: Proc, start: bool, ready_path: str = "/health") -> Proc:
        self.procs.append(p)
        if start:
            p.start()
            p.wait_ready(180, path=ready_path)
        return p

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            p.stop(20)


@pytest.fixture
def cluster(tmp_path, tiny_models):
    c = Cluster(tmp_path / "logs", *tiny_models)
    yield c
    c.stop_all()


def free_pages(proc: Proc) -> dict:
    status, info = http_json(proc.url + "/server_info", timeout_s=10)
    assert status == 200, info
    return info["free_pages"]


def metric(proc: Proc, name: str, **labels: str) -> float:
    """The sum of ``proc``'s Prometheus samples of series ``name`` (exactly, as /metrics writes it:
    a counter with its ``_total``) whose label set includes ``labels``, e.g.
    ``metric(p, "kvferry_staging_rooms_total", path="staged")``; 0.0 while no such sample is
    exported (a labelled series appears with its first event)."""
    status, text = http_json(proc.url + "/metrics", timeout_s=10)
    assert status == 200, text
    total = 0.0
    for label_set, value in re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", str(text), re.M):
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', label_set))
        if all(have.get(key) == str(want) for key, want in labels.items()):
            total += float(value)
    return total


def with_kv_scales(source: str, target: Path, k_scale: float, v_scale: float) -> str:
    """A copy of checkpoint ``source`` at ``target`` whose every layer carries one-element
    ``self_attn.k_scale`` / ``v_scale`` tensors (what an FP8 KV pool reads: ``loader.read_kv_scales``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kvferry.common.models.config import ModelConfig

    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    for i in range(ModelConfig.from_dir(target).num_hidden_layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(tensors, str(target / "model.safetensors"))
    return str(target)


def settle_prefix_cache(proc: Proc, cached_before: int, timeout_s: float = 10.0) -> None:
    """Wait (bounded) until ``proc``'s prefix cache holds more than ``cached_before`` pages: a client
    has its answer from the decode while the prefill may still be closing that room's leg, which is
    when it caches the prompt. A settle, not a check: at the deadline it returns as it is."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, info = http_json(proc.url + "/server_info", timeout_s=10)
        if status == 200 and info["prefix_cache"]["cached_pages"] > cached_before:
            return
        time.sleep(0.05)


def cached_pages(proc: Proc) -> int:
    status, info = http_json(proc.url + "/server_info", timeout_s=10)
    assert status == 200, info
    return info["prefix_cache"]["cached_pages"]


def assert_pages_return(procs: list[Proc], before: dict, timeout_s: float = 10.0) -> None:
    """Poll until every daemon's free pages equal ``before`` (by name), at most ``timeout_s``: a
    decode frees a finished sequence's pages just after its last event."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = {p.name: free_pages(p) for p in procs}
        if free == before or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    assert free == before


@pytest.fixture(scope="session")
def colocated(tiny_models):
    """Colocated reference engines: ``colocated(draft=False)``; built once per session."""
    from kvferry.common.engine.colocated import ColocatedEngine
    from kvferry.common.engine.factory import build_runner
    from kvferry.common.text.tokenizer import Tokenizer

    torch.set_num_threads(1)
    target, draft = tiny_models
    cache: dict[bool, ColocatedEngine] = {}

    def get(draft_on: bool = False) -> ColocatedEngine:
        if draft_on not in cache:
            runner = build_runner(target, draft if draft_on else None, page_size=16, max_total_tokens=65536)
            cache[draft_on] = ColocatedEngine(runner, Tokenizer.from_dir(target))
        return cache[draft_on]

    return get


# What the prefill logs (at DEBUG) about one room, by event; ``room_event`` waits for them.
ROOM_EVENTS = {
    # the decode's transfer request came first and waits for its room
    "held": r"room={room}: transfer request from decode_id=\S+ came before the room; held",
    # the prefill leg opened the room, and found the transfer request already there / not yet there
    "opened_with_transfer": r"room={room} request_id=\S+ opened: its transfer request was already here",
    "opened_waiting": r"room={room} request_id=\S+ opened: no transfer request yet",
    # the room's forward is done; it waits for its transfer request (or has it)
    "prefilled_waiting": r"room={room} request_id=\S+ prefilled: waiting for the transfer request",
    "prefilled_with_transfer": r"room={room} request_id=\S+ prefilled: transfer request here",
}
# Per leg order: the prefill event that lets the second leg go, the event that must follow it (None:
# nothing more is logged), and the other order's event, which must never appear for that room.
ORDER_EVENTS = {"prefill_first": ("opened_waiting", None, "held"),
                "decode_first": ("held", "opened_with_transfer", "opened_waiting")}


class LogWatch:
    """What a process logs from now on (its log file, read as it grows)."""

    def __init__(self, proc: Proc):
        self.proc, self.text = proc, ""
        self.offset = proc.log_path.stat().st_size if proc.log_path.exists() else 0

    def has(self, pattern: str) -> bool:
        try:
            with open(self.proc.log_path, "rb") as log:
                log.seek(self.offset)
                chunk = log.read()
        except OSError:
            chunk = b""
        self.offset += len(chunk)
        self.text += chunk.decode(errors="replace")
        return re.search(pattern, self.text) is not None

    def wait(self, pattern: str, what: str, *, timeout_s: float = 60.0, unless=None) -> None:
        """Until a line matches ``pattern``. Fails when ``timeout_s`` passes, or at once when the
        ``unless`` thread (what should cause the line) ended without it."""
        deadline = time.monotonic() + timeout_s
        while not self.has(pattern):
            if unless is not None and not unless.is_alive():
                assert self.has(pattern), f"{what}: the leg ended first; log:\n{self.text[-3000:]}"
                return
            assert time.monotonic() < deadline, f"{what}: not logged within {timeout_s}s"
            time.sleep(0.01)


def room_event(watch: LogWatch, room: int, event: str, *, timeout_s: float = 60.0, unless=None) -> None:
    """Wait until the prefill behind ``watch`` logged ``event`` (a ROOM_EVENTS key) for ``room``."""
    watch.wait(ROOM_EVENTS[event].format(room=room), f"prefill event {event} for room {room}",
               timeout_s=timeout_s, unless=unless)


def took_path(watch: LogWatch, room: int, event: str) -> bool:
    return watch.has(ROOM_EVENTS[event].format(room=room))


def assert_order_path(watch: LogWatch, room: int, order: str) -> None:
    """The room took the path of ``order`` (an ORDER_EVENTS key) and not the other order's: a
    prefill_first room's transfer request was never held early, a decode_first room opened with it."""
    _, then, never = ORDER_EVENTS[order]
    assert then is None or took_path(watch, room, then), f"room {room} ({order}): no {then} event"
    assert not took_path(watch, room, never), f"room {room} ({order}) took the other order's path: {never}"


def send_pair(prefill: Proc, decode: Proc, body: dict, *, order: str = "concurrent", room: int | None = None,
              path: str = "/generate", timeout_s: float = 120.0):
    """Send one request to both legs the way a router does; returns (prefill answer, decode answer).

    ``order``: "concurrent" (both at once, as sglang-router), "prefill_first" (the decode leg is
    sent once the prefill has opened the room, which then waits for its transfer request) or
    "decode_first" (the prefill leg is sent once the decode's transfer request is held at the
    prefill, and the room must find it there when it opens).
    """
    import random
    import threading

    room = random.getrandbits(63) if room is None else room
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}
    results: dict[str, tuple] = {}

    def leg(name: str, proc: Proc) -> None:
        results[name] = http_json(proc.url + path, {**body, **boot}, timeout_s=timeout_s)

    first, second = (("prefill", prefill), ("decode", decode)) if order != "decode_first" else \
        (("decode", decode), ("prefill", prefill))
    watch = LogWatch(prefill)
    t1 = threading.Thread(target=leg, args=first)
    t1.start()
    if order != "concurrent":
        room_event(watch, room, ORDER_EVENTS[order][0], timeout_s=timeout_s, unless=t1)
    t2 = threading.Thread(target=leg, args=second)
    t2.start()
    t1.join(timeout_s + 5)
    t2.join(timeout_s + 5)
    if order != "concurrent":
        assert_order_path(watch, room, order)
    return results["prefill"], results["decode"]


@dataclass(frozen=True)
class Answer:
    """One HTTP answer as a client sees it: status, content type and the raw body text."""

    status: int
    content_type: str
    raw: str

    @property
    def is_sse(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    def json(self):
        return json.loads(self.raw)

    def events(self) -> list:
        """The `data:` payloads of an SSE body, JSON-decoded, without the final `[DONE]`."""
        assert self.is_sse, (self.status, self.content_type, self.raw[:500])
        blocks = [b for b in self.raw.split("\n\n") if b.strip()]
        assert blocks and blocks[-1] == "data: [DONE]", self.raw[-500:]
        assert all(b.startswith("data: ") for b in blocks), self.raw[:500]
        return [json.loads(b[len("data: "):]) for b in blocks[:-1]]


def ok(answer: Answer) -> Answer:
    """``answer``, after checking it is a 200."""
    assert answer.status == 200, (answer.status, answer.raw[:1000])
    return answer


def post(url: str, body: dict, *, timeout_s: float = 120.0, headers: dict | None = None) -> Answer:
    """POST JSON and read the whole answer, whatever its status or type."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return Answer(resp.status, resp.headers.get("content-type", ""), resp.read().decode())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.headers.get("content-type", ""), exc.read().decode())
