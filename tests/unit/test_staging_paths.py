"""The daemons' staging paths on CPU, with real tensors and a real NIXL agent (no peer needed):
the decode's slot offers and what frees them (``decode_worker/staging.py``), the scatter of a slot
into scattered pages, and the prefill's choice of path with the reason it counts
(``prefill_worker/staging.py``)."""

from __future__ import annotations

import asyncio
import itertools
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvferry.common.wire import messages as wire
from kvferry.common.errors import ProtocolError
from kvferry.common.daemon.metrics import Metrics
from kvferry.common.plan.staging import StagingCosts, crossover_runs
from kvferry.common.wire.staging_slots import SlotState
from kvferry.common.transport.nixl import NixlEngine
from kvferry.decode_worker.staging import StagingReceiver
from kvferry.prefill_worker.staging import StagingSender, merged_runs

PAGE = 1024  # bytes of one page of the one region below


@pytest.fixture
def engine():
    e = NixlEngine("staging-test")
    yield e
    e.close()


@pytest.fixture
def executor():
    with ThreadPoolExecutor(1) as pool:
        yield pool


def _receiver(engine, executor, pool: torch.Tensor, nbytes=8 * PAGE, slot=4 * PAGE) -> StagingReceiver:
    return StagingReceiver.build(engine, nbytes, slot, torch.device("cpu"), [pool], executor)


def _runs(pool: torch.Tensor) -> list[list[int]]:
    return [[pool.data_ptr(), PAGE, PAGE, 0]]  # one region of back-to-back pages


def test_offer_holds_a_slot_that_fits_else_none(engine, executor):
    pool = torch.zeros(64 * PAGE, dtype=torch.uint8)
    r = _receiver(engine, executor, pool)
    assert r.slots.num_slots == 2
    assert r.offer(1, None, 2) == -1  # this prefill does not stage
    assert r.offer(2, _runs(pool), 5) == -1  # 5 pages do not fit a 4-page slot: direct
    assert r.offer(3, _runs(pool), 4) == 0
    assert r.offer(3, _runs(pool), 4) == 0  # asked again (re-registration): the same slot
    assert r.offer(4, _runs(pool), 1) == 1
    assert r.offer(5, _runs(pool), 1) == -1  # none free: direct, never waits
    assert r.slots.slots[0].state is SlotState.WRITING  # offered: a WRITE may land from now on


def test_land_scatters_the_slot_into_scattered_pages_then_frees_it(engine, executor):
    pool = torch.zeros(64 * PAGE, dtype=torch.uint8)
    r = _receiver(engine, executor, pool)
    pages = [9, 2, 40]
    slot = r.offer(7, _runs(pool), len(pages))
    stream = torch.randint(0, 255, (len(pages) * PAGE,), dtype=torch.uint8)
    r.buffer[slot * r.slots.slot_nbytes:][:len(stream)].copy_(stream)  # what the prefill's WRITE put there
    asyncio.run(r.land(7, _runs(pool), pages, staged=True))
    for i, p in enumerate(pages):
        assert torch.equal(pool[p * PAGE:(p + 1) * PAGE], stream[i * PAGE:(i + 1) * PAGE])
    untouched = np.setdiff1d(np.arange(64), pages)
    assert int(pool.view(64, PAGE)[untouched].sum()) == 0  # nothing outside the room's pages
    assert r.slots.num_free == 2 and 7 not in r.by_room


def test_a_direct_room_frees_its_offered_slot_at_once(engine, executor):
    pool = torch.zeros(64 * PAGE, dtype=torch.uint8)
    r = _receiver(engine, executor, pool)
    r.offer(8, _runs(pool), 2)
    asyncio.run(r.land(8, _runs(pool), [0, 1], staged=False))
    assert r.slots.num_free == 2 and int(pool.sum()) == 0


def test_staged_without_an_offer_is_a_protocol_error(engine, executor):
    pool = torch.zeros(64 * PAGE, dtype=torch.uint8)
    r = _receiver(engine, executor, pool)
    with pytest.raises(ProtocolError, match="no staging slot was offered"):
        asyncio.run(r.land(9, _runs(pool), [0], staged=True))


