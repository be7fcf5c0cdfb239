"""Rank 0's handle on the NIXL agents of ranks 1..N-1 of a tensor-parallel daemon.

Each other rank owns its KV pool and its agent (``rank_agent.RankAgentServer``); rank 0 binds one
ROUTER socket on 127.0.0.1, passes its endpoint to the ranks it starts, and then:

- ``wait_hello`` collects each rank's agent name, metadata and region table (its ``register`` on a
  decode, its source addresses on a prefill);
- ``call``/``submit`` run ``add_peer``, ``remove_peer`` and ``write`` on a rank (``rank_wire``), each
  answered by a reply that resolves a ``Future``; ``abort`` stops a write in flight;
  ``write_deadline`` is when a write has ended on its rank by the rank's own deadline: its timeout
  counted from when the rank posted it (one still waiting for a thread there: from when every
  write sent to that rank before it is due, at the latest);
- ``get_notifs`` returns what the ranks' agents received since the last call, by
  ``"{sender}@tp{rank}"`` (one notification per WRITE, and a room's WRITEs into different ranks
  come from the same sender).

One thread owns the socket: callers queue frames and wake it through a pipe. ``fail`` refuses every
later op and ends the pending ops of the ranks named (those that exited: nothing more will answer,
and their WRITEs ended with their process); a live rank's ops are answered by that rank, so a
WRITE still running there is never reported ended. ``close`` ends every pending op.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import zmq

from kvferry.common.errors import DisaggError, PeerUnavailableError, ProtocolError
from kvferry.common.transport import rank_wire
from kvferry.common.wire.messages import Region

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"  # the ranks of one daemon are processes of one host
_POLL_MS = 50


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What rank ``rank``'s agent said in its hello."""

    rank: int
    agent_name: str
    metadata: bytes
    regions: tuple[Region, ...]


