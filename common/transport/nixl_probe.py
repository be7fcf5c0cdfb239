"""Loads a peer's NIXL agent metadata in a child process before the daemon's own agent does.

With nixl 1.5.1, some malformed metadata (e.g. one flipped bit in the packed UCX worker address)
makes UCX fail an assertion and abort the whole process. A peer allowed on the bootstrap socket
could thus kill a prefill with one ``register`` frame. The probe child holds a throwaway agent and
loads the metadata first: if the child dies, the metadata is refused with a ``ProtocolError`` and
the child is restarted; only metadata the child survived reaches the daemon's agent.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import uuid

from kvferry.common.errors import ProtocolError

logger = logging.getLogger(__name__)


def _serve(conn) -> None:
    """Child: load each metadata blob into a throwaway agent, answer, forget it."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"probe-{uuid.uuid4().hex}", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    conn.send(("ready", None))
    while True:
        metadata = conn.recv()
        if metadata is None:
            return
        try:
            raw = agent.add_remote_agent(metadata)
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            agent.remove_remote_agent(name)
            conn.send(("ok", name))
        except Exception as exc:  # the answer is the point: report and keep serving
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class MetadataProbe:
    def __init__(self, timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._conn = None

    def start(self) -> None:
        """Start the child now (it imports NIXL in the background), so the first check is quick."""
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child,), name="kvferry-nixl-probe", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        self._is_ready = False

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the child holds its agent (or ``timeout_s`` passes): the daemon waits for
        it before it serves, so that no registration pays for the child's start."""
        with self._lock:
            return self._await_ready(timeout_s)

    def _await_ready(self, timeout_s: float) -> bool:
        try:
            if not self._is_ready and self._conn.poll(timeout_s):
                self._is_ready = self._conn.recv()[0] == "ready"
        except (EOFError, OSError):  # the child died while starting: check() restarts it
            return False
        return self._is_ready

    def check(self, metadata: bytes, *, peer: str) -> None:
        """Raise ProtocolError unless a throwaway agent loads ``metadata`` and survives. Blocks."""
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self.start()
            try:
                if not self._await_ready(self.timeout_s):
                    raise TimeoutError(f"the probe process did not start within {self.timeout_s}s")
                self._conn.send(metadata)
                if not self._conn.poll(self.timeout_s):
                    raise TimeoutError(f"no answer within {self.timeout_s}s")
                verdict, detail = self._conn.recv()
            except (EOFError, OSError, TimeoutError) as exc:
                self._stop_child()
                logger.warning("NIXL metadata of peer=%s killed or hung the probe process: %s", peer, exc)
                raise ProtocolError(f"{peer}: its NIXL agent metadata crashed or hung a NIXL loader ({exc}); "
                                    f"refused (malformed or hostile metadata)") from None
        if verdict != "ok":
            raise ProtocolError(f"{peer}: its NIXL agent metadata cannot be loaded: {detail}")

    def _stop_child(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.is_alive():
                try:
                    self._conn.send(None)
                    self._proc.join(5)
                except (OSError, EOFError) as exc:
                    logger.debug("probe process already gone: %s", exc)
            self._stop_child()
