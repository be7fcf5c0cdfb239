"""Starting and stopping the kvferry processes on one machine: used by ``kvferry up``, tests, benches.

Every wait has a deadline; ``stop`` sends SIGTERM, waits, then SIGKILLs.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


# Ports for daemons started here are taken below the kernel's ephemeral range: a port the kernel
# hands out (bind to 0, or any outgoing connection) may be taken by another process between the
# pick and the daemon's bind, which happens only after its model has loaded.
PORT_FLOOR = 10000
ADDRESS_IN_USE = "address already in use"  # how uvicorn, libzmq and the routers report EADDRINUSE
START_ATTEMPTS = 4


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def listening_pids(port: int) -> set[int] | None:
    """The pids with a socket listening on TCP ``port`` (IPv4 or IPv6), from /proc; None where /proc
    cannot tell (not Linux)."""
    inodes: set[str] = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in list(f)[1:]:
                    cols = line.split()  # sl, local address (hex ip:port), remote, state (0A: LISTEN), ..., inode
                    if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{cols[9]}]")
    except (OSError, ValueError):
        return None
    pids: set[int] = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and inodes:
            try:
                fds = os.listdir(f"/proc/{entry.name}/fd")
            except OSError:
                continue  # gone, or not ours to read
            for fd in fds:
                try:
                    if os.readlink(f"/proc/{entry.name}/fd/{fd}") in inodes:
                        pids.add(int(entry.name))
                        break
                except OSError:
                    continue
    return pids


def _ancestry(pid: int) -> list[int]:
    """pid, its parent, that one's parent... (from /proc; as far as it can read)."""
    chain = [pid]
    while pid > 1 and len(chain) < 64:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state: ppid
        except (OSError, ValueError, IndexError):
            break
        chain.append(pid)
    return chain


_HANDED_OUT = 1024  # free_port never returns one of the last this many ports it returned in this process
_handed: collections.deque[int] = collections.deque(maxlen=_HANDED_OUT)
_handed_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, outside the ephemeral range, so no outgoing connection takes
    it before the daemon binds it, and not one of the last ``_HANDED_OUT`` this process was given
    (a daemon's port and bootstrap port, picked one after the other, never coincide). Another
    process may still pick the same one: ``Proc`` retries a start that failed with EADDRINUSE on
    new ports (``Proc.picked``)."""
    rng = random.SystemRandom()
    high = _ephemeral_floor()
    with _handed_lock:
        for _ in range(200):
            port = rng.randrange(PORT_FLOOR, high) if high > PORT_FLOOR + 100 else 0  # 0: the kernel's pick
            if port and port in _handed:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                port = s.getsockname()[1]
            if port not in _handed:
                _handed.append(port)
                return port
    raise OSError(f"no free port on {host} in {PORT_FLOOR}..{high - 1}")


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
    """One child process. ``picked`` names the port flags whose values ``free_port`` chose: a start
    that fails because one of them was taken meanwhile is retried on new ports by ``wait_ready``
    (``url`` and ``bootstrap_port`` follow)."""

    name: str
    args: list[str]
    url: str
    log_path: Path
    env: dict = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    picked: tuple[str, ...] = ()
    bootstrap_port: int | None = None
    _log_offset: int = field(default=0, init=False, repr=False)  # where the last start began writing its log

    def start(self) -> "Proc":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
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
        attempts = 1
        while time.monotonic() < deadline:
            if not self.is_alive():
                if attempts < START_ATTEMPTS and self.lost_port_race():
                    attempts += 1
                    self.repick_ports()
                    self.start()
                    continue
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode} before it was ready; "
                                   f"log {self.log_path}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as resp:
                    if resp.status == 200 and self.owns_port():
                        return self
            except (urllib.error.URLError, OSError):
                pass  # not listening yet
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready at {self.url}{path} within {timeout_s}s; log:\n{self.tail()}")

    def owns_port(self) -> bool:
        """Whether the server answering on ``url``'s port is this process (or where /proc cannot tell,
        assumed so): another daemon that took a ``free_port`` pick first answers /health too, while
        this one is about to exit with EADDRINUSE."""
        pids = listening_pids(int(self.url.rsplit(":", 1)[1].split("/")[0]))
        return pids is None or any(self.popen.pid in _ancestry(pid) for pid in pids)

    def lost_port_race(self) -> bool:
        """The last start exited because a port ``free_port`` picked was taken before it bound."""
        if not self.picked:
            return False
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                return ADDRESS_IN_USE in log.read().decode(errors="replace").lower()
        except OSError:
            return False

    def repick_ports(self) -> None:
        host = self.arg("--host") or "127.0.0.1"
        for flag in self.picked:
            port = free_port(host)
            logger.info("%s: %s %s was taken before it bound; trying %d", self.name, flag, self.arg(flag), port)
            self.args[self.args.index(flag) + 1] = str(port)
            if flag == "--port":
                self.url = f"{self.url.rsplit(':', 1)[0]}:{port}"
            if flag == "--bootstrap-port":
                self.bootstrap_port = port

    def arg(self, flag: str) -> str | None:
        """The value after ``flag`` in ``args``, or None."""
        return self.args[self.args.index(flag) + 1] if flag in self.args else None

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


def worker_proc(role: str, model: str, *, port: int | None, log_dir: Path, draft: str | None = None,
                bootstrap_port: int | None = None, extra: list[str] | None = None, env: dict | None = None,
                pick_bootstrap_port: bool = False) -> Proc:
    """A daemon on loopback. ``port`` None: a ``free_port``; so is the bootstrap port with
    ``pick_bootstrap_port`` (the daemon restarts on new ones if another process takes them first)."""
    picked = (("--port",) if port is None else ()) + (("--bootstrap-port",) if pick_bootstrap_port else ())
    port = free_port() if port is None else port
    if pick_bootstrap_port:
        bootstrap_port = free_port()
    args = [sys.executable, "-m", f"{role}_worker", "--model", model, "--host", "127.0.0.1", "--port", str(port)]
    if draft:
        args += ["--draft-model", draft]
    if bootstrap_port is not None:
        args += ["--bootstrap-port", str(bootstrap_port)]
    args += extra or []
    return Proc(f"{role}:{port}", args, f"http://127.0.0.1:{port}", log_dir / f"{role}-{port}.log", env=env or {},
                picked=picked, bootstrap_port=bootstrap_port)


def _prometheus_args(extra: list[str]) -> list[str]:
    # Both routers' Prometheus listeners default to 0.0.0.0:29000, which two routers on one host
    # (or tests running side by side) would fight over.
    if "--prometheus-port" in extra:
        return []
    return ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]


def _picked(port: int | None, extra: list[str]) -> tuple[int, tuple[str, ...]]:
    """The router's port (a ``free_port`` when None) and the port flags chosen here."""
    picked = ("--port",) if port is None else ()
    if "--prometheus-port" not in extra:
        picked += ("--prometheus-port",)
    return (free_port() if port is None else port), picked


