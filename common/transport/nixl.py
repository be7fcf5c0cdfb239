"""A thin typed wrapper over one NIXL agent (nixl 1.5.1, UCX backend): register, prepare, WRITE, poll.

Initiator (prefill): ``register_tensor`` → ``add_peer(metadata)`` → ``prep_local``/``prep_remote`` once
per peer → per request ``post_write`` then ``wait`` (both block: run them on the executor) → ``release``.
Target (decode): ``register_tensor`` → send ``metadata()`` → call ``get_notifs()`` all the time: its
polling drives the target's UCX progress, and a WRITE into a target that never polls stays PROC.
README.md (this folder) lists the measured NIXL behaviour each choice here rests on.

Threads: any method may be called from any thread (the agent runs in ``NIXL_THREAD_SYNC_RW`` and our
bookkeeping sits behind one lock). Daemons call ``post_write``/``wait``/``release`` from their
executor, ``get_notifs`` from one poller, the rest from the event loop; ``close`` comes last, after
the executor is joined.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from nixl import _bindings as nixl_bindings
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from common.errors import FailCode, PeerUnavailableError, ProtocolError, TransferError, UnsafeWriteError
from common.wire import MEM_KINDS

logger = logging.getLogger(__name__)

Desc = tuple[int, int, int]  # (addr, nbytes, device)

# Every exception type the NIXL bindings raise (nixlNotFoundError, nixlRemoteDisconnectError, ...).
_NIXL_ERRORS: tuple[type[BaseException], ...] = tuple(
    obj for name, obj in vars(nixl_bindings).items()
    if name.startswith("nixl") and name.endswith("Error") and isinstance(obj, type)
    and issubclass(obj, Exception)
)

_HINTS = {
    "nixlRemoteDisconnectError": "the peer died or closed its agent; drop it until it registers again",
    "nixlNotFoundError": "peer unknown or removed/re-added (prep its lists again), or memory not registered",
    "nixlInvalidParamError": "a descriptor index is out of range or the index lists differ in length",
    "nixlMismatchError": "the agent metadata is malformed or from an incompatible NIXL version",
}


class XferState(enum.Enum):
    """What ``check_xfer_state`` reports for one posted transfer."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


@dataclass(frozen=True, slots=True, eq=False)
class RegisteredMemory:
    """One registered buffer: ``nbytes`` at ``addr`` in ``mem`` ("DRAM"/"VRAM") on ``device``."""

    addr: int
    nbytes: int
    mem: str
    device: int
    _descs: object = field(repr=False)


@dataclass(frozen=True, slots=True, eq=False)
class PreppedList:
    """A prepared descriptor list. ``peer`` is None for the local side, else the remote agent name.

    ``num_descs`` bounds the indices ``post_write`` accepts; adjacent entries of one request merge
    into one UCX operation when they are adjacent on both sides.
    """

    peer: str | None
    mem: str
    num_descs: int
    _raw: object = field(repr=False)


@dataclass(frozen=True, slots=True, eq=False)
class XferHandle:
    """One posted WRITE toward ``peer`` of ``num_descs`` descriptors (before merging)."""

    peer: str
    num_descs: int
    _raw: object = field(repr=False)


def poll_pauses(spin_s: float = 1e-3, max_pause_s: float = 5e-4) -> Iterator[float]:
    """Seconds to sleep between two polls of one WRITE, forever.

    0 (a bare yield of the GIL) for the first ``spin_s``: a GPU WRITE of tens of MiB ends inside
    it, and ``time.sleep(1e-5)`` really sleeps ~60 µs (timer slack), which alone would add a third
    to a 0.2 ms WRITE. Then 1/16 of the time waited so far, at most ``max_pause_s``: completion is
    seen within ~6 % of the wait, and a frozen peer costs a core nothing.
    """
    start = time.perf_counter()
    while True:
        waited = time.perf_counter() - start
        yield 0.0 if waited < spin_s else min(waited / 16, max_pause_s)


