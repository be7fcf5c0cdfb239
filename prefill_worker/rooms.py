"""The prefill's rooms: one table owns every room, every early transfer request and every ended room.

A room is one request's prompt KV on this prefill, from its HTTP request (``open``) until its pages
are freed (``close``). Either leg may come first, so the table also holds:

- ``early``: transfer requests for rooms this prefill has not opened yet (bounded by count, by
  bytes, and per peer, so that one decode cannot fill it);
- ``ended``: rooms that ended before any decode asked for them (the forward failed, the request
  was cancelled, a decode aborted a room not opened yet). A transfer request or an open for such
  a room is answered at once with the reason, instead of waiting for a deadline.

``RoomState`` moves through ``_TRANSITIONS`` only, in ``Room.transition``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvferry.common.wire import messages as wire
from kvferry.common.errors import FailCode, OverloadedError, TransferError
from kvferry.common.plan.geometry import RequestXfer, TransferPlan

logger = logging.getLogger(__name__)


class RoomState(enum.Enum):
    WAITING = "waiting"    # KV computed (or being computed); no transfer request bound yet, or no WRITE
    WRITING = "writing"    # a WRITE job runs; the pages on both sides stay busy until it returns
    DONE = "done"
    FAILED = "failed"


_TRANSITIONS: dict[RoomState, frozenset[RoomState]] = {
    RoomState.WAITING: frozenset({RoomState.WRITING, RoomState.DONE, RoomState.FAILED}),  # DONE: local prefill
    RoomState.WRITING: frozenset({RoomState.DONE, RoomState.FAILED}),
    RoomState.DONE: frozenset(),
    RoomState.FAILED: frozenset(),
}


@dataclass(eq=False)
class Room:
    """One request's prompt KV on this prefill. ``page_ids`` are prefill pages in token order."""

    room: int
    request_id: str
    num_prompt_tokens: int
    page_ids: list[int]
    deadline: float
    first_token_id: int = -1
    first_token_logprob: float = 0.0
    first_token_top: tuple[tuple[int, float], ...] = ()  # its top logprobs, when the request asked
    prompt_logprobs: wire.PromptLogprobs | None = None  # when the request asked; sent in the TransferResult
    cached_tokens: int = 0  # prompt tokens taken from this prefill's prefix cache (not recomputed)
    bytes_written: int = 0  # KV and aux bytes the room's WRITE moved
    has_decode_logprobs: bool = False  # the decode reads both (aux record v2): it returns the prompt logprobs
    state: RoomState = RoomState.WAITING
    transfer: wire.Transfer | None = None  # the decode's request, once bound
    identity: bytes | None = None          # the connection that sent it
    owner: bytes | None = None             # and its owner (CURVE key, or the identity without CURVE)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set on bind and on abort
    error: str | None = None
    code: FailCode = FailCode.OTHER
    is_aborted: bool = False
    is_unsafe: bool = False  # a WRITE could not be cancelled: the pages must never be reused
    # the WRITE's index lists, built as soon as the transfer request and the pages are both known
    # (usually while the forward runs), for this plan; a re-registered decode makes them stale
    xfer: RequestXfer | None = None
    xfer_plan: TransferPlan | None = None

    def transition(self, new: RoomState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"room={self.room}: illegal state change {self.state.value} -> {new.value}")
        self.state = new

    def bind(self, transfer: wire.Transfer, identity: bytes, owner: bytes) -> None:
        self.transfer, self.identity, self.owner = transfer, identity, owner
        self.arrived.set()

    def abort(self, reason: str, code: FailCode) -> None:
        """Stop the room: a wait wakes up and fails, a WRITE job stops before its next post.
        Idempotent: the first reason stands."""
        if not self.is_aborted:
            self.is_aborted, self.error, self.code = True, self.error or reason, code
        self.arrived.set()

    def end_code(self, code: FailCode) -> FailCode:
        """The code the room ends with when it fails with ``code``: UNSAFE over every other (a WRITE
        that could not be cancelled may still land, so neither side may reuse the pages), then the
        first abort's code (the decode's own reason, when it gave up), then ``code``."""
        if self.is_unsafe or code is FailCode.UNSAFE:
            return FailCode.UNSAFE
        return self.code if self.is_aborted else code

    def failure(self) -> TransferError:
        """The error an aborted room ends its HTTP request and its WRITE job with."""
        return TransferError(self.error or f"room={self.room}: aborted", code=self.code)

    @property
    def is_finished(self) -> bool:
        return self.state in (RoomState.DONE, RoomState.FAILED)


@dataclass(frozen=True, slots=True)
class EarlyTransfer:
    """A transfer request held until its room opens here (the decode leg came first)."""

    msg: wire.Transfer
    identity: bytes
    owner: bytes
    deadline: float
    num_bytes: int

    @classmethod
    def of(cls, msg: wire.Transfer, identity: bytes, owner: bytes, deadline: float) -> "EarlyTransfer":
        # what holding it costs: the page ids as Python ints dominate (~36 bytes each in a list)
        return cls(msg, identity, owner, deadline, 200 + 36 * len(msg.page_ids) + len(msg.decode_id))


