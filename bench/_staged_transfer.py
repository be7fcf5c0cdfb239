"""bench/transfer.py's staged line: a room moved as the daemons stage it, with the daemons' own code.

Decode process: a ``StagingReceiver`` (decode_worker/staging.py) with one slot as large as the
largest room, registered beside the pool; on "scatter" it runs ``StagingReceiver._scatter`` (the
scatter the decode daemon runs on its model executor, with the stream runs the prefill announced,
as ``RegisterAck.staging_runs`` carries them) and replies the seconds it took, timed there.

Prefill process: a ``StagingSender`` (prefill_worker/staging.py) built as the daemon builds it
(two chunk buffers of --staging-chunk-bytes, registered; crossover -1 measures its costs with
``measure_costs`` at start-up). Per room, ``choose`` (the room's stream, merged runs, chunk plan and
slot) runs before the clock starts, like KvWriter's index lists; the timed part is
``StagingSender.write`` (pipelined gathers, one WRITE per chunk into the decode's slot, each polled
to DONE, then the aux record alone carrying the notification, as ``KvWriter._write_staged``), then
the decode's scatter. Every room is staged for the measurement; the chooser's decision with the
measured costs (``plan_room`` with ``crossover_runs``) is reported beside it.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from kvferry.common.wire import messages as wire
from kvferry.common.plan import geometry
from kvferry.common.plan.staging import StagingCosts, crossover_runs, direct_s, plan_room, room_stream, staged_s
from kvferry.common.wire.staging_slots import StagingSlot
from kvferry.decode_worker.staging import StagingReceiver
from kvferry.prefill_worker.staging import NUM_BUFFERS, StagingSender, merged_runs, stream_runs

ROOM_ID = 7  # the bench's one room id (the slots track their holder by it)


class DecodeStaging:
    """The decode process's side: its receiver, one slot, the runs the prefill announced."""

    def __init__(self, engine, pool: torch.Tensor, slot_nbytes: int) -> None:
        self.receiver = StagingReceiver.build(engine, slot_nbytes, slot_nbytes, pool.device, [pool], None)
        self.slot = StagingSlot(0, 0, slot_nbytes)
        self.runs: list[list[int]] | None = None

    def info(self) -> wire.StagingInfo:
        return self.receiver.info()

    def scatter(self, page_ids: list[int]) -> float:
        """The slot into ``page_ids`` (the daemon's scatter, synchronised on CUDA); its seconds."""
        if self.runs is None:
            raise RuntimeError("scatter before the prefill announced the stream's runs")
        start = time.perf_counter()
        self.receiver._scatter(self.slot, self.runs, page_ids)  # noqa: SLF001 - the daemon's scatter itself
        return time.perf_counter() - start


class _Count:
    def labels(self, **_):
        return self

    def inc(self, *_):
        pass


class _Metrics:
    staging_rooms = _Count()


class _Room:
    """What ``StagingSender.write`` asks of a room: never aborted here."""

    is_aborted = False

    def failure(self) -> Exception:
        return RuntimeError("aborted")


@dataclass
class Decision:
    runs: int            # descriptors the room's direct WRITE carries after merging (aux record apart)
    crossover: int       # the crossover for this room's bytes (measured costs) or the flag's count
    path: str            # what the prefill daemon would do with this room: staged or direct
    reason: str          # why direct ("" when staged)
    chunks: int
    model_direct_ms: float | None = None  # the chooser's model of each path (measured costs; common/plan/staging.py)
    model_staged_ms: float | None = None


