"""Staging on CPU (issue 17, item 6): does gather + one WRITE + scatter beat a WRITE of scattered pages?

One room of --pages pages of --page-kib KiB (a page-major pool's page block: a Llama-3-8B 16-token
block is 2 MiB, scaled down here), on random pages of a prefill pool and of a decode pool four times
its size. Two NIXL agents (UCX, DRAM) in this process; the decode agent is polled while a WRITE
runs, as the decode daemon's poller does. Per case, medians of --iters interleaved iterations after
a warm-up whose bytes are checked on the decode side:
  direct   one prepared WRITE of the room's pages as they are: one descriptor per page
  write1   one WRITE of the same bytes as ONE descriptor (prefill slot -> decode slot)
  gather   torch index_select of the room's pages into the prefill slot (staging_copy reference)
  scatter  torch index_copy_ of the decode slot into the room's decode pages
  staged   gather + write1 + scatter, back to back (the CPU path has nothing to overlap them with)
  memcpy   one contiguous torch copy of as many bytes
per_desc_us = (direct - write1) / (pages - 1): NIXL's cost of one more descriptor here.
staged_vs_direct > 1 means staging pays. torch and UCX copy on one thread each (--threads).
--device cuda: both pools and slots on the GPU (VRAM, two agents in this process); gather and
scatter are then the Triton kernels, with the torch index ops beside them (gather_torch_ms,
scatter_torch_ms) and memcpy a device-to-device copy.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, git_hash, hardware, median  # noqa: E402
from common.model import staging_copy  # noqa: E402
from common.plan.staging import copy_plan  # noqa: E402
from common.transport.nixl import NixlEngine, XferState  # noqa: E402

POOL_FACTOR = 4  # decode pages per room page
logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL logs INFO to stdout, where the JSON goes


class Side:
    """One agent with a pool of pages and a staging slot as large as the room, both registered."""

    def __init__(self, name: str, num_pages: int, room_pages: int, page_nbytes: int, device: str) -> None:
        self.engine = NixlEngine(name)
        self.page_nbytes = page_nbytes
        self.device = torch.device(device)
        self.mem = "VRAM" if self.device.type == "cuda" else "DRAM"
        self.index = (self.device.index or 0) if self.device.type == "cuda" else 0
        self.pool = torch.empty(num_pages * page_nbytes, dtype=torch.uint8, device=self.device)
        self.slot = torch.empty(room_pages * page_nbytes, dtype=torch.uint8, device=self.device)
        self.engine.register_tensor(self.pool)
        self.engine.register_tensor(self.slot)

    def page_descs(self, ids: np.ndarray) -> list[tuple[int, int, int]]:
        return [(self.pool.data_ptr() + int(p) * self.page_nbytes, self.page_nbytes, self.index) for p in ids]

    def slot_descs(self, num_pages: int) -> list[tuple[int, int, int]]:
        return [(self.slot.data_ptr(), num_pages * self.page_nbytes, self.index)]

    def plan(self, ids: np.ndarray, num_pages: int):
        plan = copy_plan(self.pool.data_ptr() + ids.astype(np.int64) * self.page_nbytes, self.page_nbytes,
                         self.pool.data_ptr(), self.slot.data_ptr(), self.pool.numel())
        return plan, staging_copy.row_index(plan, self.device), self.slot[: num_pages * self.page_nbytes]


def write(prefill: Side, decode: Side, local, remote, n: int) -> None:
    """One WRITE of ``n`` prepared entries, polled to DONE while the decode agent is polled too."""
    handle = prefill.engine.post_write(local, range(n), remote, range(n), None)
    try:
        while prefill.engine.poll(handle) is not XferState.DONE:
            decode.engine.get_notifs()
    finally:
        prefill.engine.release(handle)


def timed(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def run_case(prefill: Side, decode: Side, n: int, iters: int, rng: np.random.Generator) -> dict:
    p_ids = rng.choice(prefill.pool.numel() // prefill.page_nbytes, n, replace=False)
    d_ids = rng.choice(decode.pool.numel() // decode.page_nbytes, n, replace=False)
    engine = prefill.engine
    peer = engine.add_peer(decode.engine.metadata()) if not engine.peers() else engine.peers()[0]
    lists = {"direct": (engine.prep_local(prefill.page_descs(p_ids), prefill.mem),
                        engine.prep_remote(peer, decode.page_descs(d_ids), decode.mem), n),
             "write1": (engine.prep_local(prefill.slot_descs(n), prefill.mem),
                        engine.prep_remote(peer, decode.slot_descs(n), decode.mem), 1)}
    p_plan, p_index, p_slot = prefill.plan(p_ids, n)
    d_plan, d_index, d_slot = decode.plan(d_ids, n)
    nbytes = n * prefill.page_nbytes
    src, dst = prefill.pool[:nbytes], decode.pool[:nbytes]

    is_cuda = prefill.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(prefill.device)) if is_cuda else (lambda: None)

    def gather():  # the Triton kernel on CUDA, the torch reference on CPU
        staging_copy.gather(prefill.pool, p_slot, p_plan, p_index)

    def scatter():
        staging_copy.scatter(d_slot, decode.pool, d_plan, d_index)

    def write_list(name):
        return lambda: write(prefill, decode, *lists[name])

    def staged():
        gather()
        sync()  # the WRITE reads the slot: the gather must have finished
        write_list("write1")()
        scatter()

    runs = {"direct": write_list("direct"), "write1": write_list("write1"), "gather": gather, "scatter": scatter,
            "staged": staged, "memcpy": lambda: dst.copy_(src)}
    if is_cuda:  # the torch index ops the kernels replace
        runs["gather_torch"] = lambda: staging_copy.gather_reference(prefill.pool, p_slot, p_plan, p_index)
        runs["scatter_torch"] = lambda: staging_copy.scatter_reference(d_slot, decode.pool, d_plan, d_index)
    want = prefill.pool.view(-1, prefill.page_nbytes)[torch.from_numpy(p_ids).to(prefill.device)].clone()
    for name in ("direct", "staged"):  # warm-up; each path must land the room's bytes on the decode's pages
        decode.pool.zero_()
        sync()
        runs[name]()
        sync()
        if not torch.equal(decode.pool.view(-1, decode.page_nbytes)[torch.from_numpy(d_ids).to(decode.device)], want):
            raise RuntimeError(f"{name}: the decode pages differ from the prefill's after the WRITE")
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for it in range(iters):  # rotate the order each iteration so that drift hits every method alike
        for name in names[it % len(names):] + names[:it % len(names)]:
            times[name].append(timed(runs[name], sync))
    for local, remote, _ in lists.values():
        engine.release_prepped(local)
        engine.release_prepped(remote)
    ms = {name: median(t) * 1e3 for name, t in times.items()}
    ratios = median([d / s for d, s in zip(times["direct"], times["staged"])])
    return {"pages": n, "bytes": nbytes, **{f"{k}_ms": round(v, 3) for k, v in ms.items()},
            "per_desc_us": round((ms["direct"] - ms["write1"]) / max(n - 1, 1) * 1e3, 3),
            "direct_gbps": round(nbytes / ms["direct"] / 1e6, 3), "memcpy_gbps": round(nbytes / ms["memcpy"] / 1e6, 3),
            "staged_vs_direct": round(ratios, 4), "staging_pays": ratios > 1.0,
            "copy_elem_bytes": p_plan.elem_nbytes, "iters": iters}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", default="256,1024", help="room sizes in pages, comma-separated")
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (UCX copies on one)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (both sides on it)")
    args = ap.parse_args()
    sizes = [int(p) for p in args.pages.split(",")]
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    page_nbytes = args.page_kib * 1024
    room = max(sizes)
    prefill = Side("bench-staging-prefill", 2 * room, room, page_nbytes, args.device)
    decode = Side("bench-staging-decode", POOL_FACTOR * room, room, page_nbytes, args.device)
    try:
        prefill.pool.random_(0, 256)
        rng = np.random.default_rng(0)
        for n in sizes:
            record = run_case(prefill, decode, n, args.iters, rng)
            emit({"bench": "staging", "device": args.device, "page_kib": args.page_kib, **record,
                  "threads": args.threads, "git": git_hash(), "hw": hardware([args.device])})
    finally:
        prefill.engine.close()
        decode.engine.close()


if __name__ == "__main__":
    main()
