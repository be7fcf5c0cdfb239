"""bench/transfer.py --prefill-tp A --decode-tp B [--prefill-page-size P --decode-page-size D]: a prefill
at TP A feeding a decode at TP B (CPU, DRAM over UCX), kvferry's feeds against raw NIXL.

Two processes, as the TP-1 bench: this one holds the A prefill ranks, a spawned child the B decode
ranks (polling every rank's notifications, as each decode rank's poller does). Every rank has its
own ``NixlEngine`` and its own ``KvCache`` pool holding its KV heads (``rank_heads``), Llama-3-8B KV;
rank 0 of each side holds the aux slots. A room of N tokens lies on pages 0.. of both sides.
  kvferry     as ``RankTransport.write_room`` runs a room: ``feed_descs`` for every feed (plus the aux
              record on the (0, 0) feed), then one WRITE per feed, prepared from those descriptors,
              carrying the notification; each prefill rank runs its feeds one after another (rank 0 in
              the calling thread, ranks 1.. on one thread each, as the rank agents' one-thread
              executors), all ranks at once; done when every WRITE is DONE and released. ``descs_ms``
              (the ``feed_descs`` part) is inside ``kvferry_ms`` and also reported apart
  raw         the same bytes per feed as ONE contiguous descriptor (prepared once), from the prefill
              rank's pool into the decode rank's pool (each feed at its own offset), posted the same
              way: NIXL's floor for moving those bytes between those agents
  same_descs  exactly kvferry's descriptors, prepared once ahead: NIXL's floor for that scatter, so
              ratio_vs_same_descs is what planning and preparing per room cost
Ranks are threads of one process here, not processes: the ZeroMQ hop from rank 0 to a rank agent is
not timed. The one warm-up of kvferry and of same_descs is checked on the decode: for every region,
token and KV head, the decode rank holding the head has the prefill's bytes (a hash of the room's
tokens x all heads, each side assembled from its ranks); NIXL's merged descriptor count per feed must
equal ``feed_descs``' row count.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing as mp
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import torch

from bench._common import emit, git_hash, hardware, median
from kvferry.common.wire import messages as wire
from kvferry.common.wire.aux_slots import AuxSlots
from kvferry.common.models.config import ModelConfig
from kvferry.common.cache.kv_cache import KvCache
from kvferry.common.plan.layout import KvLayout
from kvferry.common.plan.tp import rank_heads
from kvferry.common.plan.tp_feed import FeedPlan, build_tp_plan, feed_descs
from kvferry.common.transport.nixl import NixlEngine

MODEL = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
         "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
NUM_KV_HEADS = MODEL["num_key_value_heads"]
AUX_SLOTS = 4
WAIT_S = 60.0


def rank_pool(layers: int, tp: int, rank: int, num_pages: int, page_size: int, layout: str) -> KvCache:
    heads = rank_heads(NUM_KV_HEADS, tp, rank)
    config = ModelConfig.from_dict({**MODEL, "num_hidden_layers": layers})
    return KvCache(config, num_pages, page_size, torch.bfloat16, "cpu", layout=layout,
                   head_start=heads.start, num_kv_heads=heads.count)


def rank_layout(kv: KvCache, tp: int, rank: int, aux: AuxSlots | None) -> KvLayout:
    """Rank 0 holds the aux slots; ranks 1.. register none (as ``DaemonCore.layouts``)."""
    info = aux.info() if aux is not None else wire.AuxInfo(kv.mem, 0, 0, 0, 0)
    return KvLayout(model="llama-3-8b", page_size=kv.page_size, kv_dtype="bfloat16", tp_size=tp, tp_rank=rank,
                    regions=tuple(kv.regions()), aux=info)


def room_digest(pools: list[KvCache], page_ids: list[int], num_tokens: int) -> str:
    """Hash of tokens [0, num_tokens) of every KV head of every region, the heads gathered from the
    ranks in order: the same bytes on both sides whatever their TP, page size or pool layout."""
    h = hashlib.blake2b()
    tensors = [kv.tensors() for kv in pools]
    for r in range(len(tensors[0])):
        parts = []
        for kv, ts in zip(pools, tensors):
            n = math.ceil(num_tokens / kv.page_size)
            t = ts[r][page_ids[:n]]  # [n, page_size, rank heads, head_dim]
            parts.append(t.reshape(n * kv.page_size, kv.num_kv_heads, -1)[:num_tokens])
        h.update(torch.cat(parts, dim=1).contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def decode_main(conn, layers: int, tp: int, num_pages: int, page_size: int, layout: str, num_threads: int) -> None:
    """The decode ranks: a pool and an agent each (aux slots on rank 0); polls every agent's
    notifications until told to exit."""
    torch.set_num_threads(1)
    aux = AuxSlots(AUX_SLOTS)
    engines, pools, infos = [], [], []
    for rank in range(tp):
        engine = NixlEngine(f"bench-decode-tp{rank}", num_threads=num_threads)
        kv = rank_pool(layers, tp, rank, num_pages, page_size, layout)
        engine.register_tensor(kv.buffer)
        if rank == 0:
            engine.register_tensor(aux.buffer)
        engines.append(engine)
        pools.append(kv)
        infos.append((engine.metadata(), rank_layout(kv, tp, rank, aux if rank == 0 else None),
                      kv.buffer.data_ptr(), kv.num_bytes))
    conn.send(infos)
    while True:
        for engine in engines:
            engine.get_notifs()  # each rank's poller drives its target's UCX progress
        if not conn.poll(0):
            time.sleep(0.0002)
            continue
        cmd, arg = conn.recv()
        if cmd == "exit":
            break
        if cmd == "clear":
            for kv in pools:
                kv.buffer.zero_()
            aux.buffer.zero_()
            conn.send(None)
        elif cmd == "digest":
            page_ids, num_tokens = arg
            conn.send((room_digest(pools, page_ids, num_tokens), aux.read(0)))
    for engine in engines:
        engine.close()


class TpPrefill:
    """The A prefill ranks, the plan toward the decode's B ranks, and one thread per rank > 0."""

    def __init__(self, conn, args, num_pages: int) -> None:
        self.conn, self.args, self.tp = conn, args, args.prefill_tp
        self.aux = AuxSlots(AUX_SLOTS)
        self.engines, self.pools = [], []
        for rank in range(self.tp):
            engine = NixlEngine(f"bench-prefill-tp{rank}", num_threads=args.num_threads, capture_telemetry=True)
            kv = rank_pool(args.layers, self.tp, rank, num_pages, args.prefill_page_size, args.kv_layout)
            kv.buffer.view(torch.uint8).random_(0, 256)
            engine.register_tensor(kv.buffer)
            self.engines.append(engine)
            self.pools.append(kv)
        self.engines[0].register_tensor(self.aux.buffer)
        self.aux.buffer.random_(0, 256)
        layouts = [rank_layout(kv, self.tp, r, self.aux if r == 0 else None) for r, kv in enumerate(self.pools)]
        if not conn.poll(120):
            raise TimeoutError("the decode process sent no NIXL metadata within 120 s")
        decode = conn.recv()
        self.decode_bufs = [(addr, nbytes) for _, _, addr, nbytes in decode]
        self.plan = build_tp_plan(layouts, [layout for _, layout, _, _ in decode])
        self.decode_aux = decode[0][1].aux
        self.peers: dict[tuple[int, int], str] = {}
        for feed in self.plan.feeds:  # as RankTransport.connect: each decode rank into each rank feeding it
            key = (feed.prefill_rank, feed.decode_rank)
            self.peers[key] = self.engines[key[0]].add_peer(decode[key[1]][0])
        self.threads = {r: ThreadPoolExecutor(1, thread_name_prefix=f"tp{r}") for r in range(1, self.tp)}

    def close(self) -> None:
        for pool in self.threads.values():
            pool.shutdown(wait=True)
        for engine in self.engines:
            engine.close()

    def ask(self, cmd: str, arg=None):
        self.conn.send((cmd, arg))
        return self.conn.recv()

    # -- descriptors -------------------------------------------------------------------------------
    def descs(self, feed: FeedPlan, num_tokens: int, page_ids: dict[str, list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """``RankTransport._descs``: the feed's descriptors, the aux record last on the (0, 0) feed."""
        src, dst = feed_descs(feed, num_tokens, page_ids["prefill"], page_ids["decode"])
        if feed.prefill_rank == 0 and feed.decode_rank == 0:
            pa, da = self.aux.info(), self.decode_aux
            n = min(pa.item_len, da.item_len)
            src = np.vstack([src, [(pa.addr + 1 * pa.item_len, n, pa.device)]]).astype(np.int64)
            dst = np.vstack([dst, [(da.addr + 0 * da.item_len, n, da.device)]]).astype(np.int64)
        return src, dst

    def raw_lists(self, jobs: list[tuple[FeedPlan, np.ndarray, np.ndarray]]) -> list:
        """Per feed, one contiguous descriptor of the feed's byte count on both sides, prepared once:
        each prefill rank's feeds back to back from its pool's start, each decode rank's likewise."""
        src_off: dict[int, int] = {}
        dst_off: dict[int, int] = {}
        out = []
        for feed, src, _ in jobs:
            p, d, nbytes = feed.prefill_rank, feed.decode_rank, int(src[:, 1].sum())
            s, o = src_off.get(p, 0), dst_off.get(d, 0)
            addr, size = self.decode_bufs[d]
            if s + nbytes > self.pools[p].num_bytes or o + nbytes > size:
                raise RuntimeError(f"raw WRITE of feed {p}->{d}: {nbytes} bytes do not fit the pools")
            engine = self.engines[p]
            local = engine.prep_local([(self.pools[p].buffer.data_ptr() + s, nbytes, 0)], feed.src_mem)
            remote = engine.prep_remote(self.peers[(p, d)], [(addr + o, nbytes, 0)], feed.dst_mem)
            out.append((feed, local, remote, np.zeros(1, dtype=np.int64)))
            src_off[p], dst_off[d] = s + nbytes, o + nbytes
        return out

    def prepped_lists(self, jobs: list[tuple[FeedPlan, np.ndarray, np.ndarray]]) -> list:
        out = []
        for feed, src, dst in jobs:
            engine = self.engines[feed.prefill_rank]
            out.append((feed, engine.prep_local(src, feed.src_mem),
                        engine.prep_remote(self.peers[(feed.prefill_rank, feed.decode_rank)], dst, feed.dst_mem),
                        np.arange(len(src), dtype=np.int64)))
        return out

    def release_lists(self, lists: list) -> None:
        for feed, local, remote, _ in lists:
            self.engines[feed.prefill_rank].release_prepped(local)
            self.engines[feed.prefill_rank].release_prepped(remote)

    # -- WRITEs ------------------------------------------------------------------------------------
    def on_ranks(self, calls: list[tuple[int, object]]) -> None:
        """Run each rank's calls in order on its own thread (rank 0's here), all ranks at once; return
        once every call has ended, raising the first failure."""
        by_rank: dict[int, list] = {}
        for rank, fn in calls:
            by_rank.setdefault(rank, []).append(fn)
        futures = [self.threads[r].submit(lambda fns=fns: [fn() for fn in fns]) for r, fns in by_rank.items() if r]
        errors = []
        try:
            for fn in by_rank.get(0, []):
                fn()
        except BaseException as exc:
            errors.append(exc)
        for f in futures:
            try:
                f.result()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def post(self, feed: FeedPlan, local, remote, idx: np.ndarray, notif: bytes, counts: dict | None) -> None:
        """One WRITE of prepared lists: post, poll to DONE (the daemons' backoff), release."""
        engine = self.engines[feed.prefill_rank]
        handle = engine.post_write(local, idx, remote, idx, notif)
        try:
            engine.wait(handle, WAIT_S)
            if counts is not None:
                counts[(feed.prefill_rank, feed.decode_rank)] = engine.num_descriptors(handle)
        finally:
            engine.release(handle)

    def write_feed(self, feed: FeedPlan, src: np.ndarray, dst: np.ndarray, notif: bytes, counts: dict | None) -> None:
        """``RankTransport._write_local``: prepare the feed's lists, WRITE, release the lists."""
        engine = self.engines[feed.prefill_rank]
        local = engine.prep_local(src, feed.src_mem)
        try:
            remote = engine.prep_remote(self.peers[(feed.prefill_rank, feed.decode_rank)], dst, feed.dst_mem)
            try:
                self.post(feed, local, remote, np.arange(len(src), dtype=np.int64), notif, counts)
            finally:
                engine.release_prepped(remote)
        finally:
            engine.release_prepped(local)

    def kvferry(self, num_tokens: int, page_ids: dict, notif: bytes, counts: dict | None = None
                ) -> tuple[float, float]:
        """One room as ``write_room`` runs it; returns (feed_descs seconds, whole room seconds)."""
        start = time.perf_counter()
        jobs = [(feed, *self.descs(feed, num_tokens, page_ids)) for feed in self.plan.feeds]
        planned = time.perf_counter()
        self.on_ranks([(feed.prefill_rank, partial(self.write_feed, feed, src, dst, notif, counts))
                       for feed, src, dst in jobs])
        return planned - start, time.perf_counter() - start

    def prepped(self, lists: list, notif: bytes, counts: dict | None = None) -> tuple[float, float]:
        start = time.perf_counter()
        self.on_ranks([(feed.prefill_rank, partial(self.post, feed, local, remote, idx, notif, counts))
                       for feed, local, remote, idx in lists])
        return 0.0, time.perf_counter() - start

    # -- one room size -----------------------------------------------------------------------------
    def run(self, num_tokens: int, iters: int) -> dict:
        args = self.args
        page_ids = {"prefill": list(range(math.ceil(num_tokens / args.prefill_page_size))),
                    "decode": list(range(math.ceil(num_tokens / args.decode_page_size)))}
        notif = wire.encode(wire.Notification(room=num_tokens, decode_id="bench", ok=True,
                                              parts=len(self.plan.feeds)))
        jobs = [(feed, *self.descs(feed, num_tokens, page_ids)) for feed in self.plan.feeds]
        lists = {"raw": self.raw_lists(jobs), "same_descs": self.prepped_lists(jobs)}
        runs = {"kvferry": lambda counts=None: self.kvferry(num_tokens, page_ids, notif, counts),
                "raw": lambda counts=None: self.prepped(lists["raw"], notif, counts),
                "same_descs": lambda counts=None: self.prepped(lists["same_descs"], notif, counts)}
        expected = (room_digest(self.pools, page_ids["prefill"], num_tokens), self.aux.read(1))
        for name, fn in runs.items():  # warm-up: the decode must hold the prefill's bytes, head by head
            self.ask("clear")
            counts: dict = {}
            fn(counts)
            for feed, src, _ in jobs:
                want = 1 if name == "raw" else len(src)
                if counts[(feed.prefill_rank, feed.decode_rank)] != want:
                    raise RuntimeError(f"{name}, feed {feed.prefill_rank}->{feed.decode_rank}: NIXL merged into "
                                       f"{counts[(feed.prefill_rank, feed.decode_rank)]} descriptors, "
                                       f"expected {want}")
            if name != "raw" and self.ask("digest", (page_ids["decode"], num_tokens)) != expected:
                raise RuntimeError(f"{name} at {num_tokens} tokens (prefill TP {self.tp}, decode TP "
                                   f"{self.plan.decode_tp}): the decode's KV or aux record differs from the "
                                   f"prefill's after the WRITEs")
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        names = list(runs)
        for it in range(iters):  # rotated each iteration, so that drift hits every method alike
            for name in names[it % len(names):] + names[:it % len(names)]:
                times[name].append(runs[name]())
        for ls in lists.values():
            self.release_lists(ls)
        return self.record(num_tokens, jobs, times)

    def record(self, num_tokens: int, jobs: list, times: dict) -> dict:
        args, plan = self.args, self.plan
        nbytes = int(sum(src[:, 1].sum() for _, src, _ in jobs))
        kv_s, raw_s, same_s = (median([t for _, t in times[k]]) for k in ("kvferry", "raw", "same_descs"))

        def ratio(base: str) -> float:  # median of per-iteration base / kvferry times (kvferry GB/s / base GB/s)
            return round(median([b / k for (_, b), (_, k) in zip(times[base], times["kvferry"])]), 4)

        return {"bench": "transfer_tp", "device": "cpu", "prefill_tp": plan.prefill_tp, "decode_tp": plan.decode_tp,
                "prefill_page_size": args.prefill_page_size, "decode_page_size": args.decode_page_size,
                "kv_layout": args.kv_layout, "decode_kv_layout": args.decode_kv_layout, "tokens": num_tokens,
                "feeds": len(jobs), "feed_ranks": [[f.prefill_rank, f.decode_rank] for f, _, _ in jobs],
                "bytes": nbytes, "bytes_per_feed": [int(src[:, 1].sum()) for _, src, _ in jobs],
                "descriptors": sum(len(src) for _, src, _ in jobs),
                "descriptors_per_feed": [len(src) for _, src, _ in jobs], "raw_descriptors": len(jobs),
                "kvferry_ms": round(kv_s * 1e3, 3), "raw_ms": round(raw_s * 1e3, 3),
                "same_descs_ms": round(same_s * 1e3, 3),
                "descs_ms": round(median([d for d, _ in times["kvferry"]]) * 1e3, 3),
                "kvferry_gbps": round(nbytes / kv_s / 1e9, 3), "raw_nixl_gbps": round(nbytes / raw_s / 1e9, 3),
                "ratio_vs_raw": ratio("raw"), "ratio_vs_same_descs": ratio("same_descs"),
                "feeds_in_daemons": plan.prefill_tp > 1 or plan.decode_tp > 1
                or args.prefill_page_size != args.decode_page_size,
                "iters": len(times["kvferry"]), "layers": args.layers, "num_threads": args.num_threads,
                "git": git_hash(), "hw": hardware(["cpu"])}


def tp_main(args, token_counts: list[int]) -> None:
    """Both sides' ranks up, then one JSON line per room size."""
    max_tokens = max(token_counts)
    mp_ctx = mp.get_context("spawn")
    conn, child_conn = mp_ctx.Pipe()
    decode_pages = math.ceil(max_tokens / args.decode_page_size) + 1  # + 1: room for the raw WRITE's aux bytes
    child = mp_ctx.Process(target=decode_main, daemon=True, args=(
        child_conn, args.layers, args.decode_tp, decode_pages, args.decode_page_size, args.decode_kv_layout,
        args.num_threads))
    child.start()
    prefill = None
    try:
        prefill = TpPrefill(conn, args, math.ceil(max_tokens / args.prefill_page_size) + 1)
        for tokens in token_counts:
            emit(prefill.run(tokens, args.iters))
    finally:
        if prefill is not None:
            prefill.close()
        if child.is_alive():
            conn.send(("exit", None))
            child.join(30)
