"""Fixtures shared by the integration and fault suites: the tiny checkpoint, a colocated reference
engine, and a cluster of real daemon processes on loopback."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from common.procs import Proc, http_json, router_proc, vllm_router_proc, worker_proc

REPO = Path(__file__).resolve().parents[1]
TINY_DIR = REPO / ".tiny" / "seed0"


def tiny_model_dirs() -> tuple[str, str]:
    """The embedded tiny checkpoint (target, draft), made once per machine under .tiny/."""
    from common.model.tiny import ensure_tiny_model

    target, draft = ensure_tiny_model(TINY_DIR, seed=0)
    return str(target), str(draft)


@pytest.fixture(scope="session")
def tiny_models() -> tuple[str, str]:
    return tiny_model_dirs()


class Cluster:
    """Real prefill/decode/router processes; everything is stopped at teardown."""

    def __init__(self, log_dir: Path, target: str, draft: str):
        self.log_dir, self.target, self.draft = log_dir, target, draft
        self.procs: list[Proc] = []
        self.env = {"OMP_NUM_THREADS": "1", "KVFERRY_HEARTBEAT_INTERVAL_S": "0.5"}

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
    from common.engine.colocated import ColocatedEngine
    from common.engine.factory import build_runner
    from common.model.tokenizer import Tokenizer

    torch.set_num_threads(1)
    target, draft = tiny_models
    cache: dict[bool, ColocatedEngine] = {}

    def get(draft_on: bool = False) -> ColocatedEngine:
        if draft_on not in cache:
            runner = build_runner(target, draft if draft_on else None, page_size=16, max_total_tokens=65536)
            cache[draft_on] = ColocatedEngine(runner, Tokenizer.from_dir(target))
        return cache[draft_on]

    return get


def send_pair(prefill: Proc, decode: Proc, body: dict, *, order: str = "concurrent", room: int | None = None,
              path: str = "/generate", gap_s: float = 0.2, timeout_s: float = 120.0):
    """Send one request to both legs the way a router does; returns (prefill answer, decode answer).

    ``order``: "concurrent" (both at once, as sglang-router), "prefill_first" or "decode_first"
    (the other leg follows after ``gap_s``).
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
    t1 = threading.Thread(target=leg, args=first)
    t1.start()
    if order != "concurrent":
        import time

        time.sleep(gap_s)
    t2 = threading.Thread(target=leg, args=second)
    t2.start()
    t1.join(timeout_s + 5)
    t2.join(timeout_s + 5)
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


def post(url: str, body: dict, *, timeout_s: float = 120.0, headers: dict | None = None) -> Answer:
    """POST JSON and read the whole answer, whatever its status or type."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return Answer(resp.status, resp.headers.get("content-type", ""), resp.read().decode())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.headers.get("content-type", ""), exc.read().decode())
