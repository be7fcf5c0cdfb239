"""The NIXL agent of one non-zero rank of a tensor-parallel daemon, run on that rank's process.

Rank K owns its KV pool and registers it with its own agent; rank 0 (``rank_agents.RankAgents``)
sends it peers to load and WRITEs to post, and receives the notifications its agent gets, over the
messages of ``rank_wire``. One thread (``serve``) owns the ZeroMQ socket and the agent's progress: it
answers ``add_peer``/``remove_peer`` at once, hands each ``write`` to an executor of
``num_write_threads`` (as many WRITEs in flight as rank 0 may have: a WRITE into a frozen decode
holds one thread until its deadline, never another decode's WRITE), which says ``posted`` as it
posts (rank 0 counts the WRITE's deadline from then), polls to DONE with the op's deadline (also
counted from the post) and an abort check, then releases; and it forwards notifications as they
come. Replies from the executor go back through a queue the loop drains, so the socket is used by
one thread only.

The thread ends when rank 0 says nothing for ``idle_s`` after its socket is gone, or on ``stop()``;
the process's forward loop (``tp_worker.serve``) is independent of it.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import zmq

from kvferry.common.errors import DisaggError, FailCode, TransferError
from kvferry.common.transport import rank_wire
from kvferry.common.transport.nixl import NixlEngine

logger = logging.getLogger(__name__)

_POLL_MS = 1  # between notification reads: a WRITE into this rank completes only while it polls
# WRITEs one rank runs at once: --xfer-threads' upper bound (rooms rank 0 writes at once). Threads
# start only as WRITEs need them.
MAX_WRITES_IN_FLIGHT = 64


class RankAgentServer:
    """Rank ``rank``'s agent and the thread that serves rank 0; ``start`` registers ``buffer``."""

    def __init__(self, rank: int, endpoint: str, name_prefix: str, buffer: torch.Tensor,
                 num_write_threads: int = MAX_WRITES_IN_FLIGHT) -> None:
        self.rank = rank
        self.endpoint = endpoint
        self.engine = NixlEngine(f"{name_prefix}-tp{rank}")
        self.engine.register_tensor(buffer)
        self._buffer = buffer
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._replies: queue.SimpleQueue[list] = queue.SimpleQueue()
        self._aborts: dict[int, str] = {}  # write op -> why rank 0 stopped it
        self._active: set[int] = set()  # write ops not answered yet
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(num_write_threads, thread_name_prefix=f"tp{rank}-write")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, regions) -> None:
        """Connect to rank 0 and say hello with this agent's metadata and ``regions``."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"rank-{self.rank}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        sock.send(rank_wire.pack(["hello", self.rank, self.engine.name, self.engine.metadata(),
                                  rank_wire.regions_out(regions)]))
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name=f"tp{self.rank}-agent", daemon=True)
        self._thread.start()
        logger.info("TP rank agent ready tp_rank=%d agent=%s endpoint=%s", self.rank, self.engine.name, self.endpoint)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._executor.shutdown(wait=True)  # a write in flight ends by its own deadline
        if self._sock is not None:
            self._sock.close(linger=0)
        self.engine.close()

    # -- the serving thread ---------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(_POLL_MS):
                    self._handle(rank_wire.unpack(self._sock.recv()))
                while True:
                    try:
                        self._sock.send(rank_wire.pack(self._replies.get_nowait()))
                    except queue.Empty:
                        break
                notifs = self.engine.get_notifs()
                if notifs:
                    self._sock.send(rank_wire.pack(["notifs", notifs]))
            except Exception:  # a bad frame or a failed read: logged, the next one is served
                if self._stop.is_set() or self.engine.is_closed:
                    return
                logger.exception("TP rank agent tp_rank=%d: serving step failed", self.rank)

    def _handle(self, msg: list) -> None:
        kind = msg[0]
        op_id = int(msg[1])
        if kind == "abort":
            with self._lock:
                if op_id in self._active:  # an abort after the reply changes nothing
                    self._aborts[op_id] = str(msg[2])
            return
        if kind == "write":
            with self._lock:
                self._active.add(op_id)
            args = msg[2:]
            self._executor.submit(self._run, op_id, lambda: self._write(op_id, *args))
        elif kind == "add_peer":
            self._run(op_id, lambda: self.engine.add_peer(msg[2]))
        elif kind == "remove_peer":
            self._run(op_id, lambda: self.engine.remove_peer(msg[2]))
        else:
            self._replies.put(["reply", op_id, False, None, "protocol", "other", f"unknown op {kind!r}"])

    def _run(self, op_id: int, fn) -> None:
        try:
            value = fn()
            self._replies.put(["reply", op_id, True, value, "", "", ""])
        except Exception as exc:
            if not isinstance(exc, DisaggError):
                logger.exception("TP rank agent tp_rank=%d: op %d failed", self.rank, op_id)
            self._replies.put(["reply", op_id, False, None, *rank_wire.error_out(exc)])
        finally:
            with self._lock:
                self._aborts.pop(op_id, None)
                self._active.discard(op_id)

    def _write(self, op_id: int, peer: str, src: bytes, dst: bytes, src_mem: str, dst_mem: str,
               notif: bytes | None, timeout_s: float) -> int:
        """Post one WRITE of ``src`` rows into ``dst`` rows of ``peer``, poll it to DONE; returns its bytes."""
        src_descs, dst_descs = rank_wire.descs_in(src), rank_wire.descs_in(dst)
        reason = self._abort_reason(op_id)
        if reason is not None:  # aborted while queued: post nothing
            raise TransferError(reason, code=FailCode.ABORTED)
        if self._buffer.device.type == "cuda":
            torch.cuda.synchronize(self._buffer.device)  # the forward that wrote these pages has ended
        local = self.engine.prep_local(src_descs, src_mem)
        try:
            remote = self.engine.prep_remote(peer, dst_descs, dst_mem)
            try:
                index = list(range(len(src_descs)))
                self._replies.put(["posted", op_id])  # before the post: rank 0's clock never starts late
                handle = self.engine.post_write(local, index, remote, index, notif)
                self.engine.wait(handle, timeout_s, stop=lambda: self._abort_reason(op_id))
                self.engine.release(handle)
            finally:
                self.engine.release_prepped(remote)
        finally:
            self.engine.release_prepped(local)
        return int(src_descs[:, 1].sum())

    def _abort_reason(self, op_id: int) -> str | None:
        with self._lock:
            return self._aborts.get(op_id)
