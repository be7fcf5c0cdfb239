"""KV transfer bandwidth: kvferry's WRITE path against one raw NIXL WRITE and a memcpy of the same bytes.

Two processes: this one is the prefill (NIXL initiator), a spawned child the decode (the target, which
polls notifications as the decode daemon does). Llama-3-8B KV: 32 layers, 8 KV heads, head_dim 128,
bf16, 16-token pages, laid out as in common/model/kv_cache.py; the decode pool holds 4x the prompt's
pages, so "fragmented" scatters the prompt over random decode pages. Per (layout, tokens): medians of
--iters interleaved iterations after one warm-up whose bytes are checked on the decode; ratio_vs_raw
is the median of per-iteration ratios (raw and kvferry timed back to back), which cancels drift.
  raw_nixl  one WRITE, one descriptor per region, contiguous on both sides: NIXL's best case
  kvferry   request_indices, then one prepared WRITE per group, notification on the last (as KvSender);
            aux slots sit beside the KV as in the daemons, so that is one WRITE of KV pages + aux record
  memcpy    one torch copy of the same bytes in this process, single-threaded like the UCX copy
CUDA (--device cuda, or --prefill-device cuda:0 --decode-device cuda:1) is written but untested.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import multiprocessing as mp
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, git_hash, hardware, median  # noqa: E402
from common import geometry, wire  # noqa: E402
from common.aux import AuxSlots  # noqa: E402
from common.geometry import KvLayout  # noqa: E402
from common.transport.nixl import NixlEngine  # noqa: E402
from common.wire import Region  # noqa: E402

PAGE_SIZE, KV_HEADS, HEAD_DIM = 16, 8, 128
POOL_FACTOR = 4  # decode pages per prompt page
logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL logs INFO to stdout, where the JSON goes


def kv_pool(num_layers: int, num_pages: int, device: str) -> torch.Tensor:
    # pool: [layer, 2 (k, v), page, page_size, kv_heads, head_dim]
    return torch.zeros(num_layers, 2, num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)


def kv_layout(pool: torch.Tensor, aux: AuxSlots) -> KvLayout:
    mem, device = ("DRAM", 0) if pool.device.type == "cpu" else ("VRAM", pool.device.index or 0)
    regions = tuple(Region(model="target", layer=layer, kind=kind, mem=mem, device=device,
                           addr=pool[layer, i].data_ptr(), item_len=pool[0, 0, 0].nbytes,
                           num_pages=pool.shape[2], head_start=0, num_heads=KV_HEADS)
                    for layer in range(pool.shape[0]) for i, kind in enumerate("kv"))
    return KvLayout(model="llama-3-8b", page_size=PAGE_SIZE, kv_dtype="bfloat16", tp_size=1, tp_rank=0,
                    regions=regions, aux=aux.info())


def digest(pool: torch.Tensor, page_ids: list[int]) -> str:
    return hashlib.blake2b(pool[:, :, page_ids].cpu().contiguous().view(torch.uint8).numpy()).hexdigest()


def decode_main(conn, num_layers: int, num_pages: int, device: str, num_threads: int) -> None:
    """The decode process: register a pool and aux slots, send metadata, poll until told to exit."""
    torch.set_num_threads(1)
    engine = NixlEngine("bench-decode", num_threads=num_threads)
    pool, aux = kv_pool(num_layers, num_pages, device), AuxSlots(4, device=device)  # aux beside the KV, as the daemons
    engine.register_tensor(pool)
    engine.register_tensor(aux.buffer)
    conn.send((engine.metadata(), kv_layout(pool, aux)))
    while True:
        engine.get_notifs()  # as the decode daemon's poller: this drives the target's UCX progress
        if not conn.poll(0):
            time.sleep(0.0002)
            continue
        cmd, page_ids = conn.recv()
        if cmd == "exit":
            break
        if cmd == "clear":
            pool.zero_()
        conn.send(digest(pool, page_ids) if cmd == "digest" else None)
    engine.close()


def write(engine: NixlEngine, local, local_idx, remote, remote_idx, notif: bytes | None) -> None:
    """KvSender._write for one group: post, poll to DONE with the same backoff, release."""
    handle = engine.post_write(local, local_idx, remote, remote_idx, notif)
    try:
        engine.wait(handle, 60.0, poll_interval_s=5e-4)
    finally:
        engine.release(handle)


class Prefill:
    """The initiator: the prefill pool, the plan toward the decode process, its prepared lists."""

    def __init__(self, engine: NixlEngine, conn, num_layers: int, num_pages: int, devices: list[str]) -> None:
        self.engine, self.conn, self.devices = engine, conn, devices
        # both stay registered for the whole run; aux beside the KV, as the daemons place it
        self.pool, self.aux = kv_pool(num_layers, num_pages, devices[0]), AuxSlots(4, device=devices[0])
        self.pool.view(torch.uint8).random_(0, 256)
        engine.register_tensor(self.pool)
        engine.register_tensor(self.aux.buffer)
        if not conn.poll(120):
            raise TimeoutError("the decode process sent no NIXL metadata within 120 s")
        metadata, decode_layout = conn.recv()
        self.peer = engine.add_peer(metadata)
        self.plan = geometry.build_plan(kv_layout(self.pool, self.aux), decode_layout, peer=self.peer)
        self.descs = [(g.prefill_descs(), g.decode_descs()) for g in self.plan.groups]
        self.prepped = [(engine.prep_local(p, g.prefill_mem), engine.prep_remote(self.peer, d, g.decode_mem))
                        for g, (p, d) in zip(self.plan.groups, self.descs)]
        # a WRITE is complete at DONE; the sync only fences the device-to-device memcpy
        is_cuda = self.pool.is_cuda
        self.sync = (lambda: torch.cuda.synchronize(self.pool.device)) if is_cuda else (lambda: None)

    def ask(self, cmd: str, page_ids: list[int] | None = None):
        self.conn.send((cmd, page_ids))
        return self.conn.recv()

    def timed(self, fn) -> tuple[float, float]:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return 0.0, time.perf_counter() - start

    def kvferry_write(self, prefill_ids: list[int], decode_ids: list[int], notif: bytes) -> tuple[float, float]:
        """One room as KvSender sends it; returns (index-building seconds, total seconds)."""
        start = time.perf_counter()
        xfer = geometry.request_indices(self.plan, prefill_page_ids=prefill_ids, decode_page_ids=decode_ids,
                                        prefill_aux_slot=0, decode_aux_slot=0)
        indexed = time.perf_counter()
        for g, ((local, remote), (local_idx, remote_idx)) in enumerate(zip(self.prepped, xfer.per_group)):
            write(self.engine, local, local_idx, remote, remote_idx, notif if g == len(self.prepped) - 1 else None)
        return indexed - start, time.perf_counter() - start

    def run(self, tokens: int, iters: int, rng: random.Random) -> tuple[dict, dict]:
        """Warm up and check each method, then time ``iters`` rotations; returns (page ids, times) by name."""
        n = math.ceil(tokens / PAGE_SIZE)
        prefill_ids = list(range(n))
        pairs = [pair for g in self.plan.groups for pair in g.pairs]
        # raw: one descriptor per region over the first n pages on both sides
        raw = (self.engine.prep_local([(p.addr, n * p.item_len, p.device) for p, _ in pairs], pairs[0][0].mem),
               self.engine.prep_remote(self.peer, [(d.addr, n * d.item_len, d.device) for _, d in pairs],
                                       pairs[0][1].mem))
        raw_idx = list(range(len(pairs)))
        notif = wire.encode(wire.Notification(room=tokens, decode_id="bench", ok=True))
        src, dst = self.pool[:, :, :n], torch.empty_like(self.pool[:, :, :n])
        fragmented = rng.sample(range(self.plan.num_decode_pages), n)
        ids = {"raw": prefill_ids, "contiguous": prefill_ids, "fragmented": fragmented}
        runs = {"raw": lambda: self.timed(lambda: write(self.engine, raw[0], raw_idx, raw[1], raw_idx, notif)),
                "contiguous": lambda: self.kvferry_write(prefill_ids, ids["contiguous"], notif),
                "fragmented": lambda: self.kvferry_write(prefill_ids, ids["fragmented"], notif),
                "memcpy": lambda: self.timed(lambda: dst.copy_(src))}
        expected = digest(self.pool, prefill_ids)
        for name, fn in runs.items():  # warm-up; each WRITE must land exactly where the plan says
            self.ask("clear")
            fn()
            if name != "memcpy" and self.ask("digest", ids[name]) != expected:
                raise RuntimeError(f"{name} at {tokens} tokens: decode pages differ from the prefill's after the WRITE")
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        names = list(runs)
        for it in range(iters):  # rotate the order each iteration so that drift hits every method alike
            for name in names[it % len(names):] + names[:it % len(names)]:
                times[name].append(runs[name]())
        for p in raw:
            self.engine.release_prepped(p)
        return ids, times

    def report(self, tokens: int, ids: dict, times: dict) -> None:
        n = math.ceil(tokens / PAGE_SIZE)
        nbytes = n * sum(p.item_len for g in self.plan.groups for p, _ in g.pairs)
        raw_s, memcpy_s = (median([t for _, t in times[k]]) for k in ("raw", "memcpy"))
        device = self.devices[0] if len(set(self.devices)) == 1 else "->".join(self.devices)
        for layout in ("contiguous", "fragmented"):
            xfer = geometry.request_indices(self.plan, prefill_page_ids=list(range(n)), decode_page_ids=ids[layout],
                                            prefill_aux_slot=0, decode_aux_slot=0)
            num_descs = sum(geometry.count_merged_descs([p[i] for i in p_idx], [d[i] for i in d_idx])
                            for (p, d), (p_idx, d_idx) in zip(self.descs, xfer.per_group))
            kv_s = median([t for _, t in times[layout]])
            ratio = median([raw_t / kv_t for (_, raw_t), (_, kv_t) in zip(times["raw"], times[layout])])
            emit({"bench": "transfer", "device": device, "layout": layout, "tokens": tokens, "bytes": nbytes,
                  "descriptors": num_descs, "raw_nixl_gbps": round(nbytes / raw_s / 1e9, 3),
                  "kvferry_gbps": round(nbytes / kv_s / 1e9, 3), "memcpy_gbps": round(nbytes / memcpy_s / 1e9, 3),
                  "ratio_vs_raw": round(ratio, 4), "kvferry_ms": round(kv_s * 1e3, 3),
                  "raw_ms": round(raw_s * 1e3, 3), "index_ms": round(median([i for i, _ in times[layout]]) * 1e3, 3),
                  "iters": len(times[layout]), "layers": self.pool.shape[0], "git": git_hash(),
                  "hw": hardware(self.devices)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1024", help="prompt lengths, comma-separated")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--prefill-device", help="default: cpu, or cuda:0 with --device cuda")
    ap.add_argument("--decode-device", help="default: the prefill device")
    ap.add_argument("--num-threads", type=int, default=0, help="NIXL UCX backend threads")
    args = ap.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    prefill_dev = args.prefill_device or ("cpu" if args.device == "cpu" else "cuda:0")
    decode_dev = args.decode_device or prefill_dev
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the memcpy ceiling uses one thread, as the UCX copy does
    max_pages = max(math.ceil(t / PAGE_SIZE) for t in token_counts)
    mp_ctx = mp.get_context("spawn")
    conn, child_conn = mp_ctx.Pipe()
    child = mp_ctx.Process(target=decode_main, daemon=True, args=(
        child_conn, args.layers, POOL_FACTOR * max_pages, decode_dev, args.num_threads))
    child.start()
    engine = NixlEngine("bench-prefill", num_threads=args.num_threads)
    try:
        prefill = Prefill(engine, conn, args.layers, max_pages, [prefill_dev, decode_dev])
        rng = random.Random(0)
        for tokens in token_counts:
            prefill.report(tokens, *prefill.run(tokens, args.iters, rng))
    finally:
        engine.close()
        if child.is_alive():
            conn.send(("exit", None))
            child.join(30)


if __name__ == "__main__":
    main()
