"""Staging (issue 17): does gather + one WRITE + scatter beat a WRITE of scattered pages, and does a
pipelined staged room come near a one-descriptor WRITE of the same bytes?

One room of --pages pages of --page-kib KiB (a page-major pool's page block: a Llama-3-8B 16-token
block is 2 MiB), on random pages of a prefill pool and of a decode pool four times its size. Two
processes, as bench/transfer.py (NIXL over cuda_ipc needs them): this one is the prefill (its pool,
slot and chunk buffers, the initiating agent), a spawned child the decode (its pool, a slot as large
as the room, its agent, which polls notifications as the decode daemon does, and its scatter),
driven over a Pipe; the Pipe's reply stands in for the notification. Per case, medians of --iters
interleaved iterations after a warm-up whose bytes are checked on the decode's pages:
  direct     one prepared WRITE of the room's pages as they are: one descriptor per page
  write1     one WRITE of the same bytes as ONE descriptor (prefill slot -> decode slot)
  gather     the room's pages into the prefill slot (Triton on CUDA, torch index_select on CPU)
  scatter    the decode slot into the room's decode pages (Triton / index_copy_), timed in the child
  staged     gather, write1, then the decode's scatter, one after another
  pipelined  the room cut into --chunks chunks (chunk_plan, two prefill chunk buffers, pipeline_steps):
             chunk i + 1 gathered on a CUDA stream while chunk i's WRITE is on the wire (each WRITE
             posted once its gather's event is done), then the decode's scatter of the whole room
  memcpy     one contiguous torch copy of as many bytes (device-to-device on CUDA)
per_desc_us = (direct - write1) / (pages - 1). staged_vs_direct = direct / staged (> 1: staging
pays); pipelined_vs_write1 = write1 / pipelined (the issue's goal: >= 0.8); both medians of
per-iteration ratios. --device cuda also times torch's index ops (gather_torch_ms, scatter_torch_ms)
and, with --triton-block, first sweeps the kernels' configurations (one "staging_kernel" JSON line
each) and runs the cases with the fastest.
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, git_hash, hardware, median  # noqa: E402
from bench._staging_side import Side, checksums, decode_main, set_kernel  # noqa: E402
from kvferry.common.kernels import staging_copy  # noqa: E402
from kvferry.common.plan.staging import StepOp, chunk_plan, pipeline_steps  # noqa: E402
from kvferry.common.transport.nixl import XferState  # noqa: E402

POOL_FACTOR = 4  # decode pages per room page
NUM_BUFFERS = 2  # prefill chunk buffers of the pipelined case
logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL logs INFO to stdout, where the JSON goes


class Prefill(Side):
    """The initiator: pool, slot, chunk buffers; the decode process behind ``conn``."""

    def __init__(self, conn, room: int, chunk_pages: int, page_nbytes: int, device: str, kernel_configs: list[str]
                 ) -> None:
        super().__init__("bench-staging-prefill", 2 * room, room * page_nbytes, page_nbytes, device)
        self.conn, self.room, self.kernel_configs = conn, room, kernel_configs
        self.buffers = torch.empty(NUM_BUFFERS * chunk_pages * page_nbytes, dtype=torch.uint8, device=self.device)
        self.engine.register_tensor(self.buffers)
        self.pool.random_(0, 256)
        if not conn.poll(120):
            raise TimeoutError("the decode process sent no NIXL metadata within 120 s")
        metadata, self.d_pool, self.d_slot, self.d_index, self.d_mem = conn.recv()
        self.peer = self.engine.add_peer(metadata)
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None

    def ask(self, cmd: str, arg=None):
        self.conn.send((cmd, arg))
        if not self.conn.poll(120):
            raise TimeoutError(f"the decode process did not answer {cmd!r} within 120 s")
        reply = self.conn.recv()
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            raise RuntimeError(f"decode process, {cmd}: {reply[1]}")
        return reply

    def remote(self, descs):
        return self.engine.prep_remote(self.peer, descs, self.d_mem)

    def post(self, local, remote, idx):
        return self.engine.post_write(local, idx, remote, idx, None)

    def finish(self, handle) -> None:
        """Poll a WRITE to DONE (busy: a WRITE of a few hundred µs must be seen at once), release it."""
        try:
            while (state := self.engine.poll(handle)) is not XferState.DONE:
                if state is XferState.ERR:
                    raise RuntimeError("a WRITE ended in ERR")
        finally:
            self.engine.release(handle)

    def timed(self, fn) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


def kernel_sweep(pf: Prefill, n: int, configs: list[str], iters: int, p_ids: np.ndarray) -> str:
    """Time the Triton gather and scatter of the room on the prefill's pool per configuration (the
    scatter writes the gathered pages back where they were: the pool stays as it was); one JSON
    line each; returns the configuration with the least gather + scatter."""
    from kvferry.common.kernels import triton_staging
    plan, index = pf.plan(p_ids, pf.slot)
    nbytes = n * pf.page_nbytes
    best, best_ms = None, math.inf
    for text in configs:
        cfg = triton_staging.KernelConfig.parse(text)
        pool_rows, slot_rows = staging_copy.rows_view(pf.pool, plan), staging_copy.rows_view(pf.slot[:nbytes], plan)

        def gather(cfg=cfg, pool_rows=pool_rows, slot_rows=slot_rows):
            triton_staging.gather_rows(pool_rows, slot_rows, index, cfg)

        def scatter(cfg=cfg, pool_rows=pool_rows, slot_rows=slot_rows):
            triton_staging.scatter_rows(slot_rows, pool_rows, index, cfg)

        gather(), scatter()  # compile
        g = median([pf.timed(gather) for _ in range(iters)]) * 1e3
        s = median([pf.timed(scatter) for _ in range(iters)]) * 1e3
        emit({"bench": "staging_kernel", "device": str(pf.device), "pages": n, "page_kib": pf.page_nbytes // 1024,
              "kernel": str(cfg), "gather_ms": round(g, 4), "scatter_ms": round(s, 4),
              "gather_gbps": round(nbytes / g / 1e6, 1), "scatter_gbps": round(nbytes / s / 1e6, 1), "iters": iters})
        if g + s < best_ms:
            best, best_ms = str(cfg), g + s
    return best


def run_case(pf: Prefill, n: int, num_chunks: int, iters: int, rng: np.random.Generator, kernel: str | None) -> dict:
    p_ids = rng.choice(2 * pf.room, n, replace=False)
    d_ids = rng.choice(POOL_FACTOR * pf.room, n, replace=False)
    if kernel is None and pf.is_cuda and pf.kernel_configs:
        kernel = kernel_sweep(pf, n, pf.kernel_configs, iters, p_ids)
    set_kernel(kernel)
    if kernel is None and pf.is_cuda:  # the module's default
        from kvferry.common.kernels import triton_staging
        kernel = str(triton_staging.CONFIG)
    pf.ask("kernel", kernel)
    pf.ask("room", d_ids.tolist())
    page, nbytes = pf.page_nbytes, n * pf.page_nbytes
    eng = pf.engine
    chunk_pages = math.ceil(n / num_chunks)
    chunks = chunk_plan([page], [n], chunk_pages * page, NUM_BUFFERS)
    steps = pipeline_steps(chunks, NUM_BUFFERS)
    buf_nbytes = chunk_pages * page
    lists = {"direct": (eng.prep_local(pf.page_descs(p_ids), pf.mem),
                        pf.remote([(pf.d_pool + int(p) * page, page, pf.d_index) for p in d_ids]), list(range(n))),
             "write1": (eng.prep_local([(pf.slot.data_ptr(), nbytes, pf.index)], pf.mem),
                        pf.remote([(pf.d_slot, nbytes, pf.d_index)]), [0]),
             "chunks": (eng.prep_local([(pf.buffers.data_ptr() + c.buffer * buf_nbytes, c.nbytes, pf.index)
                                        for c in chunks], pf.mem),
                        pf.remote([(pf.d_slot + c.stream_offset, c.nbytes, pf.d_index) for c in chunks]), None)}
    plan, index = pf.plan(p_ids, pf.slot)
    bufs = [pf.buffers[c.buffer * buf_nbytes: c.buffer * buf_nbytes + c.nbytes] for c in chunks]
    chunk_plans = []
    for c, buf in zip(chunks, bufs):
        part = c.parts[0]  # one segment: each chunk is one part, runs first_run .. + num_runs
        chunk_plans.append(pf.plan(p_ids[part.first_run: part.first_run + part.num_runs], buf))
    events = [torch.cuda.Event() if pf.is_cuda else None for _ in chunks]
    src, dst = pf.pool[:nbytes], pf.slot[:nbytes]

    def write(name):
        local, remote, idx = lists[name]
        return lambda: pf.finish(pf.post(local, remote, idx))

    def gather():
        staging_copy.gather(pf.pool, pf.slot, plan, index)

    def staged():
        gather()
        pf.sync()  # the WRITE reads the slot: the gather must have finished
        write("write1")()
        pf.ask("scatter")

    def pipelined():
        local, remote, _ = lists["chunks"]
        handles = {}
        for step in steps:
            i = step.chunk
            if step.op is StepOp.GATHER:
                if pf.stream is None:
                    staging_copy.gather(pf.pool, bufs[i], *chunk_plans[i])
                else:
                    with torch.cuda.stream(pf.stream):
                        staging_copy.gather(pf.pool, bufs[i], *chunk_plans[i])
                        events[i].record(pf.stream)
            elif step.op is StepOp.WRITE:
                if events[i] is not None:
                    events[i].synchronize()  # the WRITE reads the buffer: its gather must be done
                handles[i] = pf.post(local, remote, [i])
            elif step.op is StepOp.WAIT:
                pf.finish(handles.pop(i))
            else:  # NOTIFY: every chunk has landed; the decode scatters the room
                pf.ask("scatter")

    runs = {"direct": write("direct"), "write1": write("write1"), "gather": gather, "staged": staged,
            "pipelined": pipelined, "memcpy": lambda: dst.copy_(src)}
    child_timed = {"scatter": lambda: pf.ask("scatter")}
    if pf.is_cuda:  # the torch index ops the kernels replace
        runs["gather_torch"] = lambda: staging_copy.gather_reference(pf.pool, pf.slot, plan, index)
        child_timed["scatter_torch"] = lambda: pf.ask("scatter_torch")
    want = checksums(pf.pool, p_ids, page)
    for name in ("direct", "staged", "pipelined"):  # warm-up; each must land the room's bytes on the decode's pages
        pf.ask("clear")
        runs[name]()
        pf.sync()
        if pf.ask("sums") != want:
            raise RuntimeError(f"{name}: the decode pages differ from the prefill's after the WRITE")
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in [*runs, *child_timed]}
    names = list(times)
    for it in range(iters):  # rotate the order each iteration so that drift hits every method alike
        for name in names[it % len(names):] + names[:it % len(names)]:
            times[name].append(child_timed[name]() if name in child_timed else pf.timed(runs[name]))
    for local, remote, _ in lists.values():
        eng.release_prepped(local)
        eng.release_prepped(remote)
    ms = {name: median(t) * 1e3 for name, t in times.items()}

    def ratio(a, b):
        return round(median([x / y for x, y in zip(times[a], times[b])]), 4)

    staged_vs_direct = ratio("direct", "staged")
    return {"pages": n, "bytes": nbytes, **{f"{k}_ms": round(v, 4) for k, v in ms.items()},
            "per_desc_us": round((ms["direct"] - ms["write1"]) / max(n - 1, 1) * 1e3, 3),
            "direct_gbps": round(nbytes / ms["direct"] / 1e6, 3), "write1_gbps": round(nbytes / ms["write1"] / 1e6, 3),
            "memcpy_gbps": round(nbytes / ms["memcpy"] / 1e6, 3), "staged_vs_direct": staged_vs_direct,
            "staging_pays": staged_vs_direct > 1.0, "staged_vs_write1": ratio("write1", "staged"),
            "pipelined_vs_write1": ratio("write1", "pipelined"), "pipelined_vs_direct": ratio("direct", "pipelined"),
            "direct_vs_write1": ratio("write1", "direct"), "chunks": len(chunks), "kernel": kernel,
            "copy_elem_bytes": plan.elem_nbytes, "iters": iters}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", default="256,1024", help="room sizes in pages, comma-separated")
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--chunks", type=int, default=8, help="chunks of the pipelined case")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (UCX copies on one)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (both processes on it)")
    ap.add_argument("--triton-block", default="",
                    help="CUDA: Triton configurations BLOCKxWARPS[xTILES], comma-separated, to sweep per room "
                         "size (the fastest runs the cases); one alone: use it; empty: the module's default")
    args = ap.parse_args()
    sizes = [int(p) for p in args.pages.split(",")]
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    page_nbytes = args.page_kib * 1024
    room = max(sizes)
    chunk_pages = max(math.ceil(n / args.chunks) for n in sizes)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=decode_main, daemon=True,
                        args=(child_conn, POOL_FACTOR * room, room * page_nbytes, page_nbytes, args.device))
    child.start()
    pf = None
    try:
        configs = [c for c in args.triton_block.split(",") if c]
        fixed = configs[0] if len(configs) == 1 else None
        pf = Prefill(conn, room, chunk_pages, page_nbytes, args.device, configs if len(configs) > 1 else [])
        rng = np.random.default_rng(0)
        for n in sizes:
            record = run_case(pf, n, args.chunks, args.iters, rng, fixed)
            emit({"bench": "staging", "device": args.device, "page_kib": args.page_kib, **record,
                  "threads": args.threads, "git": git_hash(), "hw": hardware([args.device])})
    finally:
        if pf is not None:
            pf.engine.close()
        if child.is_alive():
            conn.send(("exit", None))
            child.join(30)


if __name__ == "__main__":
    main()