def test_runs_outside_the_pools_are_refused(engine, executor):
    pool = torch.zeros(64 * PAGE, dtype=torch.uint8)
    r = _receiver(engine, executor, pool)
    bad = [[pool.data_ptr() + 63 * PAGE, PAGE, PAGE, 0]]
    r.offer(10, bad, 2)
    with pytest.raises(ProtocolError, match="outside this decode's KV pools"):
        asyncio.run(r.land(10, bad, [0, 1], staged=True))  # page 1 of that run ends past the pool
    assert r.slots.num_free == 2  # the slot still comes back


def test_a_failed_room_gives_its_slot_back_with_its_pages_or_never(engine, executor):
    pool = torch.zeros(64 * PAGE, dtype=torch.uint8)
    r = _receiver(engine, executor, pool)
    freed = []
    release = r.wrap_release(11, lambda: freed.append(11))
    r.offer(11, _runs(pool), 2)
    assert r.slots.num_free == 1
    release()  # the room's pages go back (at once, or once the prefill confirmed): the slot too
    assert freed == [11] and r.slots.num_free == 2
    r.offer(12, _runs(pool), 2)
    r.quarantine(12, "WRITE could not be cancelled")
    assert r.slots.num_quarantined == 1 and r.slots.num_free == 1  # never handed out again
    r.wrap_release(12, lambda: None)()  # the pages' release later changes nothing for that slot
    assert r.slots.num_quarantined == 1 and r.slots.num_free == 1


class _Group:
    """The part of a ``DescGroup`` the stream reads: fused run pairs."""

    def __init__(self, src: torch.Tensor, dst_addr: int):
        class Run:
            def __init__(self, addr):
                self.addr, self.item_len, self.page_stride, self.device = addr, PAGE, PAGE, 0
        self.runs = ((Run(src.data_ptr()), Run(dst_addr)),)


class _Plan:
    def __init__(self, src, dst_addr):
        self.groups = (_Group(src, dst_addr),)


def _sender(engine, pool, crossover, metrics, nbytes=4 * 2 * PAGE, chunk=2 * PAGE) -> StagingSender:
    return StagingSender.build(engine, nbytes, chunk, crossover, [pool], metrics)


def _count(metrics: Metrics, path: str, reason: str) -> float:
    return metrics.registry.get_sample_value("kvferry_staging_rooms_total", {"path": path, "reason": reason}) or 0.0


def test_the_prefill_chooses_the_path_and_counts_why(engine):
    metrics = Metrics("prefill")
    pool = torch.zeros(64 * PAGE, dtype=torch.uint8)
    s = _sender(engine, pool, crossover=3, metrics=metrics)
    plan = _Plan(pool, 1 << 30)
    info = wire.StagingInfo(mem="DRAM", device=0, addr=1 << 40, slot_nbytes=8 * PAGE, num_slots=2)

    def transfer(pages, slot=0):
        return wire.Transfer(room=len(pages), decode_id="d", page_ids=pages, aux_slot=0, num_prompt_tokens=1,
                             staging_slot=slot)

    assert s.choose(plan, None, transfer([1, 5, 9]), [0, 1, 2]) is None
    assert s.choose(plan, info, transfer([1, 5, 9], slot=-1), [0, 1, 2]) is None
    assert s.choose(plan, info, transfer([1, 5, 9], slot=7), [0, 1, 2]) is None  # not a registered slot
    assert _count(metrics, "direct", "staging_off") == 3
    assert s.choose(plan, info, transfer([1, 2, 3]), [0, 1, 2]) is None  # adjacent both sides: 1 descriptor
    assert _count(metrics, "direct", "few_runs") == 1
    assert s.choose(plan, info, transfer(list(range(0, 20, 2))), list(range(10))) is None  # 10 pages > slot
    assert _count(metrics, "direct", "room_over_slot") == 1
    staged = s.choose(plan, info, transfer([1, 5, 9]), [0, 1, 2])
    assert staged is not None and staged.decode_addr == info.addr and staged.nbytes == 3 * PAGE
    assert [c.nbytes for c in staged.chunks] == [2 * PAGE, PAGE]  # chunks of at most 2 pages
    assert _count(metrics, "staged", "") == 1
    others = [s.choose(plan, info, transfer([1, 5, 9]), [0, 1, 2]) for _ in range(4)]
    assert sum(o is not None for o in others) == s.slots.num_slots - 1  # then no free slot: direct
    assert _count(metrics, "direct", "no_free_slot") == 4 - (s.slots.num_slots - 1)
    s.finish(staged, None)  # held, never written: free again
    assert s.slots.num_free == 1


