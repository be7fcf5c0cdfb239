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

import logging
import threading
import uuid
from collections.abc import Sequence

import numpy as np
import torch
from nixl import _bindings as nixl_bindings
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from kvferry.common.errors import PeerUnavailableError, ProtocolError, TransferError
from kvferry.common.transport.nixl_types import (NIXL_ERRORS, Desc, PreppedList, RegisteredMemory, XferHandle, XferState,
                                         as_desc_array, check_mem, nixl_error, poll_pauses)
from kvferry.common.transport.nixl_writes import WriteOps

__all__ = ["Desc", "NixlEngine", "PreppedList", "RegisteredMemory", "XferHandle", "XferState", "poll_pauses"]

logger = logging.getLogger(__name__)

class NixlEngine(WriteOps):
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
        except (*NIXL_ERRORS, RuntimeError) as exc:
            raise nixl_error("agent creation", None, exc) from exc
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
        check_mem(mem)
        if nbytes <= 0:
            raise ValueError(f"register_buffer: nbytes must be positive, got {nbytes}")
        self._check_open("register memory")
        try:
            descs = self._agent.register_memory([(addr, nbytes, device, "")], mem)
        except NIXL_ERRORS as exc:
            raise nixl_error(f"register {nbytes} bytes of {mem} at {addr:#x}", None, exc) from exc
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
        except NIXL_ERRORS as exc:
            raise nixl_error(f"deregister {reg.mem} at {reg.addr:#x}", None, exc) from exc

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
            raise nixl_error("load peer metadata", None, exc, ProtocolError) from exc
        except NIXL_ERRORS as exc:
            raise nixl_error("load peer metadata", None, exc, PeerUnavailableError) from exc
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
        except NIXL_ERRORS as exc:
            raise nixl_error("remove peer", name, exc, PeerUnavailableError) from exc
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
        check_mem(mem)
        self._check_open("prep descriptors")
        arr = as_desc_array(descs, f"prep {'local' if peer is None else peer}")
        try:
            raw = self._agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", arr, mem)
        except NIXL_ERRORS as exc:
            raise nixl_error(f"prep {len(arr)} {mem} descriptors", peer, exc) from exc
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
        except NIXL_ERRORS as exc:
            raise nixl_error("release prepared list", p.peer, exc) from exc


    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender agent name; also drives progress."""
        self._check_open("read notifications")
        try:
            new = self._agent.get_new_notifs()
        except NIXL_ERRORS as exc:
            raise nixl_error("read notifications", None, exc) from exc
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
        except NIXL_ERRORS:
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
