"""The messages between rank 0 of a tensor-parallel daemon and the NIXL agent each other rank owns
(``rank_agent.py`` on the rank, ``rank_agents.py`` on rank 0): msgpack lists over one ZeroMQ
DEALER (rank K, identity ``rank-K``) / ROUTER (rank 0) pair on 127.0.0.1. Pure: no sockets here.

rank K -> rank 0::

    ["hello", rank, agent_name, agent_metadata, [region fields...]]   once, when its agent is ready
    ["reply", op_id, ok, value, error_kind, error_code, error_text]   the end of one op
    ["posted", op_id]                                                  write ``op_id`` is being posted now
    ["notifs", {sender: [payload, ...]}]                               what its agent received

rank 0 -> rank K::

    ["add_peer", op_id, metadata]            -> value: the peer's agent name
    ["remove_peer", op_id, name]
    ["write", op_id, peer, src, dst, src_mem, dst_mem, notif, timeout_s]
        src/dst: int64 (addr, nbytes, device) rows as bytes; the reply comes once the WRITE is DONE,
        failed, timed out or aborted (and cancelled)
    ["abort", op_id, reason]                 stop write ``op_id`` (no reply of its own)

Errors travel as (kind, FailCode value, text) and are raised again on rank 0 as the same class, so a
rank's ``UnsafeWriteError`` quarantines pages on rank 0 exactly like a local one.
"""

from __future__ import annotations

from dataclasses import astuple

import msgpack
import numpy as np

from kvferry.common.errors import (DisaggError, FailCode, PeerUnavailableError, ProtocolError, TransferError,
                           UnsafeWriteError)
from kvferry.common.wire.messages import Region

ERROR_KINDS: dict[str, type[DisaggError]] = {
    "transfer": TransferError,
    "unsafe": UnsafeWriteError,
    "peer": PeerUnavailableError,
    "protocol": ProtocolError,
    "other": DisaggError,
}


def pack(msg: list) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> list:
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for malformed frames
        raise ProtocolError(f"rank agent frame is not msgpack: {exc}") from exc
    if not isinstance(msg, list) or not msg or not isinstance(msg[0], str):
        raise ProtocolError(f"rank agent frame is not a [kind, ...] list: {type(msg).__name__}")
    return msg


def regions_out(regions) -> list[list]:
    return [list(astuple(r)) for r in regions]


def regions_in(rows: list[list]) -> tuple[Region, ...]:
    try:
        return tuple(Region(*row) for row in rows)
    except TypeError as exc:
        raise ProtocolError(f"rank agent hello: bad region row: {exc}") from exc


def descs_out(descs: np.ndarray) -> bytes:
    return np.ascontiguousarray(descs, dtype=np.int64).tobytes()


def descs_in(data: bytes) -> np.ndarray:
    if len(data) % 24:
        raise ProtocolError(f"rank agent write: descriptor bytes ({len(data)}) are not whole (addr, len, dev) rows")
    return np.frombuffer(data, dtype=np.int64).reshape(-1, 3)


def error_out(exc: BaseException) -> tuple[str, str, str]:
    """(kind, code, text) of ``exc`` for a reply."""
    kind = "other"
    for name, cls in ERROR_KINDS.items():
        if type(exc) is cls:
            kind = name
            break
    code = exc.code.value if isinstance(exc, DisaggError) else FailCode.OTHER.value
    return kind, code, str(exc) or type(exc).__name__


def error_in(kind: str, code: str, text: str, rank: int) -> DisaggError:
    cls = ERROR_KINDS.get(kind, DisaggError)
    return cls(f"tp_rank {rank}: {text}", code=FailCode.parse(code))