def test_measured_costs_stage_only_where_the_model_says_staged_is_faster_and_for_the_memory_measured(engine):
    """With measured costs, the crossover counts the room's chunks (a WRITE each) and the copies; a
    decode whose slots sit in memory the costs were not measured for gets its rooms direct."""
    metrics = Metrics("prefill")
    pool = torch.zeros(64 * PAGE, dtype=torch.uint8)
    s = _sender(engine, pool, crossover=3, metrics=metrics)
    plan = _Plan(pool, 1 << 30)
    transfer = wire.Transfer(room=1, decode_id="d", page_ids=[1, 5, 9], aux_slot=0, num_prompt_tokens=1,
                             staging_slot=0)
    s.crossover = StagingCosts(per_descriptor_s=1e-5, copy_s_per_byte=0.0, per_write_s=1e-5)  # 2 chunks: 3 WRITEs
    assert s.crossover_for(3 * PAGE) == crossover_runs(s.crossover, 3 * PAGE, 2 * PAGE) == 5
    info = wire.StagingInfo(mem="DRAM", device=0, addr=1 << 40, slot_nbytes=8 * PAGE, num_slots=2)
    assert s.choose(plan, info, transfer, [0, 1, 2]) is None and _count(metrics, "direct", "few_runs") == 1
    s.crossover = StagingCosts(per_descriptor_s=1e-5, copy_s_per_byte=0.0)
    staged = s.choose(plan, info, transfer, [0, 1, 2])  # 3 runs against 2 chunks of free WRITEs: staged
    assert staged is not None
    s.finish(staged, None)
    vram = wire.StagingInfo(mem="VRAM", device=0, addr=1 << 40, slot_nbytes=8 * PAGE, num_slots=2)
    assert s.choose(plan, vram, transfer, [0, 1, 2]) is None
    assert _count(metrics, "direct", "unmeasured_transport") == 1


def test_crossover_off_or_too_small_a_buffer_means_no_staging(engine):
    pool = torch.zeros(64 * PAGE, dtype=torch.uint8)
    assert _sender(engine, pool, crossover=0, metrics=Metrics("prefill")) is None
    assert _sender(engine, pool, crossover=3, metrics=Metrics("prefill"), nbytes=3 * PAGE) is None  # < 2 chunks


def test_merged_runs_counts_what_nixl_merges():
    from kvferry.common.plan.staging import StreamSegment

    seg = StreamSegment(PAGE, np.array([0, PAGE, 5 * PAGE, 6 * PAGE]), np.array([0, PAGE, 2 * PAGE, 9 * PAGE]), 0, 0)
    assert merged_runs([seg]) == 3  # 0-1 adjacent on both sides; 1-2 apart on the prefill; 2-3 apart on the decode


def test_measured_costs_give_a_crossover_that_grows_with_the_room():
    costs = StagingCosts(per_descriptor_s=5e-6, copy_s_per_byte=2e-9, copy_fixed_s=1e-4)
    assert 2 <= crossover_runs(costs, 1 << 20) < crossover_runs(costs, 64 << 20)