def router_proc(prefills: list[tuple[str, int]], decodes: list[str], *, port: int | None, log_dir: Path,
                extra: list[str] | None = None) -> Proc:
    """sglang-router in PD mode on loopback (ready when ``GET /readiness`` answers 200)."""
    port, picked = _picked(port, extra or [])
    args = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
    for url, bootstrap_port in prefills:
        args += ["--prefill", url, str(bootstrap_port)]
    for url in decodes:
        args += ["--decode", url]
    args += _prometheus_args(extra or []) + (extra or [])
    return Proc(f"router:{port}", args, f"http://127.0.0.1:{port}", log_dir / f"router-{port}.log", picked=picked)


def vllm_router_proc(prefills: list[tuple[str, int]], decodes: list[str], *, port: int | None, log_dir: Path,
                     api_key: str = "", extra: list[str] | None = None) -> Proc:
    """vllm-router in its two-stage PD mode on loopback (ready when ``GET /readiness`` answers 200).

    It sends ``Authorization: Bearer $OPENAI_API_KEY`` to both daemons, so ``api_key`` must be the
    daemons' ``--api-key`` (empty when they run without one). It only starts listening once every
    worker answers ``/health``; the check interval is 1 s instead of its default 30 s."""
    port, picked = _picked(port, extra or [])
    args = [str(Path(sys.executable).with_name("vllm-router")), "--vllm-pd-disaggregation",
            "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
            "--worker-startup-check-interval", "1"]
    for url, bootstrap_port in prefills:
        args += ["--prefill", url, str(bootstrap_port)]
    for url in decodes:
        args += ["--decode", url]
    args += _prometheus_args(extra or []) + (extra or [])
    return Proc(f"vllm-router:{port}", args, f"http://127.0.0.1:{port}", log_dir / f"vllm-router-{port}.log",
                env={"OPENAI_API_KEY": api_key}, picked=picked)