class PrefillStaging:
    """The prefill's staged path toward the bench's decode process."""

    def __init__(self, prefill, chunk_nbytes: int, crossover: int, info: wire.StagingInfo) -> None:
        self.prefill, self.info, self.chunk_nbytes = prefill, info, chunk_nbytes
        slot = NUM_BUFFERS * chunk_nbytes  # one room in flight; measure_costs reads 1 MiB of the buffer
        nbytes = slot * -(-(1 << 20) // slot)
        self.costs_error = ""
        try:
            sender = StagingSender.build(prefill.engine, nbytes, chunk_nbytes, crossover or 1, [prefill.kv.buffer],
                                         _Metrics())
        except Exception as exc:  # noqa: BLE001 - the staged figures stand without the chooser's costs
            if crossover >= 0:
                raise
            self.costs_error = f"{type(exc).__name__}: {exc}"[:300]
            print(f"staging costs not measured ({self.costs_error}): chooser not reported", file=sys.stderr)
            sender = StagingSender.build(prefill.engine, nbytes, chunk_nbytes, 1, [prefill.kv.buffer], _Metrics())
        self.costs: StagingCosts | None = sender.crossover if isinstance(sender.crossover, StagingCosts) else None
        self.fixed_crossover = crossover  # >= 0: the flag's count (0: the daemon would never stage)
        sender.crossover = 1  # the measurement stages every room; the chooser's decision is reported apart
        self.sender = sender
        prefill.ask("runs", stream_runs(prefill.plan))  # what RegisterAck.staging_runs tells the decode

    def decision(self, prefill_ids: list[int], decode_ids: list[int]) -> Decision:
        segments = tuple(s for g in self.prefill.plan.groups for s in room_stream(g, prefill_ids, decode_ids))
        nbytes = sum(s.num_runs * s.run_nbytes for s in segments)
        runs = merged_runs(segments)
        cross = crossover_runs(self.costs, nbytes, self.chunk_nbytes) if self.costs is not None else self.fixed_crossover
        chunks = len(plan_room(segments, runs, 1, self.chunk_nbytes, self.info.slot_nbytes, NUM_BUFFERS).chunks)
        if cross < 0:  # the costs could not be measured (costs_error)
            return Decision(runs, cross, "unknown", self.costs_error, chunks)
        room = plan_room(segments, runs, cross, self.chunk_nbytes, self.info.slot_nbytes, NUM_BUFFERS)
        model = ((round(direct_s(self.costs, runs, nbytes) * 1e3, 4), round(staged_s(self.costs, nbytes, self.chunk_nbytes)
                  * 1e3, 4)) if self.costs is not None else (None, None))
        return Decision(runs, cross, room.path.value, room.reason.value if room.reason else "", chunks, *model)

    def write(self, tokens: int, prefill_ids: list[int], decode_ids: list[int], notif: bytes
              ) -> tuple[float, float, float, float, float]:
        """One staged room; returns (plan s, write + scatter s, write s, scatter s, end-to-end s): plan =
        ``choose`` and the aux record's indices (before the clock); write = ``StagingSender.write``
        to the aux record's DONE; scatter = the decode's, timed there; end to end = from the write's
        start to the decode's reply (a Pipe round trip standing in for the notification)."""
        pf, engine = self.prefill, self.prefill.engine
        start = time.perf_counter()
        transfer = wire.Transfer(room=ROOM_ID, decode_id="bench", page_ids=decode_ids, aux_slot=0,
                                 num_prompt_tokens=tokens, staging_slot=0)
        staged = self.sender.choose(pf.plan, self.info, transfer, prefill_ids)
        if staged is None:
            raise RuntimeError(f"{tokens} tokens: the staged path refused the room (slot or chunk too small?)")
        xfer = geometry.request_indices(pf.plan, prefill_page_ids=prefill_ids, decode_page_ids=decode_ids,
                                        prefill_aux_slot=1, decode_aux_slot=0)
        (local, remote), (local_idx, remote_idx) = pf.prepped[-1], xfer.per_group[-1]

        def aux_write() -> None:  # KvWriter._write_staged: the aux record alone, carrying the notification
            handle = engine.post_write(local, local_idx[-1:], remote, remote_idx[-1:], notif)
            engine.wait(handle, 60.0)
            engine.release(handle)

        planned = time.perf_counter()
        pf.sync()
        begun = time.perf_counter()
        exc = None
        try:
            self.sender.write(engine, pf.peer, staged, aux_write, _Room(), time.monotonic() + 60.0)
        except BaseException as e:
            exc = e
            raise
        finally:
            self.sender.finish(staged, exc)
        wrote = time.perf_counter() - begun
        scatter = pf.ask("scatter", decode_ids)
        e2e = time.perf_counter() - begun
        return planned - start, wrote + scatter, wrote, scatter, e2e