def test_a_staged_room_aborted_mid_transfer_posts_no_further_chunk(engine):
    """The room is aborted while its second chunk is gathered (its first chunk on the wire): the
    sender checks the abort flag before every chunk's WRITE, so the second chunk never reaches the
    decode's slot (loopback WRITEs copy inside the post), no notification goes, the write ends with
    the abort's reason and the slot is free again. Fails if the abort check before each chunk WRITE
    in ``StagingSender.write`` is disabled (the second chunk lands)."""
    from kvferry.common.errors import FailCode, TransferError
    from kvferry.prefill_worker.rooms import Room

    pool = torch.arange(64 * PAGE, dtype=torch.int64).to(torch.uint8) | 1  # no zero byte
    s = _sender(engine, pool, crossover=1, metrics=Metrics("prefill"))
    decode = NixlEngine("staging-test-decode")
    slot = torch.zeros(8 * PAGE, dtype=torch.uint8)
    try:
        decode.register_tensor(slot)
        peer = engine.add_peer(decode.metadata())
        info = wire.StagingInfo(mem="DRAM", device=0, addr=slot.data_ptr(), slot_nbytes=8 * PAGE, num_slots=1)
        transfer = wire.Transfer(room=1, decode_id="d", page_ids=[1, 5, 9], aux_slot=0, num_prompt_tokens=1,
                                 staging_slot=0)
        staged = s.choose(_Plan(pool, 1 << 30), info, transfer, [0, 1, 2])
        assert staged is not None and len(staged.chunks) == 2
        room = Room(room=1, request_id="r", num_prompt_tokens=1, page_ids=[0, 1, 2], deadline=0.0)
        gather, notified = s._gather, []

        def gather_then_abort(st, chunk):  # the abort arrives while chunk 1 is gathered, chunk 0 posted
            gather(st, chunk)
            if chunk is st.chunks[1]:
                room.abort("client gave up (test)", FailCode.ABORTED)
        s._gather = gather_then_abort
        with pytest.raises(TransferError, match="client gave up"):
            s.write(engine, peer, staged, lambda: notified.append(True), room, deadline=1e12)
        s.finish(staged, TransferError("client gave up (test)"))
        first = staged.chunks[0].nbytes
        assert torch.equal(slot[:first], pool[:first])  # chunk 0 landed (pages 0, 1 of the prefill)
        assert slot[first:].count_nonzero() == 0, "a chunk was written after the room was aborted"
        assert notified == [] and s.slots.num_free == s.slots.num_slots
        engine.remove_peer(peer)
    finally:
        decode.close()


def test_a_staged_room_whose_write_could_not_be_cancelled_quarantines_the_prefill_slot(engine):
    """The prefill's slot is read by the WRITE: after an ``UnsafeWriteError`` it is never handed
    out again, after any other failure it is free. Fails if ``StagingSender.finish`` treats an
    UnsafeWriteError like a cancelled WRITE (the slot freed under a WRITE that may still read it)."""
    from kvferry.common.errors import TransferError, UnsafeWriteError

    pool = torch.zeros(64 * PAGE, dtype=torch.uint8)
    s = _sender(engine, pool, crossover=1, metrics=Metrics("prefill"))
    info = wire.StagingInfo(mem="DRAM", device=0, addr=1 << 40, slot_nbytes=8 * PAGE, num_slots=2)
    rooms = []
    for room in (1, 2):
        transfer = wire.Transfer(room=room, decode_id="d", page_ids=[1, 5, 9], aux_slot=0, num_prompt_tokens=1,
                                 staging_slot=0)
        rooms.append(s.choose(_Plan(pool, 1 << 30), info, transfer, [0, 1, 2]))
    assert None not in rooms and s.slots.num_free == 0
    for staged in rooms:
        s.slots.start_write(staged.slot)
    s.finish(rooms[0], UnsafeWriteError("cancel failed (test)"))
    s.finish(rooms[1], TransferError("peer lost (test)"))
    assert rooms[0].slot.state is SlotState.QUARANTINED and s.slots.num_quarantined == 1
    assert s.slots.num_free == 1 and rooms[1].slot.state is SlotState.FREE


@pytest.mark.parametrize("clock", ["real", "flat"])
def test_measured_costs_are_never_free(engine, clock, monkeypatch):
    """The start-up measurement (real NIXL WRITEs into a second agent, real gathers of a 4-row pool)
    gives every cost the chooser uses a positive value, also when each pair of timings it subtracts
    comes out equal, as within a busy machine's noise (the ``flat`` clock: every timed interval
    reads 2^-20 s, exactly). Fails if such a difference is clamped to 0: the chooser then counts the staged
    copies as free, and a zero descriptor cost reads as a buffer too small (staging off)."""
    from kvferry.prefill_worker import staging_costs

    if clock == "flat":
        ticks = itertools.count()
        monkeypatch.setattr(staging_costs, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) / (1 << 20)))
    buffer = torch.zeros(16 << 20, dtype=torch.uint8)
    pool = torch.ones(4 * (64 << 10), dtype=torch.uint8)
    engine.register_tensor(buffer)
    costs = staging_costs.measure_costs(engine, buffer, pool, reps=2)
    assert costs.per_write_s > 0 and costs.copy_fixed_s > 0, costs
    assert costs.copy_s_per_byte > 0 and costs.per_descriptor_s > 0 and costs.wire_s_per_byte > 0, costs
