"""The staging chooser's start-up measurements (``prefill_worker/staging.py``): what a descriptor, a
WRITE and a gathered byte cost on this machine, between two agents of this process, and the log line
that states the crossover they give."""

from __future__ import annotations

import logging
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvferry.common.kernels.staging_copy import gather, row_index
from kvferry.common.plan.staging import StagingCosts, copy_plan, crossover_runs
from kvferry.common.transport.nixl import NixlEngine

logger = logging.getLogger("kvferry.prefill_worker.staging")


def measure_costs(engine: NixlEngine, buffer: torch.Tensor, pool: torch.Tensor, reps: int = 5) -> StagingCosts:
    """This machine's costs for the chooser (start-up, a fraction of a second), over the transport a
    decode on this host whose staging slots sit in the buffer's kind of memory uses: WRITEs into a
    second agent of this process. Up to 256 descriptors of 4 KiB against one of the same bytes (per
    descriptor, and per byte on the wire), a 64-byte WRITE prepared, posted, polled to DONE and
    released ``4 * reps`` times (per WRITE: what each staged chunk pays), and a gather of up to
    16 MiB from the pool in 64 KiB rows (a page block's size) against one row. A buffer too small
    to measure gives costs that never stage (logged by the caller)."""
    size = 4096
    num = min(256, buffer.numel() * buffer.element_size() // size)
    if num < 2:
        return StagingCosts(per_descriptor_s=0.0, copy_s_per_byte=0.0)
    probe = NixlEngine("staging-probe")
    target = torch.empty(2 * num * size, dtype=torch.uint8, device=buffer.device)
    stop = threading.Event()
    poller = None
    try:
        probe.register_tensor(target)
        name = engine.add_peer(probe.metadata())

        def progress() -> None:  # the target's progress: a loopback WRITE completes while it polls
            while not stop.is_set():
                probe.get_notifs()
                stop.wait(1e-4)

        poller = threading.Thread(target=progress, name="staging-probe", daemon=True)
        poller.start()
        writes = _time_writes(engine, name, buffer, target, num, size, reps)
        engine.remove_peer(name)
        row = 64 << 10
        rows = min(256, buffer.numel() * buffer.element_size() // row, pool.numel() * pool.element_size() // (2 * row))
        if rows < 2:
            return StagingCosts(per_descriptor_s=0.0, copy_s_per_byte=0.0)
        copy_many = _time_gather(pool, buffer, rows, row, reps)
        copy_one = _time_gather(pool, buffer, 1, row, reps)
        per_byte = _marginal(copy_many, copy_one, (rows - 1) * row, rows * row)
        # gather + scatter: two passes over the bytes, both on the memory the WRITE uses
        return StagingCosts(per_descriptor_s=writes.per_descriptor_s, copy_s_per_byte=2 * per_byte,
                            copy_fixed_s=2 * copy_one, per_write_s=writes.per_write_s,
                            wire_s_per_byte=writes.wire_s_per_byte, copies_share_wire=True)
    finally:
        stop.set()
        if poller is not None:
            poller.join(timeout=5)
        probe.close()


@dataclass(frozen=True, slots=True)
class _WriteCosts:
    per_descriptor_s: float
    per_write_s: float
    wire_s_per_byte: float


def _time_writes(engine: NixlEngine, peer: str, buffer: torch.Tensor, target: torch.Tensor, num: int, size: int,
                 reps: int) -> _WriteCosts:
    """WRITE costs from ``buffer`` into ``target`` (registered by agent ``peer``): ``num`` blocks of
    ``size`` (every other block of the target: nothing merges) against one descriptor of the same
    bytes and against 64 bytes, prepared lists; then a 64-byte WRITE's whole cycle."""
    mem = "VRAM" if buffer.is_cuda else "DRAM"
    dev = (buffer.device.index or 0) if buffer.is_cuda else 0
    src_base, dst_base = buffer.data_ptr(), target.data_ptr()
    shapes = {"many": ([(src_base + i * size, size, dev) for i in range(num)],
                       [(dst_base + 2 * i * size, size, dev) for i in range(num)]),
              "one": ([(src_base, num * size, dev)], [(dst_base, num * size, dev)]),
              "tiny": ([(src_base, 64, dev)], [(dst_base, 64, dev)])}
    times = {}
    for key, (src, dst) in shapes.items():
        local, remote = engine.prep_local(src, mem), engine.prep_remote(peer, dst, mem)
        index = list(range(len(src)))
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            handle = engine.post_write(local, index, remote, index, None)
            engine.wait(handle, 10.0)
            engine.release(handle)
            best = min(best, time.perf_counter() - start)
        engine.release_prepped(local)
        engine.release_prepped(remote)
        times[key] = best
    cycles = []
    for _ in range(4 * reps):  # what StagingSender._post and the WAIT step do per chunk
        start = time.perf_counter()
        local, remote = engine.prep_local(shapes["tiny"][0], mem), engine.prep_remote(peer, shapes["tiny"][1], mem)
        try:
            handle = engine.post_write(local, [0], remote, [0], None)
            engine.wait(handle, 10.0)
            engine.release(handle)
        finally:
            engine.release_prepped(local)
            engine.release_prepped(remote)
        cycles.append(time.perf_counter() - start)
    return _WriteCosts(per_descriptor_s=_marginal(times["many"], times["one"], num - 1, num),
                       per_write_s=statistics.median(cycles),
                       wire_s_per_byte=_marginal(times["one"], times["tiny"], num * size, num * size))


def _marginal(more_s: float, less_s: float, span: int, units: int) -> float:
    """The cost of one unit: ``more_s - less_s`` over the ``span`` units between the two timings;
    when noise (a busy machine) leaves no positive difference, the larger timing over its ``units``,
    an upper bound (its fixed cost included) and never 0: a free copy would always stage, and no
    descriptor cost reads as a buffer too small to measure (staging off)."""
    diff = (more_s - less_s) / span
    return diff if diff > 0 else more_s / units


def log_costs(costs: StagingCosts, chunk_nbytes: int, buffer_nbytes: int) -> None:
    if costs.per_descriptor_s <= 0:
        logger.warning("staging: the %d-byte staging buffer is too small to measure costs in; staging off "
                       "(raise --staging-bytes or set --staging-crossover-runs)", buffer_nbytes)
    logger.info("staging costs measured at start-up: %.2f us per descriptor, %.1f us per WRITE, %.4f ns per byte on "
                "the wire, %.4f ns per byte gathered + scattered, %.1f us per copy; with %d-byte chunks stage a room "
                "at or above %d descriptors (1 MiB), %d (64 MiB), %d (1 GiB)",
                costs.per_descriptor_s * 1e6, costs.per_write_s * 1e6, costs.wire_s_per_byte * 1e9,
                costs.copy_s_per_byte * 1e9, costs.copy_fixed_s * 1e6, chunk_nbytes,
                *(crossover_runs(costs, n, chunk_nbytes) for n in (1 << 20, 64 << 20, 1 << 30)))


def _time_gather(pool: torch.Tensor, buffer: torch.Tensor, num: int, size: int, reps: int) -> float:
    """Best time of gathering ``num`` rows of ``size`` bytes of ``pool`` (every other row) into ``buffer``."""
    pool_nbytes = pool.numel() * pool.element_size()
    rows = min(num, pool_nbytes // (2 * size))
    addrs = pool.data_ptr() + 2 * size * np.arange(rows, dtype=np.int64)
    plan = copy_plan(addrs, size, pool.data_ptr(), buffer.data_ptr(), pool_nbytes)
    index = row_index(plan, pool.device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        gather(pool, buffer[:rows * size], plan, index)
        if pool.is_cuda:
            torch.cuda.synchronize(pool.device)
        best = min(best, time.perf_counter() - start)
    return best
