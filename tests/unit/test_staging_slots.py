"""Staging slots (``common/wire/staging_slots.py``): the transition table, and random room lives under
the fault rules (acquire never waits, reuse only when nothing can touch a slot, quarantine is final)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvferry.common.wire.staging_slots import _TRANSITIONS, SlotRole, SlotState, StagingSlot, StagingSlots

EVENTS = ("start_write", "write_done", "scatter_done", "cancelled")
# where each event leads from each state, per role (absent: the event raises and changes nothing)
EXPECTED = {
    SlotRole.SENDER: {
        (SlotState.HELD, "start_write"): SlotState.WRITING,
        (SlotState.HELD, "cancelled"): SlotState.FREE,
        (SlotState.WRITING, "write_done"): SlotState.FREE,   # the WRITE read the slot: reusable
        (SlotState.WRITING, "cancelled"): SlotState.FREE,
    },
    SlotRole.RECEIVER: {
        (SlotState.HELD, "start_write"): SlotState.WRITING,
        (SlotState.HELD, "cancelled"): SlotState.FREE,
        (SlotState.WRITING, "write_done"): SlotState.SCATTERING,  # landed: not reusable until scattered
        (SlotState.WRITING, "cancelled"): SlotState.FREE,
        (SlotState.SCATTERING, "scatter_done"): SlotState.FREE,
    },
}


def _slot_in(pool: StagingSlots, state: SlotState) -> StagingSlot:
    slot = pool.acquire(room=7, nbytes=1)
    path = {SlotState.HELD: [], SlotState.WRITING: [SlotState.WRITING],
            SlotState.SCATTERING: [SlotState.WRITING, SlotState.SCATTERING],
            SlotState.QUARANTINED: [SlotState.WRITING, SlotState.QUARANTINED]}
    for s in path[state]:
        slot.transition(s)
    return slot


@pytest.mark.parametrize("role", list(SlotRole))
@pytest.mark.parametrize("state", [s for s in SlotState if s is not SlotState.FREE])
@pytest.mark.parametrize("event", EVENTS)
def test_every_event_in_every_state(role, state, event):
    pool = StagingSlots(1, 16, role)
    slot = _slot_in(pool, state)
    want = EXPECTED[role].get((state, event))
    if want is None:
        with pytest.raises(RuntimeError, match="staging slot 0"):
            getattr(pool, event)(slot)
        assert slot.state is state and pool.num_free == 0
        return
    getattr(pool, event)(slot)
    assert slot.state is want
    assert pool.num_free == (want is SlotState.FREE) and (slot.room is None) == (want is SlotState.FREE)
    if want is not SlotState.FREE:
        assert want in _TRANSITIONS[state]


def test_quarantine_is_final_and_counted():
    pool = StagingSlots(2, 16, SlotRole.RECEIVER)
    slot = _slot_in(pool, SlotState.WRITING)
    pool.quarantine(slot, "the prefill never answered")
    assert pool.num_quarantined == 1 and _TRANSITIONS[SlotState.QUARANTINED] == frozenset()
    other = pool.acquire(room=8, nbytes=16)
    assert other is not None and other is not slot
    assert pool.acquire(room=9, nbytes=16) is None  # the quarantined one is never handed out
    with pytest.raises(RuntimeError, match="illegal state change held -> quarantined"):
        pool.quarantine(other, "no WRITE was posted: cancel instead")


def test_acquire_never_waits_and_sizes():
    pool = StagingSlots.of_bytes(100, 30, SlotRole.SENDER)
    assert (pool.num_slots, pool.buffer_nbytes) == (3, 90)
    assert pool.acquire(room=1, nbytes=31) is None  # larger than a slot: the direct path
    slots = [pool.acquire(room=r, nbytes=30) for r in range(3)]
    assert [(s.index, s.offset) for s in slots] == [(0, 0), (1, 30), (2, 60)]
    assert pool.acquire(room=4, nbytes=1) is None
    pool.cancelled(slots[1])
    assert pool.acquire(room=5, nbytes=1) is slots[1]
    assert StagingSlots.of_bytes(0, 30, SlotRole.SENDER).acquire(room=1, nbytes=1) is None  # staging off


class SlotMachine(RuleBasedStateMachine):
    """Random rooms through a pool: no slot has two rooms, a slot a WRITE may touch is never handed
    out, and every slot not quarantined comes back."""

    @initialize(num_slots=st.integers(0, 4), role=st.sampled_from(list(SlotRole)))
    def setup(self, num_slots: int, role: SlotRole) -> None:
        self.pool = StagingSlots(num_slots, 64, role)
        self.rooms: dict[int, StagingSlot] = {}
        self.next_room = 0

    @rule(nbytes=st.integers(1, 80))
    def acquire(self, nbytes: int) -> None:
        num_free = self.pool.num_free
        slot = self.pool.acquire(self.next_room, nbytes)
        if nbytes > 64 or num_free == 0:
            assert slot is None and self.pool.num_free == num_free
            return
        assert slot is not None and slot.state is SlotState.HELD and slot.room == self.next_room
        assert all(other is not slot for other in self.rooms.values())
        self.rooms[self.next_room] = slot
        self.next_room += 1

    @precondition(lambda self: self.rooms)
    @rule(data=st.data(), event=st.sampled_from(EVENTS + ("quarantine",)))
    def event(self, data, event: str) -> None:
        room = data.draw(st.sampled_from(sorted(self.rooms)))
        slot = self.rooms[room]
        before = slot.state
        allowed = (before is SlotState.WRITING if event == "quarantine"
                   else (before, event) in EXPECTED[self.pool.role])
        args = (slot, "cancel failed") if event == "quarantine" else (slot,)
        if not allowed:
            with pytest.raises(RuntimeError):
                getattr(self.pool, event)(*args)
            assert slot.state is before
            return
        getattr(self.pool, event)(*args)
        if slot.state in (SlotState.FREE, SlotState.QUARANTINED):
            del self.rooms[room]

    @invariant()
    def counts_add_up(self) -> None:
        if not hasattr(self, "pool"):
            return
        held = sum(s.state not in (SlotState.FREE, SlotState.QUARANTINED) for s in self.pool.slots)
        assert self.pool.num_free + held + self.pool.num_quarantined == self.pool.num_slots
        assert held == len(self.rooms)
        assert all(s.state is SlotState.FREE for s in self.pool.slots if s.room is None
                   and s.state is not SlotState.QUARANTINED)


TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