class RankAgents:
    """The ROUTER side; ``endpoint`` is what the ranks connect to."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{_HOST}")
        self.endpoint = f"tcp://{_HOST}:{port}"
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._out: queue.SimpleQueue[tuple[bytes, bytes]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[int, Future]] = {}  # op id -> (rank, its future)
        self._writes: dict[int, tuple[int, float, float]] = {}  # write op id -> (rank, submitted at, timeout_s)
        self._posted: dict[int, float] = {}  # write op id -> when its rank said it posts it
        self._ids = itertools.count(1)
        self._hellos: dict[int, RankInfo] = {}
        self._hello_event = threading.Event()
        self._notifs: dict[str, list[bytes]] = {}
        self._failure: DisaggError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tp-agents", daemon=True)
        self._thread.start()

    # -- calls ------------------------------------------------------------------------------
    def wait_hello(self, timeout_s: float, check=None) -> dict[int, RankInfo]:
        """Every rank's hello; ``check()`` is called while waiting (it raises when a rank exited)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if len(self._hellos) == self.tp_size - 1:
                    return dict(self._hellos)
                missing = sorted(set(range(1, self.tp_size)) - set(self._hellos))
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise PeerUnavailableError(f"TP ranks {missing} did not start their NIXL agent within {timeout_s} s")
            self._hello_event.wait(0.05)
            self._hello_event.clear()

    def submit(self, rank: int, op: str, *args) -> tuple[int, Future]:
        """Send ``op`` to ``rank``; the future holds its value or raises its error."""
        if not 1 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} is not a worker rank of tp_size {self.tp_size}")
        future: Future = Future()
        op_id = next(self._ids)
        with self._lock:
            if self._failure is not None:
                future.set_exception(self._failure)
                return op_id, future
            if op == "write":  # its last argument is its timeout
                self._writes[op_id] = (rank, time.monotonic(), float(args[-1]))
            self._pending[op_id] = (rank, future)
        self._send(rank, [op, op_id, *args])
        return op_id, future

    def call(self, rank: int, op: str, *args, timeout_s: float = 30.0):
        """``submit`` and wait (bounded) for the value."""
        op_id, future = self.submit(rank, op, *args)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            self._resolve(op_id, error=PeerUnavailableError(f"TP rank {rank} did not answer {op} within {timeout_s} s"))
            return future.result()

    def abort(self, rank: int, op_id: int, reason: str) -> None:
        self._send(rank, ["abort", op_id, reason])

    def write_deadline(self, op_id: int) -> float | None:
        """When write ``op_id`` has ended on its rank by the rank's own deadline (``time.monotonic()``);
        None once it was answered. Its timeout counts from its post; before the post, from when every
        write sent to its rank before it is due (the rank's threads take writes in order, so by then
        one is free for it)."""
        with self._lock:
            if op_id not in self._writes:
                return None
            rank = self._writes[op_id][0]
            due = 0.0  # the latest deadline of the rank's writes sent before this one
            for other, (r, submitted, timeout_s) in self._writes.items():  # in the order sent
                if r != rank:
                    continue
                posted = self._posted.get(other)
                mine = posted + timeout_s if posted is not None else max(submitted, due) + timeout_s
                if other == op_id:
                    return mine
                due = max(due, mine)
        return None  # pragma: no cover (op_id is among the writes)

    def get_notifs(self) -> dict[str, list[bytes]]:
        with self._lock:
            out, self._notifs = self._notifs, {}
        return out

    def fail(self, error: DisaggError, ranks) -> None:
        """Refuse every later op with ``error``; end the pending ops of ``ranks`` (exited) with it."""
        ranks = set(ranks)
        with self._lock:
            if self._failure is None:
                self._failure = error
            ended = [op_id for op_id, (rank, _) in self._pending.items() if rank in ranks]
        for op_id in ended:
            self._resolve(op_id, error=error)

    def close(self) -> None:
        """Stop serving; every pending op ends (the group has ended its ranks first)."""
        self.fail(PeerUnavailableError("TP rank agents closed"), range(1, self.tp_size))
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=10)
        self._sock.close(linger=0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the socket's thread ----------------------------------------------------------------
    def _send(self, rank: int, msg: list) -> None:
        self._out.put((f"rank-{rank}".encode(), rank_wire.pack(msg)))
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # closed: close() already failed every op

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(_POLL_MS))
                if self._wake_r in events:
                    while os.read(self._wake_r, 4096):
                        pass
            except BlockingIOError:
                pass
            except Exception:
                if self._stop.is_set():
                    return
                logger.exception("TP agents: poll failed")
            while True:
                try:
                    identity, frame = self._out.get_nowait()
                except queue.Empty:
                    break
                try:
                    self._sock.send_multipart([identity, frame])
                except zmq.ZMQError:
                    logger.exception("TP agents: send to %s failed", identity)
            while True:
                try:
                    identity, frame = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    self._handle(rank_wire.unpack(frame), identity.decode(errors="replace"))
                except (ProtocolError, ValueError, TypeError, IndexError):
                    logger.exception("TP agents: bad frame from %s", identity)

    def _handle(self, msg: list, identity: str) -> None:
        kind = msg[0]
        if kind == "reply":
            _, op_id, ok, value, err_kind, err_code, err_text = msg
            with self._lock:
                rank = self._pending.get(op_id, (0, None))[0]
            if ok:
                self._resolve(op_id, value=value)
            else:
                self._resolve(op_id, error=rank_wire.error_in(err_kind, err_code, err_text, rank))
        elif kind == "posted":
            with self._lock:
                if msg[1] in self._writes:
                    self._posted[msg[1]] = time.monotonic()
        elif kind == "notifs":  # keyed "sender@receiver": one WRITE's notification per (sender, rank)
            receiver = identity.replace("rank-", "tp")
            with self._lock:
                for sender, payloads in msg[1].items():
                    self._notifs.setdefault(f"{sender}@{receiver}", []).extend(payloads)
        elif kind == "hello":
            _, rank, name, metadata, regions = msg
            info = RankInfo(int(rank), str(name), bytes(metadata), rank_wire.regions_in(regions))
            with self._lock:
                self._hellos[info.rank] = info
            self._hello_event.set()
            logger.info("TP rank agent joined tp_rank=%d agent=%s regions=%d", info.rank, info.agent_name,
                        len(info.regions))
        else:
            raise ProtocolError(f"unknown rank agent message {kind!r}")

    def _resolve(self, op_id: int, *, value=None, error: BaseException | None = None) -> None:
        with self._lock:
            entry = self._pending.pop(op_id, None)
            self._writes.pop(op_id, None)
            self._posted.pop(op_id, None)
        if entry is None or entry[1].done():
            return  # answered late after a timeout or a lost rank: nobody waits for it
        if error is not None:
            entry[1].set_exception(error)
        else:
            entry[1].set_result(value)