def _nixl_error(op: str, peer: str | None, exc: BaseException, cls: type = TransferError) -> Exception:
    name = type(exc).__name__
    hint = _HINTS.get(name, "see the NIXL log lines above for the backend's reason")
    return cls(f"NIXL {op} failed (peer={peer or 'local'}): {name}: {exc}; {hint}")


def _check_mem(mem: str) -> None:
    if mem not in MEM_KINDS:
        raise ValueError(f"mem must be one of {MEM_KINDS}, got {mem!r}")


def _as_desc_array(descs: Sequence[Desc] | np.ndarray, what: str) -> np.ndarray:
    """Descriptors as the Nx3 uint64 array NIXL takes without a per-tuple Python conversion."""
    arr = np.asarray(descs, dtype=np.uint64)
    if arr.ndim != 2 or arr.shape[1] != 3 or arr.shape[0] == 0:
        raise ValueError(f"{what}: expected a non-empty list of (addr, nbytes, device), got {arr.shape}")
    return arr


class NixlEngine:
    """One NIXL agent named ``f"{name_prefix}-{uuid4hex}"``, unique per process start.

    The constructor creates the agent (UCX initialisation, a few ms, no threads), so a daemon builds
    its engine in ``start()``, not in its own constructor. ``close()`` undoes everything.
    """

    def __init__(self, name_prefix: str, *, backends: Sequence[str] = ("UCX",), num_threads: int = 0,
                 capture_telemetry: bool = False) -> None:
        self.name = f"{name_prefix}-{uuid.uuid4().hex}"
        config = nixl_agent_config(
            enable_prog_thread=False, backends=list(backends), num_threads=num_threads,
            capture_telemetry=capture_telemetry, sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
        try:
            self._agent = nixl_agent(self.name, config)
        except (*_NIXL_ERRORS, RuntimeError) as exc:
            raise _nixl_error("agent creation", None, exc) from exc
        missing = set(backends) - set(self._agent.backends)
        if missing:
            raise TransferError(f"NIXL agent {self.name}: backend(s) {sorted(missing)} unavailable; "
                                f"plugins present: {self._agent.get_plugin_list()}")
        self._lock = threading.Lock()
        self._peers: dict[str, bytes] = {}
        self._registrations: list[RegisteredMemory] = []
        self._prepped: set[PreppedList] = set()
        self._xfers: set[XferHandle] = set()
        self._pending_notifs: dict[str, list[bytes]] = {}
        self._is_closed = False
        logger.info("nixl agent created name=%s backends=%s num_threads=%d", self.name, list(backends),
                    num_threads)


    def register_tensor(self, t: torch.Tensor) -> RegisteredMemory:
        """Register a contiguous tensor's storage: DRAM for CPU tensors, VRAM for CUDA ones."""
        if not t.is_contiguous():
            raise ValueError(f"register_tensor: tensor of shape {tuple(t.shape)} is not contiguous")
        mem = "DRAM" if t.device.type == "cpu" else "VRAM"
        device = 0 if t.device.type == "cpu" else t.device.index or 0
        return self.register_buffer(t.data_ptr(), t.numel() * t.element_size(), mem, device)

    def register_buffer(self, addr: int, nbytes: int, mem: str, device: int) -> RegisteredMemory:
        """Register ``nbytes`` at ``addr``; call before ``metadata()`` so peers can see it."""
        _check_mem(mem)
        if nbytes <= 0:
            raise ValueError(f"register_buffer: nbytes must be positive, got {nbytes}")
        self._check_open("register memory")
        try:
            descs = self._agent.register_memory([(addr, nbytes, device, "")], mem)
        except _NIXL_ERRORS as exc:
            raise _nixl_error(f"register {nbytes} bytes of {mem} at {addr:#x}", None, exc) from exc
        reg = RegisteredMemory(addr, nbytes, mem, device, descs)
        with self._lock:
            self._registrations.append(reg)
        logger.debug("nixl registered name=%s mem=%s addr=%#x nbytes=%d", self.name, mem, addr, nbytes)
        return reg

    def deregister(self, reg: RegisteredMemory) -> None:
        """Deregister one buffer. Peers are not told: their WRITEs into it fail or land unseen."""
        with self._lock:
            if reg not in self._registrations or self._agent is None:
                return
            self._registrations.remove(reg)
        try:
            self._agent.deregister_memory(reg._descs)
        except _NIXL_ERRORS as exc:
            raise _nixl_error(f"deregister {reg.mem} at {reg.addr:#x}", None, exc) from exc

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registrations) for the peer's ``add_peer``."""
        self._check_open("read metadata")
        return self._agent.get_agent_metadata()


    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata and return its agent name.

        A peer already known under that name with different metadata is removed and loaded afresh,
        which invalidates its prepared lists: prep them again after a changed peer re-registers.
        """
        self._check_open("add peer")
        name = self._load(metadata)
        with self._lock:
            previous = self._peers.get(name)
        if previous is not None and previous != metadata:
            logger.info("nixl peer changed, reloading name=%s peer=%s", self.name, name)
            self.remove_peer(name)
            self._load(metadata)
        with self._lock:
            self._peers[name] = metadata
        logger.info("nixl peer added name=%s peer=%s", self.name, name)
        return name

    def _load(self, metadata: bytes) -> str:
        try:
            raw = self._agent.add_remote_agent(metadata)
        except nixl_bindings.nixlMismatchError as exc:
            raise _nixl_error("load peer metadata", None, exc, ProtocolError) from exc
        except _NIXL_ERRORS as exc:
            raise _nixl_error("load peer metadata", None, exc, PeerUnavailableError) from exc
        # nixl 1.5.1 returns the name as bytes although its docstring says str.
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def remove_peer(self, name: str) -> None:
        """Forget a peer and release its prepared lists. Unknown names are ignored."""
        with self._lock:
            self._peers.pop(name, None)
            stale = [p for p in self._prepped if p.peer == name]
        for p in stale:
            self.release_prepped(p)
        if self._agent is None:
            return
        try:
            self._agent.remove_remote_agent(name)
        except _NIXL_ERRORS as exc:
            raise _nixl_error("remove peer", name, exc, PeerUnavailableError) from exc
        logger.info("nixl peer removed name=%s peer=%s", self.name, name)

    def peers(self) -> list[str]:
        with self._lock:
            return sorted(self._peers)


    def prep_local(self, descs: Sequence[Desc] | np.ndarray, mem: str) -> PreppedList:
        """Prepare this side's descriptors (each inside a registered buffer)."""
        return self._prep(None, descs, mem)

    def prep_remote(self, peer: str, descs: Sequence[Desc] | np.ndarray, mem: str) -> PreppedList:
        """Prepare a peer's descriptors (each inside a buffer the peer registered before its metadata)."""
        with self._lock:
            is_known = peer in self._peers
        if not is_known:
            raise PeerUnavailableError(f"NIXL prep for peer={peer}: peer unknown to agent {self.name}; "
                                       f"call add_peer with its metadata first")
        return self._prep(peer, descs, mem)

    def _prep(self, peer: str | None, descs: Sequence[Desc] | np.ndarray, mem: str) -> PreppedList:
        _check_mem(mem)
        self._check_open("prep descriptors")
        arr = _as_desc_array(descs, f"prep {'local' if peer is None else peer}")
        try:
            raw = self._agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", arr, mem)
        except _NIXL_ERRORS as exc:
            raise _nixl_error(f"prep {len(arr)} {mem} descriptors", peer, exc) from exc
        prepped = PreppedList(peer, mem, len(arr), raw)
        with self._lock:
            self._prepped.add(prepped)
        return prepped

    def release_prepped(self, p: PreppedList) -> None:
        """Release a prepared list; idempotent."""
        with self._lock:
            self._prepped.discard(p)
        try:
            p._raw.release()
        except _NIXL_ERRORS as exc:
            raise _nixl_error("release prepared list", p.peer, exc) from exc


    def post_write(self, local: PreppedList, local_idx: Sequence[int] | np.ndarray, remote: PreppedList,
                   remote_idx: Sequence[int] | np.ndarray, notif: bytes | None) -> XferHandle:
        """WRITE ``local[local_idx[i]]`` into ``remote[remote_idx[i]]`` and post it.

        Blocks: on loopback the copy happens inside this call (the GIL is released). The
        notification reaches the peer only once ``wait``/``poll`` has seen DONE.
        """
        peer = remote.peer
        if local.peer is not None or peer is None:
            raise ValueError(f"post_write: local list has peer={local.peer}, remote list has peer={peer}; "
                             "pass prep_local's list first and prep_remote's second")
        if len(local_idx) != len(remote_idx) or len(local_idx) == 0:
            raise ValueError(f"post_write peer={peer}: {len(local_idx)} local and {len(remote_idx)} "
                             "remote indices; they must be equal and non-zero")
        self._check_open("post write")
        local_idx = local_idx if isinstance(local_idx, np.ndarray) else list(local_idx)
        remote_idx = remote_idx if isinstance(remote_idx, np.ndarray) else list(remote_idx)
        try:
            raw = self._agent.make_prepped_xfer("WRITE", local._raw, local_idx, remote._raw, remote_idx,
                                                notif or b"")
        except _NIXL_ERRORS as exc:
            raise _nixl_error(f"make WRITE of {len(local_idx)} descriptors", peer, exc) from exc
        handle = XferHandle(peer, len(local_idx), raw)
        with self._lock:
            self._xfers.add(handle)
        try:
            state = self._agent.transfer(raw)
        except _NIXL_ERRORS as exc:
            self._release_quietly(handle)
            raise _nixl_error(f"post WRITE of {len(local_idx)} descriptors", peer, exc) from exc
        if state == "ERR":
            self._release_quietly(handle)
            raise TransferError(f"NIXL post WRITE failed (peer={peer}): backend returned ERR")
        return handle

    def poll(self, handle: XferHandle) -> XferState:
        """One progress step; also what makes NIXL send the notification on completion."""
        self._check_open("check WRITE state")
        try:
            return XferState(self._agent.check_xfer_state(handle._raw))
        except _NIXL_ERRORS as exc:
            self._drive_progress()
            raise _nixl_error("check WRITE state", handle.peer, exc) from exc

    def wait(self, handle: XferHandle, deadline_s: float, poll_interval_s: float = 0.0005,
             stop: Callable[[], str | None] | None = None) -> None:
        """Poll ``handle`` to DONE for at most ``deadline_s`` seconds from now; blocks.

        Pauses follow ``poll_pauses`` up to ``poll_interval_s``: a short WRITE is seen at once, and a
        long wait must not burn a core. ``stop`` is asked between polls; a reason from it cancels the
        WRITE like the deadline does. On ERR, error, deadline or stop the handle is released
        (cancelling the WRITE) and ``TransferError`` raised (``UnsafeWriteError`` when the cancel
        itself fails); on DONE it stays live, so ``release`` it afterwards.
        """
        start = time.monotonic()
        pauses = poll_pauses(max_pause_s=poll_interval_s)
        while True:
            try:
                state = self.poll(handle)
            except TransferError:
                self.release(handle)
                raise
            if state is XferState.DONE:
                return
            if state is XferState.ERR:
                self.release(handle)
                raise TransferError(f"NIXL WRITE to peer={handle.peer} failed: state ERR after "
                                    f"{time.monotonic() - start:.3f} s")
            reason = stop() if stop is not None else None
            if reason is not None:
                self.release(handle)
                raise TransferError(reason, code=FailCode.ABORTED)
            if time.monotonic() - start >= deadline_s:
                break
            time.sleep(next(pauses))
        # A frozen peer never fails the WRITE; cancel it so the pages can be freed.
        self.release(handle)
        raise TransferError(f"NIXL WRITE to peer={handle.peer} timed out after {deadline_s} s "
                            f"({handle.num_descs} descriptors); cancelled. Is the peer frozen?",
                            code=FailCode.TIMEOUT)

    def release(self, handle: XferHandle) -> None:
        """Release a handle, cancelling it if still in flight; idempotent.

        Raises ``UnsafeWriteError`` when NIXL cannot cancel: the peer's memory may then still be written,
        so its pages must not be reused.
        """
        try:
            self._release_raw(handle)
        except _NIXL_ERRORS as exc:
            raise _nixl_error("release/cancel WRITE (target pages may still be written)", handle.peer,
                              exc, UnsafeWriteError) from exc
        with self._lock:
            self._xfers.discard(handle)

    def _release_raw(self, handle: XferHandle) -> None:
        """NIXL's release (a cancel when the WRITE is in flight); raises what NIXL raises."""
        handle._raw.release()

    def _release_quietly(self, handle: XferHandle) -> None:
        """Release on an error path whose own error is the one to report; log a second failure."""
        try:
            self.release(handle)
        except TransferError:
            logger.exception("nixl release after a failed WRITE failed name=%s peer=%s", self.name,
                             handle.peer)
        self._drive_progress()

    def num_descriptors(self, handle: XferHandle) -> int:
        """Descriptors left after merging, for a DONE handle (needs ``capture_telemetry=True``)."""
        self._check_open("read WRITE telemetry")
        try:
            return int(self._agent.get_xfer_telemetry(handle._raw).descCount)
        except _NIXL_ERRORS as exc:
            raise _nixl_error("read WRITE telemetry (capture_telemetry off?)", handle.peer, exc) from exc

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender agent name; also drives progress."""
        self._check_open("read notifications")
        try:
            new = self._agent.get_new_notifs()
        except _NIXL_ERRORS as exc:
            raise _nixl_error("read notifications", None, exc) from exc
        with self._lock:
            if not self._pending_notifs:
                return new
            merged, self._pending_notifs = self._pending_notifs, {}
        for sender, msgs in new.items():
            merged.setdefault(sender, []).extend(msgs)
        return merged

    def _drive_progress(self) -> None:
        """One progress step outside ``get_notifs``, keeping what it receives for ``get_notifs``.

        After a peer disconnect UCX finishes failing the endpoint only on a later progress call;
        destroying the agent before that aborts the process (``ucs_arbiter_group_is_empty``).
        """
        agent = self._agent
        if agent is None:
            return
        try:
            new = agent.get_new_notifs()
        except _NIXL_ERRORS:
            logger.warning("nixl progress step failed name=%s", self.name, exc_info=True)
            return
        with self._lock:
            for sender, msgs in new.items():
                self._pending_notifs.setdefault(sender, []).extend(msgs)


    def close(self) -> None:
        """Cancel in-flight WRITEs, release lists, remove peers, deregister memory; idempotent."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            xfers, prepped = list(self._xfers), list(self._prepped)
            peers, regs = list(self._peers), list(self._registrations)
        self._drive_progress()  # see _drive_progress: settle failed endpoints before teardown
        for step, items in (("release", xfers), ("release_prepped", prepped), ("remove_peer", peers),
                            ("deregister", regs)):
            for item in items:
                try:
                    getattr(self, step)(item)
                except (TransferError, PeerUnavailableError):
                    logger.exception("nixl close: %s failed name=%s item=%r", step, self.name, item)
        self._drive_progress()
        self._pending_notifs.clear()  # nobody is left to read them
        self._agent = None  # the C++ agent is destroyed once the last handle referring to it is gone
        logger.info("nixl agent closed name=%s", self.name)

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    def _check_open(self, op: str) -> None:
        if self._is_closed:
            raise TransferError(f"NIXL {op}: agent {self.name} is closed")
