"""Rank 0 of a tensor-parallel engine: starts ranks 1..N-1 as worker processes
(``python -m kvferry.common.engine.tp_worker``), mirrors every operation that changes KV contents to them,
and closes them.

Per step, rank 0 writes one ``StepHeader`` to each worker's stdin pipe and, for a forward, broadcasts
one int64 payload (``tp_step.py``); then every rank runs the same forward on its own KV pool, the
row-parallel layers meeting in all_reduce. Sampling happens on rank 0 only (workers compute no
logits), so grammar masks, penalties and seeded generators need nothing from the workers.

Life of the group (``GroupState``)::

    NEW --start--> READY --close--> CLOSED
      \\             \\--a worker fails--> FAILED --close--> CLOSED
       \\--start fails--> FAILED

A worker exits when its pipe reaches end of file (rank 0 exited or closed it), when it reads CLOSE,
or when a collective fails (rank 0 died mid-step). A worker that fails makes the step on rank 0
raise ``TpWorkerError`` naming its rank and exit code; every later step raises it again.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch

from kvferry.common.engine.tp_comm import TpComm, open_store, rank_device
from kvferry.common.engine.tp_step import StepHeader, StepKind, encode_forward
from kvferry.common.errors import DisaggError
from kvferry.common.transport.rank_agents import RankAgents, RankInfo

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_EXIT_WAIT_S = 10.0
_STORE_HOST = "127.0.0.1"  # ranks are processes of one host


class TpWorkerError(DisaggError):
    """A TP worker process failed or did not answer; the engine cannot run another step."""

    http_status = 503


class GroupState(enum.Enum):
    NEW = "new"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


_TRANSITIONS = {
    GroupState.NEW: {GroupState.READY, GroupState.FAILED, GroupState.CLOSED},
    GroupState.READY: {GroupState.FAILED, GroupState.CLOSED},
    GroupState.FAILED: {GroupState.CLOSED},
    GroupState.CLOSED: set(),
}


@dataclass(frozen=True)
class TpSpec:
    """What every rank needs to build its part of the engine."""

    model_dir: str
    tp_size: int
    device: str  # rank 0's; rank K runs on rank_device(device, K)
    dtype: str | None
    page_size: int
    num_pages: int
    kv_layout: str = "page-major"
    attention_backend: str = "auto"
    timeout_s: float = 120.0  # start-up, each collective, close
    num_threads: int = 0  # torch threads per worker (0: torch's default)
    agent_prefix: str = ""  # non-empty: each worker registers its KV pool with a NIXL agent of its own
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: every rank's pool (its scales from the checkpoint)

    def worker_argv(self, rank: int, init_method: str, agent_endpoint: str = "") -> list[str]:
        argv = [sys.executable, "-m", "kvferry.common.engine.tp_worker", "--rank", str(rank), "--tp-size",
                str(self.tp_size), "--init-method", init_method, "--model", self.model_dir, "--device", self.device,
                "--page-size", str(self.page_size), "--num-pages", str(self.num_pages), "--kv-layout",
                self.kv_layout, "--attention-backend", self.attention_backend, "--timeout-s", str(self.timeout_s),
                "--num-threads", str(self.num_threads), "--kv-cache-dtype", self.kv_cache_dtype]
        if agent_endpoint:
            argv += ["--agent-endpoint", agent_endpoint, "--agent-prefix", self.agent_prefix]
        return argv + (["--dtype", self.dtype] if self.dtype else [])


class TpGroup:
    """Rank 0's handle on the workers. ``start`` returns the group's ``TpComm``; ``forward`` and
    ``copy_page`` mirror a step; ``close`` ends every worker (CLOSE, then a kill past the deadline)."""

    def __init__(self, spec: TpSpec) -> None:
        self.spec = spec
        self.state = GroupState.NEW
        self.comm: TpComm | None = None
        self._procs: list[subprocess.Popen] = []
        self._store = None
        self._failure: str | None = None
        self._fail_lock = threading.Lock()
        self.agents: RankAgents | None = None  # with spec.agent_prefix: the other ranks' NIXL agents
        self.rank_infos: dict[int, RankInfo] = {}  # rank -> its agent's hello (after wait_loaded)

    # -- life cycle -------------------------------------------------------------------------
    def _move(self, new: GroupState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"TP group: illegal transition {self.state.value} -> {new.value}")
        self.state = new

    def start(self) -> TpComm:
        """Start the workers and join the group; raises TpWorkerError (workers ended) when a worker
        exits or the group is not formed within ``timeout_s``."""
        spec = self.spec
        try:
            store = open_store(_STORE_HOST, 0, spec.tp_size, is_master=True, timeout_s=spec.timeout_s)
            init_method = f"tcp://{_STORE_HOST}:{store.port}"
            if spec.agent_prefix:
                self.agents = RankAgents(spec.tp_size)
            endpoint = self.agents.endpoint if self.agents is not None else ""
            for rank in range(1, spec.tp_size):
                self._procs.append(subprocess.Popen(spec.worker_argv(rank, init_method, endpoint),
                                                    stdin=subprocess.PIPE, bufsize=0, env=_worker_env()))
            self._wait_keys(store, "joined", "join the TP group")
            self.comm = TpComm(store, _STORE_HOST, 0, spec.tp_size, rank_device(spec.device, 0), spec.timeout_s)
            self._store = store
        except BaseException:
            self._fail("start-up failed")
            self.close()
            raise
        logger.info("TP group formed tp_size=%d init_method=%s worker_pids=%s", spec.tp_size, init_method,
                    [p.pid for p in self._procs])
        return self.comm

    def wait_loaded(self) -> None:
        """Wait until every worker has loaded its shard and allocated its KV pool."""
        try:
            self._wait_keys(self._store, "loaded", "load its model shard")
            if self.agents is not None:
                self.rank_infos = self.agents.wait_hello(
                    self.spec.timeout_s, check=lambda: self._check_workers("start its NIXL agent"))
        except BaseException:
            self.close()
            raise
        self._move(GroupState.READY)

    def _wait_keys(self, store, what: str, doing: str) -> None:
        deadline = time.monotonic() + self.spec.timeout_s
        for rank in range(1, self.spec.tp_size):
            key = f"{what}/{rank}"
            while not store.check([key]):
                self._check_workers(doing)
                if time.monotonic() > deadline:
                    raise self._fail(f"TP worker rank {rank} did not {doing} within {self.spec.timeout_s} s")
                time.sleep(_POLL_S)

    def close(self, timeout_s: float | None = None) -> None:
        """Tell every worker to exit, wait for them (``timeout_s``; default the spec's, or
        ``_EXIT_WAIT_S`` after a failure, when a worker may sit in a collective that will not
        finish), kill the rest. Safe to call twice."""
        if self.state == GroupState.CLOSED:
            return
        if timeout_s is None:
            timeout_s = self.spec.timeout_s if self.state == GroupState.READY else _EXIT_WAIT_S
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            self._write(proc, StepHeader(StepKind.CLOSE).encode(), quiet=True)
            with contextlib.suppress(OSError):  # a worker already gone: the wait below reaps it
                proc.stdin.close()
        for rank, proc in enumerate(self._procs, start=1):
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                logger.error("TP worker rank %d pid=%d did not exit in time; killing it", rank, proc.pid)
                proc.kill()
                proc.wait(timeout=10)
        if self.comm is not None:
            self.comm.close()
        if self.agents is not None:
            self.agents.close()
        self._move(GroupState.CLOSED)
        logger.info("TP group closed tp_size=%d", self.spec.tp_size)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # -- steps ------------------------------------------------------------------------------
    def forward(self, model, kv, chunks, *, all_logits: bool = False, feed=None):
        """Run one forward on every rank; returns rank 0's logits (as ``model.forward``)."""
        model.check(chunks, kv)  # refuse a bad step before any worker sees it
        self._ensure_ready("forward")
        header, payload = encode_forward(chunks)
        try:
            self._send(header)
            host = torch.from_numpy(payload)
            tensor = host.to(self.comm.device, non_blocking=True) if self.comm.device.type == "cuda" else host
            if feed is not None:  # the broadcast carries the fed tokens, so workers read what rank 0 reads
                b, num_tokens = header.num_chunks, header.num_tokens
                tensor[3 * b:3 * b + num_tokens] = feed.apply(tensor[3 * b:3 * b + num_tokens])
            self.comm.broadcast(tensor)
            return model.forward(chunks, kv, all_logits=all_logits, feed=feed)
        except TpWorkerError:
            raise
        except Exception as exc:
            raise self._collective_failed("forward", exc) from exc

    def copy_page(self, src: int, dst: int) -> None:
        """Have every worker copy page ``src`` to ``dst`` of its pool (rank 0 copies its own)."""
        self._ensure_ready("copy_page")
        self._send(StepHeader(StepKind.COPY_PAGE, src_page=src, dst_page=dst))

    def check_alive(self, doing: str = "a transfer") -> None:
        """Raise ``TpWorkerError`` when the group failed or a worker has exited (and fail the group)."""
        if self.state == GroupState.FAILED:
            raise self._fail(self._failure or "TP group failed")  # ends the ops of ranks exited since
        self._check_workers(doing)

    def ranks_alive(self) -> dict[int, bool]:
        """Whether each worker rank's process runs (rank 1 first)."""
        return {rank: proc.poll() is None for rank, proc in enumerate(self._procs, start=1)}

    @property
    def is_healthy(self) -> bool:
        return self.state == GroupState.READY and all(p.poll() is None for p in self._procs)

    @property
    def lost_rank(self) -> str | None:
        """Why a group that was formed cannot run another step (its first failure, or a worker that
        has exited since), or None; reads the state only (``check_alive`` records the failure)."""
        if self._failure is not None:
            return self._failure
        if self.state != GroupState.READY:
            return None  # starting, or closed on purpose
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                return (f"TP worker rank {rank} (pid {proc.pid}) exited with code {code}; its log lines "
                        f"(tp_rank={rank}) say why")
        return None

    # -- failures ---------------------------------------------------------------------------
    def _ensure_ready(self, step: str) -> None:
        if self.state != GroupState.READY:
            raise TpWorkerError(f"TP engine (tp_size={self.spec.tp_size}) cannot run {step}: the group is "
                                f"{self.state.value}" + (f" ({self._failure})" if self._failure else ""))
        self._check_workers(step)

    def _send(self, header: StepHeader) -> None:
        data = header.encode()
        for proc in self._procs:
            self._write(proc, data)

    def _write(self, proc: subprocess.Popen, data: bytes, quiet: bool = False) -> None:
        try:
            proc.stdin.write(data)
        except (BrokenPipeError, ValueError, OSError):
            if not quiet:
                self._check_workers("step")
                raise self._fail(f"TP worker pid={proc.pid} closed its pipe")

    def _check_workers(self, doing: str) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                raise self._fail(f"TP worker rank {rank} (pid {proc.pid}) exited with code {code} during "
                                 f"{doing}; its log lines (tp_rank={rank}) say why")

    def _collective_failed(self, step: str, exc: BaseException) -> TpWorkerError:
        deadline = time.monotonic() + _EXIT_WAIT_S  # a dying worker's sockets close just before it exits
        while time.monotonic() < deadline:
            try:
                self._check_workers(step)
            except TpWorkerError as failed:
                return failed
            time.sleep(_POLL_S)
        return self._fail(f"TP {step} failed on rank 0 with no worker exited (a rank did not answer within "
                          f"{self.spec.timeout_s} s?): {exc}")

    def _fail(self, reason: str) -> TpWorkerError:
        """Record the first failure, mark the group FAILED; returns the error to raise. Called from
        several threads (a step, a room's transfer, a registration)."""
        with self._fail_lock:
            if self.state in (GroupState.NEW, GroupState.READY):
                self._failure = reason
                self._move(GroupState.FAILED)
                logger.error("TP group failed tp_size=%d: %s", self.spec.tp_size, reason)
        error = TpWorkerError(reason if self._failure is None else self._failure)
        if self.agents is not None:
            # a write waiting on an exited rank's reply ends now (its WRITE ended with its process); a
            # live rank's write is still answered by that rank, however the group failed
            exited = [rank for rank, proc in enumerate(self._procs, start=1) if proc.poll() is not None]
            self.agents.fail(error, exited)
        return error


def _worker_env() -> dict[str, str]:
    """This environment, with the directory holding ``common`` first on PYTHONPATH (so ``-m`` finds
    the same code from any working directory)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env
