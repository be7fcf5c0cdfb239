"""Staging slots (issue 17): a bounded pool of equal byte ranges of one registered buffer, one per
staged room in flight on this side, with the fault rules of a direct WRITE.

- ``acquire`` never waits: None means "no free slot", and the room takes the direct path.
- A slot is reused only once nothing can touch it: its WRITE is DONE (the prefill's slot, which the
  WRITE reads) or its scatter is done (the decode's, which the WRITE fills), or its WRITE is known
  cancelled (released, or never posted).
- A slot whose WRITE could not be cancelled, or whose WRITE's fate is unknown (a frozen prefill), is
  quarantined: never handed out again, counted for ``/metrics``, like quarantined KV pages.

``SlotState`` moves through ``_TRANSITIONS`` only, in ``StagingSlot.transition``; the pool's event
methods (``start_write``, ``write_done``, ``scatter_done``, ``cancelled``, ``quarantine``) are the
only callers. The pool knows byte offsets, not tensors: the daemon owns the buffer
(``num_slots * slot_nbytes`` bytes, registered with NIXL once) and copies into ``[offset, + nbytes)``.
Not thread-safe: one owner (the event loop).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class SlotRole(enum.Enum):
    SENDER = "sender"      # the prefill's: gathered into, read by its WRITE
    RECEIVER = "receiver"  # the decode's: filled by the prefill's WRITE, then scattered into pages


class SlotState(enum.Enum):
    FREE = "free"
    HELD = "held"                # a room has it; no WRITE involves it yet (gathering; not yet offered)
    WRITING = "writing"          # a WRITE from it (sender) or into it (receiver) may be in flight
    SCATTERING = "scattering"    # receiver: the WRITE landed, the scatter into pages runs
    QUARANTINED = "quarantined"  # a WRITE that could not be cancelled may still touch it: never reused


_TRANSITIONS: dict[SlotState, frozenset[SlotState]] = {
    SlotState.FREE: frozenset({SlotState.HELD}),
    SlotState.HELD: frozenset({SlotState.WRITING, SlotState.FREE}),
    SlotState.WRITING: frozenset({SlotState.FREE, SlotState.SCATTERING, SlotState.QUARANTINED}),
    SlotState.SCATTERING: frozenset({SlotState.FREE}),
    SlotState.QUARANTINED: frozenset(),
}


@dataclass(eq=False)
class StagingSlot:
    """Bytes ``[offset, + nbytes)`` of the pool's buffer; ``room`` is the holder while not FREE."""

    index: int
    offset: int
    nbytes: int
    state: SlotState = SlotState.FREE
    room: int | None = None

    def transition(self, new: SlotState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"staging slot {self.index} (room={self.room}): illegal state change "
                               f"{self.state.value} -> {new.value}")
        self.state = new


class StagingSlots:
    """``num_slots`` slots of ``slot_nbytes`` for one side (``role``). Free slots are handed out
    lowest index first."""

    def __init__(self, num_slots: int, slot_nbytes: int, role: SlotRole) -> None:
        if num_slots < 0 or slot_nbytes <= 0:
            raise ValueError(f"num_slots={num_slots} must be >= 0 and slot_nbytes={slot_nbytes} > 0")
        self.role = role
        self.slot_nbytes = slot_nbytes
        self.slots = [StagingSlot(i, i * slot_nbytes, slot_nbytes) for i in range(num_slots)]
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() gives the lowest index

    @classmethod
    def of_bytes(cls, staging_nbytes: int, slot_nbytes: int, role: SlotRole) -> StagingSlots:
        """As many slots as ``--staging-bytes`` holds (0: staging off, every room goes direct)."""
        return cls(staging_nbytes // slot_nbytes, slot_nbytes, role)

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def buffer_nbytes(self) -> int:
        return self.num_slots * self.slot_nbytes

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_quarantined(self) -> int:
        return sum(s.state is SlotState.QUARANTINED for s in self.slots)

    def acquire(self, room: int, nbytes: int) -> StagingSlot | None:
        """A free slot for ``nbytes`` of ``room``, or None at once (no slot free, or the room is larger
        than a slot): the caller takes the direct path."""
        if nbytes > self.slot_nbytes or not self._free:
            return None
        slot = self.slots[self._free.pop()]
        slot.transition(SlotState.HELD)
        slot.room = room
        return slot

    def start_write(self, slot: StagingSlot) -> None:
        """Sender: the WRITE from the slot is about to be posted. Receiver: the slot is about to be
        offered to the prefill (from then on a WRITE may land in it)."""
        slot.transition(SlotState.WRITING)

    def write_done(self, slot: StagingSlot) -> None:
        """The WRITE reached DONE (sender) or its notification arrived (receiver)."""
        if slot.state is not SlotState.WRITING:
            raise RuntimeError(f"staging slot {slot.index} (room={slot.room}): write_done in state {slot.state.value}")
        if self.role is SlotRole.SENDER:
            self._release(slot)
        else:
            slot.transition(SlotState.SCATTERING)

    def scatter_done(self, slot: StagingSlot) -> None:
        """Receiver: the scatter out of the slot has finished (or will not run: the room failed after
        its WRITE landed); nothing touches the slot any more."""
        if self.role is not SlotRole.RECEIVER:
            raise RuntimeError(f"staging slot {slot.index} (room={slot.room}): a sender's slot is never scattered")
        if slot.state is not SlotState.SCATTERING:
            raise RuntimeError(f"staging slot {slot.index} (room={slot.room}): scatter_done in state {slot.state.value}")
        self._release(slot)

    def cancelled(self, slot: StagingSlot) -> None:
        """The room ended and no WRITE can touch the slot: none was posted (HELD), or it was
        released (cancelled) or failed before moving bytes, as NIXL or the prefill reported."""
        if slot.state not in (SlotState.HELD, SlotState.WRITING):
            raise RuntimeError(f"staging slot {slot.index} (room={slot.room}): cancelled in state {slot.state.value}")
        self._release(slot)

    def quarantine(self, slot: StagingSlot, reason: str) -> None:
        """The WRITE could not be cancelled, or its fate is unknown: the slot is never reused."""
        slot.transition(SlotState.QUARANTINED)
        logger.warning("staging slot quarantined role=%s slot=%d room=%s nbytes=%d reason=%s",
                       self.role.value, slot.index, slot.room, slot.nbytes, reason)

    def _release(self, slot: StagingSlot) -> None:
        slot.transition(SlotState.FREE)
        slot.room = None
        self._free.append(slot.index)
        self._free.sort(reverse=True)
