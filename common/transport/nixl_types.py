"""Types and helpers of the NIXL wrapper: descriptors, registered memory, prepared lists, WRITE
handles and their states, the poll schedule, and how NIXL's exceptions become ours."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from nixl import _bindings as nixl_bindings

from kvferry.common.errors import TransferError
from kvferry.common.wire.messages import MEM_KINDS

Desc = tuple[int, int, int]  # (addr, nbytes, device)

# Every exception type the NIXL bindings raise (nixlNotFoundError, nixlRemoteDisconnectError, ...).
NIXL_ERRORS: tuple[type[BaseException], ...] = tuple(
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


def nixl_error(op: str, peer: str | None, exc: BaseException, cls: type = TransferError) -> Exception:
    name = type(exc).__name__
    hint = _HINTS.get(name, "see the NIXL log lines above for the backend's reason")
    return cls(f"NIXL {op} failed (peer={peer or 'local'}): {name}: {exc}; {hint}")


def check_mem(mem: str) -> None:
    if mem not in MEM_KINDS:
        raise ValueError(f"mem must be one of {MEM_KINDS}, got {mem!r}")


def as_desc_array(descs: Sequence[Desc] | np.ndarray, what: str) -> np.ndarray:
    """Descriptors as the Nx3 uint64 array NIXL takes without a per-tuple Python conversion."""
    arr = np.asarray(descs, dtype=np.uint64)
    if arr.ndim != 2 or arr.shape[1] != 3 or arr.shape[0] == 0:
        raise ValueError(f"{what}: expected a non-empty list of (addr, nbytes, device), got {arr.shape}")
    return arr
