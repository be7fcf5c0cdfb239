"""Staging a scattered room (issue 17): which path a room takes, the byte stream its runs make, the
row view the copy kernels use, and the chunks and steps of a pipelined staged WRITE. Pure: values in,
values out (no NIXL, device, clock or logging).

A room on the wire is, per prepared group (``DescGroup``), one list of equal-length byte runs per
fused run pair (``DescGroup.runs``): page p of a run is ``[addr + p * page_stride, + item_len)``, so
a page-major pool gives one run per page. Direct, NIXL moves each run that stays separate after
merging as one descriptor (~7.8 µs each on an H200 over ``cuda_ipc``). Staged::

    prefill pages ──gather──> prefill slot ──one WRITE per chunk──> decode slot ──scatter──> decode pages

The *stream* is the room's bytes in one order both sides derive alike: fused run pairs in group
order, and within each pair its pages in token order (``room_stream``). Byte ``s`` of the stream
sits at the same place in both slots, so the prefill gathers from its pages and the decode scatters
into its own with nothing else agreed.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvferry.common.plan.desc_lists import DescGroup


class TransferPath(enum.Enum):
    DIRECT = "direct"  # one WRITE of the room's runs as they are
    STAGED = "staged"  # gather, WRITE the slot, scatter


def choose_path(num_runs: int, crossover_runs: int) -> TransferPath:
    """STAGED when the room's WRITE would carry at least ``crossover_runs`` descriptors (after
    merging); ``crossover_runs <= 0`` turns staging off. The caller still takes DIRECT when no slot
    is free (``StagingSlots.acquire`` returns None) or the room does not fit (``chunk_plan``)."""
    if num_runs < 0:
        raise ValueError(f"num_runs is {num_runs}, expected >= 0")
    return TransferPath.STAGED if 0 < crossover_runs <= num_runs else TransferPath.DIRECT


@dataclass(frozen=True, slots=True)
class StagingCosts:
    """What one machine measured at start-up, for one peer transport (``measure_costs``), or what a
    test states. Units: seconds, and seconds per byte.

    ``per_descriptor_s``: one more descriptor in a WRITE. ``copy_s_per_byte``, ``copy_fixed_s``: the
    gather and the scatter together (two passes, each reading and writing every byte once), per
    byte and their launches. ``per_write_s``: one WRITE's fixed cost however small (its descriptor
    lists prepared, posted, polled to DONE, released: what each staged chunk pays). ``wire_s_per_byte``:
    the WRITE's own time per byte. ``copies_share_wire``: the copies use the memory the WRITE reads
    and writes (one device, or host memory on both sides), so none of them hides under a WRITE."""

    per_descriptor_s: float
    copy_s_per_byte: float
    copy_fixed_s: float = 0.0
    per_write_s: float = 0.0
    wire_s_per_byte: float = 0.0
    copies_share_wire: bool = True


def num_chunks(nbytes: int, chunk_nbytes: int | None) -> int:
    """Chunks (one WRITE each) of a staged room of ``nbytes``: ``ceil(nbytes / chunk_nbytes)``, at
    least 1; 1 without a chunk size (the whole room in one WRITE). ``chunk_plan`` may cut more
    where whole runs do not fill a chunk: this is the model's estimate."""
    if chunk_nbytes is None:
        return 1
    if chunk_nbytes <= 0:
        raise ValueError(f"chunk_nbytes is {chunk_nbytes}, expected > 0")
    return max(1, -(-nbytes // chunk_nbytes))


def direct_s(costs: StagingCosts, num_runs: int, nbytes: int) -> float:
    """The model's direct WRITE of a room: one WRITE of its ``num_runs`` merged runs and the aux
    record's descriptor, its bytes on the wire once."""
    return costs.per_write_s + (num_runs + 1) * costs.per_descriptor_s + nbytes * costs.wire_s_per_byte


def _staged_parts(costs: StagingCosts, nbytes: int, chunk_nbytes: int | None) -> tuple[int, float]:
    """(chunks, staged time less the per-descriptor costs of its WRITEs' descriptors)."""
    n = num_chunks(nbytes, chunk_nbytes)
    wire = nbytes * costs.wire_s_per_byte
    copy = costs.copy_fixed_s + nbytes * costs.copy_s_per_byte
    # apart from the WRITE's memory, the gather of chunk i + 1 runs under chunk i's WRITE
    hidden = 0.0 if costs.copies_share_wire else min(copy / 2, wire) * (n - 1) / n
    return n, (n + 1) * costs.per_write_s + wire + copy - hidden


def staged_s(costs: StagingCosts, nbytes: int, chunk_nbytes: int | None) -> float:
    """The model's staged room: one WRITE of one descriptor per chunk plus one for the aux record
    (and the notification), the bytes once on the wire, the gather and the scatter."""
    n, rest = _staged_parts(costs, nbytes, chunk_nbytes)
    return rest + (n + 1) * costs.per_descriptor_s


def faster_path(costs: StagingCosts, num_runs: int, nbytes: int, chunk_nbytes: int | None) -> TransferPath:
    """STAGED iff the model's staged time is below its direct time (never with free descriptors)."""
    if costs.per_descriptor_s <= 0:
        return TransferPath.DIRECT
    staged = staged_s(costs, nbytes, chunk_nbytes)
    return TransferPath.STAGED if staged < direct_s(costs, num_runs, nbytes) else TransferPath.DIRECT


def crossover_runs(costs: StagingCosts, room_nbytes: int, chunk_nbytes: int | None = None) -> int:
    """The fewest runs at which staging a room of ``room_nbytes`` in chunks of ``chunk_nbytes``
    beats its direct WRITE (``faster_path``; one run of slack where floats round).

    Direct minus staged is ``(runs - n) * d - (n * w + copy - hidden)`` for ``n`` chunks, ``d`` per
    descriptor and ``w`` per WRITE (the wire time is the same on both paths): staged wins iff
    ``runs > n + (n * w + copy - hidden) / d``. 0 (never stage) when a descriptor costs nothing."""
    if costs.per_descriptor_s <= 0:
        return 0
    n, rest = _staged_parts(costs, room_nbytes, chunk_nbytes)
    extra = rest - costs.per_write_s - room_nbytes * costs.wire_s_per_byte  # n * w + copy - hidden
    return math.floor(n + extra / costs.per_descriptor_s) + 1


@dataclass(frozen=True, slots=True)
class StreamSegment:
    """One fused run pair's part of a room's stream: ``len(prefill_addrs)`` runs of ``run_nbytes``,
    run i read from ``prefill_addrs[i]`` and written to ``decode_addrs[i]`` (absolute addresses;
    each side's runs on its own device)."""

    run_nbytes: int
    prefill_addrs: np.ndarray  # int64 [num_runs]
    decode_addrs: np.ndarray   # int64 [num_runs]
    prefill_device: int
    decode_device: int
    # A converted room (``common/plan/convert.py``): the prefill's runs are ``prefill_run_nbytes`` long
    # (``ratio`` times ``run_nbytes``, the stream's and the decode's length) and hold the items of
    # ``len(scales)`` member regions in turn, item j converted with ``scales[j]``. 0 and (): as they are.
    prefill_run_nbytes: int = 0
    scales: tuple[float, ...] = ()

    @property
    def num_runs(self) -> int:
        return len(self.prefill_addrs)

    @property
    def prefill_nbytes(self) -> int:
        """Bytes of one run on the prefill (what its gather reads)."""
        return self.prefill_run_nbytes or self.run_nbytes


def room_stream(group: DescGroup, prefill_page_ids: Sequence[int], decode_page_ids: Sequence[int],
                converted: bool = False) -> tuple[StreamSegment, ...]:
    """The room's runs in stream order (module docstring). Invariant: segment k's runs are exactly
    the pages ``prefill_page_ids``/``decode_page_ids`` of ``group.runs[k]``, in token order, so the
    stream holds the bytes a direct WRITE of the room moves (the aux record apart), each once, in
    the decode's dtype (``converted``: the prefill's runs hold another, ``common/plan/convert.py``)."""
    if len(prefill_page_ids) != len(decode_page_ids):
        raise ValueError(f"{len(prefill_page_ids)} prefill pages against {len(decode_page_ids)} decode pages")
    p_ids, d_ids = np.asarray(prefill_page_ids, dtype=np.int64), np.asarray(decode_page_ids, dtype=np.int64)
    return tuple(
        StreamSegment(d.item_len, p.addr + p_ids * p.page_stride, d.addr + d_ids * d.page_stride, p.device, d.device,
                      *((p.item_len, tuple(scale for _, scale in d.members)) if converted else ()))
        for p, d in group.runs)


_ELEM_NBYTES = (8, 4, 2, 1)  # torch has no 16-byte integer; Triton widens 8-byte loads itself


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """One side's runs of one segment as rows of the buffer they live in: the copy kernels' view.

    The buffer (``base_addr``) is cut into rows of ``row_nbytes``, the greatest common divisor of
    the run length and every run's offset, so run i is rows ``rows[i] .. rows[i] + rows_per_run - 1``
    and its bytes land at ``[i * run_nbytes, + run_nbytes)`` of the staging slot. ``elem_nbytes`` is
    the widest integer element (8, 4, 2 or 1 bytes) that divides the row and both buffers' addresses:
    a page-major pool gives rows of whole page blocks and 8-byte elements (which the Triton kernels
    load two at a time when the addresses allow 16).
    """

    run_nbytes: int
    row_nbytes: int
    elem_nbytes: int
    rows: np.ndarray  # int64 [num_runs]: each run's first row
    base_addr: int = 0  # where the buffer starts: the copies check they were given that buffer

    @property
    def rows_per_run(self) -> int:
        return self.run_nbytes // self.row_nbytes

    @property
    def num_runs(self) -> int:
        return len(self.rows)

    def row_index(self) -> np.ndarray:
        """int64 [num_runs * rows_per_run]: the buffer row of each staging row, in stream order."""
        return (self.rows[:, None] + np.arange(self.rows_per_run, dtype=np.int64)[None, :]).ravel()


def copy_plan(addrs: np.ndarray, run_nbytes: int, base_addr: int, staging_addr: int, buffer_nbytes: int) -> CopyPlan:
    """The row view of runs at ``addrs`` (absolute) inside a buffer at ``base_addr`` of
    ``buffer_nbytes``, copied to or from a slot at ``staging_addr``. Refuses a run outside the buffer
    and runs that overlap (a room's runs are distinct pages; a scatter into overlapping runs races).
    Invariant: ``rows[i] * row_nbytes == addrs[i] - base_addr``; the runs' rows are distinct and
    inside the buffer."""
    if run_nbytes <= 0:
        raise ValueError(f"run_nbytes is {run_nbytes}, expected > 0")
    offsets = np.asarray(addrs, dtype=np.int64) - base_addr
    if len(offsets) and (offsets.min() < 0 or offsets.max() + run_nbytes > buffer_nbytes):
        bad = int(offsets.min() if offsets.min() < 0 else offsets.max())
        raise ValueError(f"a run at offset {bad} (+{run_nbytes} bytes) is outside the {buffer_nbytes}-byte buffer")
    ordered = np.sort(offsets)
    if len(ordered) > 1 and np.diff(ordered).min() < run_nbytes:  # a scatter into them would race
        at = int(np.argmin(np.diff(ordered)))
        raise ValueError(f"runs at offsets {int(ordered[at])} and {int(ordered[at + 1])} overlap ({run_nbytes}-byte runs)")
    row = math.gcd(run_nbytes, int(np.gcd.reduce(offsets))) if len(offsets) else run_nbytes
    elem = next(e for e in _ELEM_NBYTES if row % e == 0 and base_addr % e == 0 and staging_addr % e == 0)
    return CopyPlan(run_nbytes, row, elem, offsets // row, base_addr)


@dataclass(frozen=True, slots=True)
class ChunkPart:
    """Runs ``[first_run, first_run + num_runs)`` of segment ``segment``."""

    segment: int
    first_run: int
    num_runs: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """One WRITE of a staged room: whole runs, stream bytes ``[stream_offset, + nbytes)``, gathered
    into prefill buffer ``buffer`` (of ``num_buffers``, each ``chunk_nbytes``) and written to the
    decode slot at ``stream_offset`` (the decode's slot holds the whole room: it learns the room
    has landed from the one notification, after the last chunk)."""

    index: int
    parts: tuple[ChunkPart, ...]
    stream_offset: int
    nbytes: int
    buffer: int


def chunk_plan(run_nbytes: Sequence[int], num_runs: Sequence[int], chunk_nbytes: int, num_buffers: int = 2
               ) -> tuple[Chunk, ...] | None:
    """The room's stream (segment k: ``num_runs[k]`` runs of ``run_nbytes[k]``) cut into chunks of at
    most ``chunk_nbytes``, each of whole runs, filled greedily in stream order; chunk i uses prefill
    buffer ``i % num_buffers``. None when a run is longer than a chunk (the room goes direct).
    Invariant: the chunks tile the stream in order, no gap, no overlap, every run in exactly one."""
    if chunk_nbytes <= 0 or num_buffers <= 0:
        raise ValueError(f"chunk_nbytes={chunk_nbytes} and num_buffers={num_buffers} must be > 0")
    if any(n > chunk_nbytes for n, count in zip(run_nbytes, num_runs, strict=True) if count):
        return None
    chunks: list[Chunk] = []
    parts: list[ChunkPart] = []
    start = fill = 0

    def close() -> None:
        nonlocal parts, start, fill
        if parts:
            chunks.append(Chunk(len(chunks), tuple(parts), start, fill, len(chunks) % num_buffers))
            start, parts, fill = start + fill, [], 0

    for seg, (nbytes, count) in enumerate(zip(run_nbytes, num_runs)):
        run = 0
        while run < count:
            fit = min(count - run, (chunk_nbytes - fill) // nbytes)
            if fit == 0:
                close()
                continue
            parts.append(ChunkPart(seg, run, fit))
            run, fill = run + fit, fill + fit * nbytes
    close()
    return tuple(chunks)


class DirectReason(enum.Enum):
    """Why a room went direct: a metrics label and a log field, so that an operator sees what staging
    would need (a lower crossover, more ``--staging-bytes``, larger slots)."""

    STAGING_OFF = "staging_off"
    FEW_RUNS = "few_runs"                    # fewer runs than the crossover
    ROOM_OVER_SLOT = "room_over_slot"        # the room is larger than the decode's slot
    RUN_OVER_CHUNK = "run_over_chunk"        # one run is larger than the prefill's chunk
    NO_FREE_SLOT = "no_free_slot"            # every slot busy on one side (the caller's finding)
    UNMEASURED_TRANSPORT = "unmeasured_transport"  # the decode's slots sit in memory the costs were not measured for


@dataclass(frozen=True, slots=True)
class RoomPlan:
    """A room's path; for STAGED, its chunks; for DIRECT, why."""

    path: TransferPath
    chunks: tuple[Chunk, ...] = ()
    reason: DirectReason | None = None


def plan_room(segments: Sequence[StreamSegment], num_runs: int, crossover_runs: int, chunk_nbytes: int,
              decode_slot_nbytes: int, num_buffers: int = 2) -> RoomPlan:
    """The room's path before any slot is taken: ``choose_path`` on its merged run count, then the
    sizes (the decode's slot holds the whole room; each run fits in a prefill chunk). Invariant:
    STAGED comes with chunks that tile the room's stream; DIRECT with its reason."""
    if crossover_runs <= 0:
        return RoomPlan(TransferPath.DIRECT, reason=DirectReason.STAGING_OFF)
    if choose_path(num_runs, crossover_runs) is TransferPath.DIRECT:
        return RoomPlan(TransferPath.DIRECT, reason=DirectReason.FEW_RUNS)
    if sum(s.num_runs * s.run_nbytes for s in segments) > decode_slot_nbytes:
        return RoomPlan(TransferPath.DIRECT, reason=DirectReason.ROOM_OVER_SLOT)
    chunks = chunk_plan([s.run_nbytes for s in segments], [s.num_runs for s in segments], chunk_nbytes, num_buffers)
    if chunks is None:
        return RoomPlan(TransferPath.DIRECT, reason=DirectReason.RUN_OVER_CHUNK)
    return RoomPlan(TransferPath.STAGED, chunks)


class StepOp(enum.Enum):
    GATHER = "gather"  # launch the gather of chunk i into its buffer
    WRITE = "write"    # post chunk i's WRITE (after its gather has finished: the WRITE reads the buffer)
    WAIT = "wait"      # poll chunk i's WRITE to DONE (its buffer may be gathered into again)
    NOTIFY = "notify"  # the aux record and the notification: last, after every chunk's WRITE is DONE


@dataclass(frozen=True, slots=True)
class Step:
    op: StepOp
    chunk: int  # -1 for NOTIFY


def pipeline_steps(chunks: Sequence[Chunk], num_buffers: int) -> tuple[Step, ...]:
    """The prefill's order of work for a staged room: chunk i + 1 is gathered while chunk i is on
    the wire. Invariants (tested): GATHER i before WRITE i; a buffer is gathered into again only
    after the WAIT of the chunk that last used it; GATHER i + 1 comes before WAIT i (overlap); every
    WRITE is waited for; NOTIFY is last, so the decode never hears of a room with a WRITE still
    landing (NIXL orders nothing across WRITEs)."""
    steps: list[Step] = []
    if chunks:
        steps.append(Step(StepOp.GATHER, 0))
    for i in range(len(chunks)):
        steps.append(Step(StepOp.WRITE, i))
        nxt = i + 1
        if nxt < len(chunks):
            if nxt >= num_buffers:
                steps.append(Step(StepOp.WAIT, nxt - num_buffers))
            steps.append(Step(StepOp.GATHER, nxt))
    steps.extend(Step(StepOp.WAIT, i) for i in range(max(0, len(chunks) - num_buffers), len(chunks)))
    steps.append(Step(StepOp.NOTIFY, -1))
    return tuple(steps)
