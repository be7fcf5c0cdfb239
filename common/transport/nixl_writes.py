"""The WRITE half of ``NixlEngine``: post a prepared WRITE, poll it, wait for it (bounded, with a
stop check), release (cancel) it. The engine inherits these; they run on a daemon's executor."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvferry.common.errors import FailCode, TransferError, UnsafeWriteError
from kvferry.common.transport.nixl_types import NIXL_ERRORS, PreppedList, XferHandle, XferState, nixl_error, poll_pauses

logger = logging.getLogger(__name__)


class WriteOps:
    """Needs from the engine: ``_agent``, ``_lock``, ``_xfers``, ``name``, ``_check_open`` and
    ``_drive_progress``."""

    def post_write(self, local: PreppedList, local_idx: Sequence[int] | np.ndarray, remote: PreppedList,
                   remote_idx: Sequence[int] | np.ndarray, notif: bytes | None) -> XferHandle:
        """WRITE ``local[local_idx[i]]`` into ``remote[remote_idx[i]]`` and post it.

        Blocks: on loopback the copy happens inside this call (the GIL is released). The
        notification reaches the peer only once ``wait``/``poll`` has seen DONE. A post that fails
        is released (cancelled) and ``TransferError`` raised, ``UnsafeWriteError`` when that cancel
        fails too (part of the WRITE may still land).
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
        except NIXL_ERRORS as exc:
            raise nixl_error(f"make WRITE of {len(local_idx)} descriptors", peer, exc) from exc
        handle = XferHandle(peer, len(local_idx), raw)
        with self._lock:
            self._xfers.add(handle)
        try:
            state = self._post_raw(raw)
        except NIXL_ERRORS as exc:
            self._release_quietly(handle)
            raise nixl_error(f"post WRITE of {len(local_idx)} descriptors", peer, exc) from exc
        if state == "ERR":
            self._release_quietly(handle)
            raise TransferError(f"NIXL post WRITE failed (peer={peer}): backend returned ERR")
        return handle

    def poll(self, handle: XferHandle) -> XferState:
        """One progress step; also what makes NIXL send the notification on completion."""
        self._check_open("check WRITE state")
        try:
            return XferState(self._agent.check_xfer_state(handle._raw))
        except NIXL_ERRORS as exc:
            self._drive_progress()
            raise nixl_error("check WRITE state", handle.peer, exc) from exc

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
        except NIXL_ERRORS as exc:
            raise nixl_error("release/cancel WRITE (target pages may still be written)", handle.peer,
                              exc, UnsafeWriteError) from exc
        with self._lock:
            self._xfers.discard(handle)

    def _release_raw(self, handle: XferHandle) -> None:
        """NIXL's release (a cancel when the WRITE is in flight); raises what NIXL raises."""
        handle._raw.release()

    def _post_raw(self, raw) -> str:
        """NIXL's post of a made WRITE; returns its state, raises what NIXL raises."""
        return self._agent.transfer(raw)

    def _release_quietly(self, handle: XferHandle) -> None:
        """Release on an error path whose own error is the one to report. A cancel that fails is
        the exception: the WRITE may still land, so ``UnsafeWriteError`` goes up instead."""
        try:
            self.release(handle)
        finally:
            self._drive_progress()

    def num_descriptors(self, handle: XferHandle) -> int:
        """Descriptors left after merging, for a DONE handle (needs ``capture_telemetry=True``)."""
        self._check_open("read WRITE telemetry")
        try:
            return int(self._agent.get_xfer_telemetry(handle._raw).descCount)
        except NIXL_ERRORS as exc:
            raise nixl_error("read WRITE telemetry (capture_telemetry off?)", handle.peer, exc) from exc