@dataclass(frozen=True, slots=True)
class EndedRoom:
    """A room that ended before a decode asked for it; remembered until ``until``."""

    reason: str
    code: FailCode
    until: float


@dataclass(frozen=True, slots=True)
class RoomLimits:
    max_rooms: int              # rooms open at once (admission refuses beyond it)
    max_early: int = 4096       # transfer requests held for rooms not opened yet
    max_early_bytes: int = 16 << 20
    max_early_per_peer: int = 1024  # per connection owner (CURVE key or ZeroMQ identity)
    max_ended: int = 8192       # rooms remembered as ended
    ended_s: float = 30.0       # how long an ended room is remembered (the transfer-wait window)


class RoomTable:
    """Owner of ``rooms``, ``early`` and ``ended``. Everything here runs on the event loop."""

    def __init__(self, limits: RoomLimits):
        self.limits = limits
        self.rooms: dict[int, Room] = {}
        self.early: dict[int, EarlyTransfer] = {}
        self.early_bytes = 0
        self._early_per_owner: dict[bytes, int] = {}
        self.ended: OrderedDict[int, EndedRoom] = OrderedDict()

    def __len__(self) -> int:
        return len(self.rooms)

    def get(self, room_id: int) -> Room | None:
        return self.rooms.get(room_id)

    # -- open / close ----------------------------------------------------------------------------------
    def open(self, room: Room) -> None:
        """Claim ``room``; bind a transfer request that came first; end it at once if its decode
        already gave it up. Raises TransferError on a room id in use."""
        if room.room in self.rooms:
            raise TransferError(f"request_id={room.request_id}: bootstrap_room {room.room} is already in use "
                                f"on this prefill; every request needs its own room", code=FailCode.DUPLICATE)
        if len(self.rooms) >= self.limits.max_rooms:
            raise OverloadedError(f"prefill holds {len(self.rooms)} rooms, its limit; retry later")
        self.rooms[room.room] = room
        ended = self.ended.pop(room.room, None)
        if ended is not None:
            room.abort(ended.reason, ended.code)
            return
        early = self.pop_early(room.room)
        logger.debug("room=%d request_id=%s opened: %s", room.room, room.request_id,
                     "its transfer request was already here" if early is not None else "no transfer request yet")
        if early is not None:
            room.bind(early.msg, early.identity, early.owner)

    def close(self, room: Room) -> None:
        if self.rooms.get(room.room) is room:
            del self.rooms[room.room]

    # -- rooms that ended before a decode asked ---------------------------------------------------------
    def remember_ended(self, room_id: int, reason: str, code: FailCode, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.ended[room_id] = EndedRoom(reason, code, now + self.limits.ended_s)
        self.ended.move_to_end(room_id)
        while len(self.ended) > self.limits.max_ended:
            self.ended.popitem(last=False)

    def ended_reason(self, room_id: int) -> EndedRoom | None:
        return self.ended.get(room_id)

    # -- early transfer requests ---------------------------------------------------------------------
    def hold_early(self, early: EarlyTransfer) -> str | None:
        """Hold ``early`` until its room opens; the refusal's reason when a bound is reached."""
        lim = self.limits
        owner_count = self._early_per_owner.get(early.owner, 0)
        if len(self.early) >= lim.max_early or self.early_bytes + early.num_bytes > lim.max_early_bytes:
            return (f"prefill already holds {len(self.early)} transfer requests ({self.early_bytes} bytes) for "
                    f"rooms it has not seen; retry later")
        if owner_count >= lim.max_early_per_peer:
            return (f"this decode already has {owner_count} transfer requests waiting for rooms the prefill has "
                    f"not seen (the limit per decode); retry later")
        self.early[early.msg.room] = early
        self.early_bytes += early.num_bytes
        self._early_per_owner[early.owner] = owner_count + 1
        return None

    def pop_early(self, room_id: int) -> EarlyTransfer | None:
        early = self.early.pop(room_id, None)
        if early is not None:
            self.early_bytes -= early.num_bytes
            left = self._early_per_owner[early.owner] - 1
            if left:
                self._early_per_owner[early.owner] = left
            else:
                del self._early_per_owner[early.owner]
        return early

    def expire(self, now: float) -> list[EarlyTransfer]:
        """Drop early requests and ended rooms past their deadline; return the dropped requests."""
        expired = [e for e in self.early.values() if now > e.deadline]
        for e in expired:
            self.pop_early(e.msg.room)
        while self.ended and next(iter(self.ended.values())).until < now:
            self.ended.popitem(last=False)
        return expired

    def abort_all(self, reason: str, code: FailCode) -> None:
        for room in list(self.rooms.values()):
            room.abort(f"room={room.room}: {reason}", code)
