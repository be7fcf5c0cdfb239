"""Starting and stopping the kvferry processes on one machine: used by ``kvferry up``, tests, benches.

Every wait has a deadline; ``stop`` sends SIGTERM, waits, then SIGKILLs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, *, timeout_s: float = 60.0, headers: dict | None = None):
    """GET (body None) or POST JSON; returns (status, parsed JSON or text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


@dataclass
class Proc:
    name: str
    args: list[str]
    url: str
    log_path: Path
    env: dict = field(default_factory=dict)
    popen: subprocess.Popen | None = None

    def start(self) -> "Proc":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env={**os.environ, **self.env}, start_new_session=True)
        log.close()
        return self

    @property
    def pid(self) -> int:
        return self.popen.pid

    def is_alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def wait_ready(self, timeout_s: float = 120.0, path: str = "/health") -> "Proc":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.is_alive():
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode} before it was ready; "
                                   f"log {self.log_path}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass  # not listening yet
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready at {self.url}{path} within {timeout_s}s; log:\n{self.tail()}")

    def tail(self, num_bytes: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.is_alive():
            os.kill(self.popen.pid, sig)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.popen is None:
            return None
        if self.is_alive():
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0fs; killing", self.name, timeout_s)
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        return self.popen.returncode


def worker_proc(role: str, model: str, *, port: int, log_dir: Path, draft: str | None = None,
                bootstrap_port: int | None = None, extra: list[str] | None = None, env: dict | None = None) -> Proc:
    args = [sys.executable, "-m", f"{role}_worker", "--model", model, "--host", "127.0.0.1", "--port", str(port)]
    if draft:
        args += ["--draft-model", draft]
    if bootstrap_port is not None:
        args += ["--bootstrap-port", str(bootstrap_port)]
    args += extra or []
    return Proc(f"{role}:{port}", args, f"http://127.0.0.1:{port}", log_dir / f"{role}-{port}.log", env=env or {})


def _prometheus_args(extra: list[str]) -> list[str]:
    # Both routers' Prometheus listeners default to 0.0.0.0:29000, which two routers on one host
    # (or tests running side by side) would fight over.
    if "--prometheus-port" in extra:
        return []
    return ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]


def router_proc(prefills: list[tuple[str, int]], decodes: list[str], *, port: int, log_dir: Path,
                extra: list[str] | None = None) -> Proc:
    """sglang-router in PD mode on loopback (ready when ``GET /readiness`` answers 200)."""
    args = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
    for url, bootstrap_port in prefills:
        args += ["--prefill", url, str(bootstrap_port)]
    for url in decodes:
        args += ["--decode", url]
    args += _prometheus_args(extra or []) + (extra or [])
    return Proc(f"router:{port}", args, f"http://127.0.0.1:{port}", log_dir / f"router-{port}.log")


def vllm_router_proc(prefills: list[tuple[str, int]], decodes: list[str], *, port: int, log_dir: Path,
                     api_key: str = "", extra: list[str] | None = None) -> Proc:
    """vllm-router in its two-stage PD mode on loopback (ready when ``GET /readiness`` answers 200).

    It sends ``Authorization: Bearer $OPENAI_API_KEY`` to both daemons, so ``api_key`` must be the
    daemons' ``--api-key`` (empty when they run without one). It only starts listening once every
    worker answers ``/health``; the check interval is 1 s instead of its default 30 s."""
    args = [str(Path(sys.executable).with_name("vllm-router")), "--vllm-pd-disaggregation",
            "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
            "--worker-startup-check-interval", "1"]
    for url, bootstrap_port in prefills:
        args += ["--prefill", url, str(bootstrap_port)]
    for url in decodes:
        args += ["--decode", url]
    args += _prometheus_args(extra or []) + (extra or [])
    return Proc(f"vllm-router:{port}", args, f"http://127.0.0.1:{port}", log_dir / f"vllm-router-{port}.log",
                env={"OPENAI_API_KEY": api_key})
