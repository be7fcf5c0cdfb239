"""The rank registers (tp_rank > 0) of decodes whose rank 0 has not registered yet.

A decode at TP B sends B ``register`` messages, ranks 1.. first and rank 0 last; the parts wait here,
keyed by (connection owner, decode id), until rank 0's completes the set. Whatever a peer sends is
bounded before it is kept: ``tp_size`` (``layout.MAX_TP_SIZE``), the decodes waiting (``max_parts``),
their bytes in all (``max_bytes``), and per connection its decodes and bytes (``MAX_OWNER_DECODES``,
``max_owner_bytes``: a connection normally carries one decode, so it takes 1/16 of the table at
most). A connection over its own share drops its own oldest decodes' parts, never another's: a part that fits no
share is refused OVERLOADED (the decode registers again with its next request), and so is the rank
0 of a decode whose parts were dropped. Only a set that can never fit, or ranks never sent, is
REFUSED.
"""

from __future__ import annotations

from collections import OrderedDict

from kvferry.common.wire import messages as wire
from kvferry.common.errors import FailCode, GeometryMismatchError, ProtocolError
from kvferry.common.plan.layout import KvLayout, check_layout, check_tp_rank

MAX_PARTS = 64  # decodes whose rank registers wait for their rank 0's
MAX_PARTS_BYTES = 64 << 20  # every connection's parts together
MAX_OWNER_PARTS_BYTES = 4 << 20  # one connection's parts (a TP-8 decode of 80 layers: ~0.5 MB)
MAX_OWNER_DECODES = 4  # decodes of one connection waiting at once (a restarted one has a new id)
MAX_DROPPED = 1024  # decodes remembered as dropped, so that their rank 0 is told to retry
_REGION_BYTES = 256  # one Region as kept (a slotted frozen dataclass of 11 fields)
_PART_BYTES = 1024  # one register beside its regions and its agent metadata

_Key = tuple[bytes, str]  # (connection owner, decode id)


def part_nbytes(msg: wire.Register) -> int:
    """The memory one kept register costs, about: its agent metadata, regions and the rest."""
    return _PART_BYTES + len(msg.agent_metadata) + _REGION_BYTES * len(msg.regions)


class TpRegistrations:
    """Rank registers waiting for their rank 0 (see the module docstring for the bounds)."""

    def __init__(self, max_parts: int = MAX_PARTS, max_bytes: int = MAX_PARTS_BYTES,
                 max_owner_bytes: int = MAX_OWNER_PARTS_BYTES) -> None:
        self.max_parts = max_parts
        self.max_bytes = max_bytes
        self.max_owner_bytes = max_owner_bytes
        self._parts: OrderedDict[_Key, dict[int, wire.Register]] = OrderedDict()
        self._nbytes: dict[_Key, int] = {}
        self._dropped: OrderedDict[_Key, None] = OrderedDict()

    def add(self, owner: bytes, msg: wire.Register) -> None:
        """Keep rank ``msg.tp_rank``'s register; raises on one that cannot be part of any decode
        (REFUSED) or that does not fit now (OVERLOADED)."""
        where = f"decode_id={msg.decode_id} rank register"
        check_tp_rank(msg.tp_size, msg.tp_rank, where)
        if msg.tp_rank == 0:
            raise ProtocolError(f"{where}: tp_rank 0 completes a registration, it is no part",
                                code=FailCode.REFUSED)
        check_layout(KvLayout.from_register(msg), f"decode rank {msg.tp_rank}")
        key = (owner, msg.decode_id)
        parts = dict(self._parts.get(key, {}))
        if parts and next(iter(parts.values())).tp_size != msg.tp_size:
            parts = {}  # the decode restarted with another --tp-size: its older parts are stale
        parts[msg.tp_rank] = msg
        nbytes = sum(part_nbytes(m) for m in parts.values())
        if nbytes > self.max_owner_bytes:
            self._drop(key)
            raise ProtocolError(f"{where}: its ranks' registers take {nbytes} bytes, more than the "
                                f"{self.max_owner_bytes} one connection may keep waiting for rank 0",
                                code=FailCode.REFUSED)
        self._put(key, parts, nbytes)
        self._evict_own(owner, keep=key)
        if len(self._parts) > self.max_parts or self.nbytes > self.max_bytes:
            self._drop(key)
            raise ProtocolError(f"{where}: the prefill keeps the rank registers of {len(self._parts)} other "
                                f"decodes ({self.nbytes} bytes) waiting for their rank 0; retry",
                                code=FailCode.OVERLOADED)

    def complete(self, owner: bytes, msg: wire.Register) -> list[wire.Register]:
        """Rank 0's register and the parts before it, by rank; raises naming the missing ranks."""
        check_tp_rank(msg.tp_size, msg.tp_rank, f"decode_id={msg.decode_id} register")
        key = (owner, msg.decode_id)
        parts = self._parts.pop(key, {})
        self._nbytes.pop(key, None)
        missing = [k for k in range(1, msg.tp_size) if k not in parts or parts[k].tp_size != msg.tp_size]
        if missing:
            was_dropped = self._dropped.pop(key, False) is None
            raise GeometryMismatchError(
                f"decode_id={msg.decode_id} registered rank 0 of tp_size={msg.tp_size} before ranks "
                f"{missing[:8]}{' ...' if len(missing) > 8 else ''}"
                + (" (their registers were dropped: the prefill's table of waiting ranks was full); retry"
                   if was_dropped else " (each rank registers first, rank 0 last)"),
                code=FailCode.OVERLOADED if was_dropped else FailCode.REFUSED)
        self._dropped.pop(key, None)
        return [msg] + [parts[k] for k in range(1, msg.tp_size)]

    @property
    def nbytes(self) -> int:
        return sum(self._nbytes.values())

    def __len__(self) -> int:
        return len(self._parts)

    def _put(self, key: _Key, parts: dict[int, wire.Register], nbytes: int) -> None:
        self._parts.pop(key, None)
        self._parts[key] = parts  # the newest last: eviction takes the oldest first
        self._nbytes[key] = nbytes
        self._dropped.pop(key, None)

    def _evict_own(self, owner: bytes, keep: _Key) -> None:
        """Drop ``owner``'s oldest decodes (never ``keep``) while it is over its share of bytes."""
        mine = [k for k in self._parts if k[0] == owner and k != keep]
        while mine and (len(mine) >= MAX_OWNER_DECODES or sum(self._nbytes[k] for k in mine)
                        + self._nbytes[keep] > self.max_owner_bytes):
            self._drop(mine.pop(0))

    def _drop(self, key: _Key) -> None:
        self._parts.pop(key, None)
        self._nbytes.pop(key, None)
        self._dropped[key] = None
        while len(self._dropped) > MAX_DROPPED:
            self._dropped.popitem(last=False)
