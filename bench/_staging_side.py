"""bench/staging.py's two sides: a pool of pages and a staging slot registered with one NIXL agent
(``Side``), the decode process's loop (``decode_main``: its pool, slot, agent and scatter, driven
over a Pipe as bench/transfer.py drives its decode), and the page checksums both compare."""

from __future__ import annotations

import time

import numpy as np
import torch

from kvferry.common.kernels import staging_copy
from kvferry.common.plan.staging import CopyPlan, copy_plan
from kvferry.common.transport.nixl import NixlEngine


class Side:
    """One agent with a pool of pages and a staging slot, both registered (DRAM or VRAM)."""

    def __init__(self, name: str, num_pages: int, slot_nbytes: int, page_nbytes: int, device: str) -> None:
        self.engine = NixlEngine(name)
        self.page_nbytes = page_nbytes
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.mem = "VRAM" if self.is_cuda else "DRAM"
        self.index = (self.device.index or 0) if self.is_cuda else 0
        self.pool = torch.empty(num_pages * page_nbytes, dtype=torch.uint8, device=self.device)
        self.slot = torch.empty(slot_nbytes, dtype=torch.uint8, device=self.device)
        self.engine.register_tensor(self.pool)
        self.engine.register_tensor(self.slot)

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def page_descs(self, ids: np.ndarray) -> list[tuple[int, int, int]]:
        return [(self.pool.data_ptr() + int(p) * self.page_nbytes, self.page_nbytes, self.index) for p in ids]

    def plan(self, ids: np.ndarray, staging: torch.Tensor) -> tuple[CopyPlan, torch.Tensor]:
        """The copy plan and row index of pages ``ids`` of the pool, to or from ``staging``."""
        plan = copy_plan(self.pool.data_ptr() + np.asarray(ids, dtype=np.int64) * self.page_nbytes,
                         self.page_nbytes, self.pool.data_ptr(), staging.data_ptr(), self.pool.numel())
        return plan, staging_copy.row_index(plan, self.device)


def checksums(pool: torch.Tensor, ids, page_nbytes: int) -> list[list[int]]:
    """Per page of ``ids`` (in order): the sum of its 8-byte words and their position-weighted sum
    (wrapping int64): a page in the wrong place or bytes moved inside it change them."""
    rows = pool.view(torch.int64).view(-1, page_nbytes // 8)
    weights = torch.arange(1, rows.shape[1] + 1, dtype=torch.int64, device=pool.device)
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=pool.device)
    out = []
    for part in ids.split(32):
        x = rows[part]
        out.append(torch.stack([x.sum(1), (x * weights).sum(1)], 1))
    return torch.cat(out).cpu().tolist()


def set_kernel(config: str | None) -> None:
    """Make ``config`` (``BLOCKxWARPS[xTILES]``) the Triton kernels' default in this process."""
    if config:
        from kvferry.common.kernels import triton_staging
        triton_staging.CONFIG = triton_staging.KernelConfig.parse(config)


def decode_main(conn, num_pages: int, slot_nbytes: int, page_nbytes: int, device: str) -> None:
    """The decode process: register a pool and a slot, send their addresses and the metadata, then
    serve commands while polling notifications (the poll drives the target's UCX progress):
      room ids       plan the scatter of the slot into pages ``ids``
      clear          zero the pool
      sums           checksums of the room's pages
      scatter        the room's scatter (the kernel on CUDA); replies its own seconds
      scatter_torch  the torch reference (index_copy_); replies its own seconds
      kernel cfg     set the Triton kernels' configuration
    A failure is replied as ("error", text) and ends the loop."""
    torch.set_num_threads(1)
    side = Side("bench-staging-decode", num_pages, slot_nbytes, page_nbytes, device)
    conn.send((side.engine.metadata(), side.pool.data_ptr(), side.slot.data_ptr(), side.index, side.mem))
    ids = plan = index = None
    try:
        while True:
            side.engine.get_notifs()
            if not conn.poll(2e-4):  # wakes as soon as a command arrives
                continue
            cmd, arg = conn.recv()
            if cmd == "exit":
                break
            reply = None
            if cmd == "room":
                ids = np.asarray(arg, dtype=np.int64)
                plan, index = side.plan(ids, side.slot)
            elif cmd == "clear":
                side.pool.zero_()
                side.sync()
            elif cmd == "sums":
                reply = checksums(side.pool, ids, page_nbytes)
            elif cmd in ("scatter", "scatter_torch"):
                fn = staging_copy.scatter if cmd == "scatter" else staging_copy.scatter_reference
                side.sync()
                start = time.perf_counter()
                fn(side.slot, side.pool, plan, index)
                side.sync()
                reply = time.perf_counter() - start
            elif cmd == "kernel":
                set_kernel(arg)
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(reply)
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        side.engine.close()
