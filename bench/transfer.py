"""KV transfer bandwidth: kvferry's WRITE path against the best raw NIXL WRITE and a memcpy of the same bytes.

Two processes: this one is the prefill (NIXL initiator), a spawned child the decode (the target, which
polls notifications as the decode daemon does). Llama-3-8B KV: 32 layers, 8 KV heads, head_dim 128,
bf16, 16-token pages, in real ``KvCache`` pools (--kv-layout for both sides, --decode-kv-layout to
pair two layouts); the decode pool holds 4x the prompt's pages, so "fragmented" scatters the prompt
over random decode pages. Per (layout, tokens): medians of --iters interleaved iterations after one
warm-up whose bytes are checked on the decode; ratio_vs_raw is the median of per-iteration ratios
(raw and kvferry timed back to back), which cancels drift.
--cache-form mla: DeepSeek-V3's MLA cache instead (the form layout.cache_form calls "mla"): ``LatentCache``
pools on both sides, 61 layers (--layers overrides), one latent row of kv_lora_rank + qk_rope_head_dim =
512 + 64 bf16 values per token and layer (1,152 bytes; 70,272 per token over 61 layers against the Llama's
131,072), one LATENT_KIND region per layer at the same 16-token pages. The plan is build_plan over the two
region tables as the prefill's Registrar builds it for a latent room (at TP 1 and equal page sizes a latent
region pairs by key like a K or V region), so every method below moves the latent pages unchanged, staged
included (the daemons stage MLA rooms with the same StagingSender); the latent pool is bf16 only (the
daemons refuse an FP8 one), and the TP feeds below are dense only. Every line names its cache_form ("kv"
or "mla") and bytes_per_token (the room's bytes per token over all layers, from the plan's regions).
  raw_nixl  one WRITE of the prompt's KV on pages 0..n-1 of both sides in the fewest descriptors any
            NIXL WRITE can use for those bytes (the maximal runs contiguous on both sides): one per
            region layer-major, ONE for the whole prompt page-major, one per page per region mixed
  kvferry   one prepared WRITE per group from the room's index lists, notification on the last (as
            KvWriter, which builds the lists when the decode's request arrives, during the forward:
            index_ms, reported apart); aux slots sit beside the KV as in the daemons, so that is one
            WRITE of KV pages + aux record. Decode pages: contiguous (0..n-1), fragmented (random over
            the pool) or churned (what the decode's PageAllocator gives after 400 random rooms)
  *_nixl    raw NIXL with exactly the runs kvferry's scattered room merges into, prepared as they
            are: NIXL's own floor for that scatter (ratio_vs_same_descs)
  staged    the room as the daemons stage it (bench/_staged_transfer.py: StagingSender, StagingReceiver):
            pipelined gathers into two --staging-chunk-bytes buffers, one WRITE per chunk into the
            decode's staging slot (as large as the largest room), the aux record with the notification
            last, then the decode's scatter into its pages, timed in the decode process. staged_ms =
            the prefill's write (to the aux record's DONE) + that scatter; staged_e2e_ms adds the Pipe
            round trip that stands in for the notification (no other line waits for one).
            ratio_staged_vs_raw = raw / staged per iteration (the issue's goal: >= 0.8 on random pages),
            ratio_staged_vs_direct = kvferry / staged; chooser / chooser_reason: what the prefill
            daemon would do with the room (plan_room, its crossover from costs measured at start-up
            as --staging-crossover-runs -1 does, or that flag), staged_beats_direct: what this run saw
            (staged_ms against kvferry_ms, the direct WRITE), model_direct_ms / model_staged_ms: the
            chooser's model of both paths from those costs (per_desc_us, per_write_us, copy_ns_per_byte)
  memcpy    one contiguous torch copy of as many bytes in this process, single-threaded like UCX's
CUDA: --device cuda, or --prefill-device cuda:0 --decode-device cuda:1.
Tensor parallelism (CPU): --prefill-tp A --decode-tp B, optionally --prefill-page-size/--decode-page-size:
A prefill ranks feed B decode ranks, one WRITE per feed as RankTransport posts them, against one
contiguous WRITE of the same bytes per feed (bench/_tp_transfer.py; one JSON line per room size).
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
from kvferry.common.wire import messages as wire
from kvferry.common.plan import geometry  # noqa: E402
from kvferry.common.wire.aux_slots import AuxSlots  # noqa: E402
from kvferry.common.plan.layout import KvLayout, cache_form  # noqa: E402
from kvferry.common.models.config import ModelConfig  # noqa: E402
from kvferry.common.cache.kv_cache import KV_LAYOUTS, KvCache, PageAllocator  # noqa: E402
from kvferry.common.cache.mla_cache import LatentCache  # noqa: E402
from kvferry.common.transport.nixl import NixlEngine  # noqa: E402
from bench._staged_transfer import DecodeStaging, PrefillStaging  # noqa: E402

PAGE_SIZE = 16  # the daemons' --page-size default, for both cache forms
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
# DeepSeek-V3's config.json, as much of it as ModelConfig reads: the cache needs only kv_lora_rank +
# qk_rope_head_dim (one 576-element latent row per token and layer), the rest makes it a valid checkpoint config
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
               "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 128,
               "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
               "moe_intermediate_size": 2048, "n_shared_experts": 1, "first_k_dense_replace": 3, "moe_layer_freq": 1,
               "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
               "norm_topk_prob": True, "scoring_func": "sigmoid"}
# per cache form (the names of layout.cache_form): the model's config, its fingerprint in the layouts, its layers
FORMS = {"kv": (LLAMA3_8B, "llama-3-8b", 32), "mla": (DEEPSEEK_V3, "deepseek-v3", 61)}
POOL_FACTOR = 4  # decode pages per prompt page
LAYOUTS = ("contiguous", "fragmented", "churned")  # where the decode's pages are
logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL logs INFO to stdout, where the JSON goes


def kv_pool(num_layers: int, num_pages: int, device: str, layout: str, dtype: str = "bfloat16",
            form: str = "kv") -> KvCache | LatentCache:
    """The pool a daemon serving this form's model builds: ``KvCache`` (K and V per layer) or
    ``LatentCache`` (one MLA latent per layer, what DeepseekModel.make_kv_cache returns)."""
    base, _, _ = FORMS[form]
    config = ModelConfig.from_dict({**base, "num_hidden_layers": num_layers})
    cls = LatentCache if form == "mla" else KvCache
    return cls(config, num_pages, PAGE_SIZE, getattr(torch, dtype), device, layout=layout)


def kv_layout(kv: KvCache | LatentCache, aux: AuxSlots) -> KvLayout:
    model = FORMS["mla" if isinstance(kv, LatentCache) else "kv"][1]
    return KvLayout(model=model, page_size=PAGE_SIZE, kv_dtype=kv.kv_dtype, tp_size=1, tp_rank=0,
                    regions=tuple(kv.regions()), aux=aux.info())


def digest(kv: KvCache | LatentCache, page_ids: list[int]) -> str:
    """Hash of the pages' regions (K/V, or the latent) region by region, the same bytes whatever the pool's layout."""
    pages = torch.stack([t[page_ids] for t in kv.tensors()])  # [regions, pages, page_size, (heads,) dim]
    return hashlib.blake2b(pages.cpu().contiguous().view(torch.uint8).numpy()).hexdigest()


def decode_main(conn, num_layers: int, num_pages: int, device: str, num_threads: int, layout: str,
                kv_dtype: str = "bfloat16", form: str = "kv") -> None:
    """The decode process: register a pool, aux slots and a staging slot as large as the largest room,
    send metadata, poll until told to exit."""
    torch.set_num_threads(1)
    engine = NixlEngine("bench-decode", num_threads=num_threads)
    pool = kv_pool(num_layers, num_pages, device, layout, kv_dtype, form)
    aux = AuxSlots(4, device=device)  # aux beside the KV
    engine.register_tensor(pool.buffer)
    engine.register_tensor(aux.buffer)
    staging = DecodeStaging(engine, pool.buffer, pool.buffer.numel() * pool.buffer.element_size() // POOL_FACTOR)
    conn.send((engine.metadata(), kv_layout(pool, aux), staging.info()))
    while True:
        engine.get_notifs()  # as the decode daemon's poller: this drives the target's UCX progress
        if not conn.poll(0):
            time.sleep(0.0002)
            continue
        cmd, page_ids = conn.recv()
        if cmd == "exit":
            break
        if cmd == "runs":  # the stream's runs, as RegisterAck.staging_runs (page_ids carries them)
            staging.runs = page_ids
        if cmd == "scatter":  # a staged room has landed in the slot: scatter it into these pages
            conn.send(staging.scatter(page_ids))
            continue
        if cmd == "clear":
            pool.buffer.zero_()
            if pool.buffer.is_cuda:  # the kernel is asynchronous: finish it before the next WRITE lands
                torch.cuda.synchronize(pool.buffer.device)
        conn.send(digest(pool, page_ids) if cmd == "digest" else None)
    engine.close()


def churned_pages(num_pages: int, n: int, rng: random.Random, steps: int = 400) -> list[int]:
    """The pages a decode's own allocator gives an n-page room after ``steps`` rooms of 1..n pages
    came and went at random (the pool kept at most three quarters full)."""
    alloc, live = PageAllocator(num_pages), []
    for _ in range(steps):
        size = rng.randint(1, n)
        if live and (rng.random() < 0.5 or alloc.num_free - size < num_pages // 4):
            alloc.free(live.pop(rng.randrange(len(live))))
        elif alloc.num_free - size >= num_pages // 4:
            live.append(alloc.allocate(size))
    while not alloc.can_allocate(n):
        alloc.free(live.pop(rng.randrange(len(live))))
    return alloc.allocate(n)


def ratio(raw: list[tuple[float, ...]], kvferry: list[tuple[float, ...]]) -> float:
    """Median of per-iteration raw / kvferry times (element 1 of each; timed back to back: drift cancels)."""
    return median([r[1] / k[1] for r, k in zip(raw, kvferry)])


def write(engine: NixlEngine, local, local_idx, remote, remote_idx, notif: bytes | None, counts: list) -> None:
    """KvWriter._write for one group: post, poll to DONE with the same backoff, release. Appends the
    descriptors NIXL reports after merging to ``counts`` (the engine captures telemetry)."""
    handle = engine.post_write(local, local_idx, remote, remote_idx, notif)
    try:
        engine.wait(handle, 60.0, poll_interval_s=5e-4)
        counts.append(engine.num_descriptors(handle))
    finally:
        engine.release(handle)


class Prefill:
    """The initiator: the prefill pool, the plan toward the decode process, its prepared lists."""

    def __init__(self, engine: NixlEngine, conn, args, num_pages: int, devices: list[str]) -> None:
        self.engine, self.conn, self.devices = engine, conn, devices
        # both stay registered for the whole run; aux beside the KV, as the daemons place it
        self.kv = kv_pool(args.layers, num_pages, devices[0], args.kv_layout, args.kv_dtype, args.cache_form)
        self.aux = AuxSlots(4, device=devices[0])
        self.kv.buffer.view(torch.uint8).random_(0, 256)
        engine.register_tensor(self.kv.buffer)
        engine.register_tensor(self.aux.buffer)
        if not conn.poll(120):
            raise TimeoutError("the decode process sent no NIXL metadata within 120 s")
        metadata, decode_layout, staging_info = conn.recv()
        self.peer = engine.add_peer(metadata)
        layout = kv_layout(self.kv, self.aux)
        self.plan = geometry.build_plan(layout, decode_layout, peer=self.peer)  # as the prefill's Registrar does
        self.cache_form = cache_form(layout, "target", "prefill")  # what the plan saw: "kv" or "mla"
        self.descs = [(g.prefill_descs(), g.decode_descs()) for g in self.plan.groups]
        self.prepped = [(engine.prep_local(p, g.prefill_mem), engine.prep_remote(self.peer, d, g.decode_mem))
                        for g, (p, d) in zip(self.plan.groups, self.descs)]
        # a WRITE is complete at DONE; the sync only fences the device-to-device memcpy
        is_cuda = self.kv.buffer.is_cuda
        self.sync = (lambda: torch.cuda.synchronize(self.kv.device)) if is_cuda else (lambda: None)
        self.staging = PrefillStaging(self, args.staging_chunk_bytes, args.staging_crossover_runs, staging_info)

    def ask(self, cmd: str, page_ids: list[int] | None = None):
        self.conn.send((cmd, page_ids))
        return self.conn.recv()

    def timed(self, fn) -> tuple[float, float]:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return 0.0, time.perf_counter() - start

    def kvferry_write(self, prefill_ids: list[int], decode_ids: list[int], notif: bytes, counts: list
                      ) -> tuple[float, float]:
        """One room as KvWriter sends it; returns (index-building seconds, WRITE seconds). KvWriter
        builds the index lists when the decode's request arrives, while the forward runs; the WRITE
        path starts from them: the aux slot, then the WRITE."""
        start = time.perf_counter()
        xfer = geometry.request_indices(self.plan, prefill_page_ids=prefill_ids, decode_page_ids=decode_ids,
                                        prefill_aux_slot=0, decode_aux_slot=0)
        indexed = time.perf_counter()
        self.sync()
        started = time.perf_counter()
        xfer = xfer.with_prefill_aux_slot(self.plan, 1)
        for g, ((local, remote), (local_idx, remote_idx)) in enumerate(zip(self.prepped, xfer.per_group)):
            write(self.engine, local, local_idx, remote, remote_idx,
                  notif if g == len(self.prepped) - 1 else None, counts)
        return indexed - start, time.perf_counter() - started

    def selected(self, xfer: geometry.RequestXfer, with_aux: bool) -> list[tuple[list, list]]:
        """Per group, the (prefill, decode) descriptors the room's index lists select, in list order."""
        out = []
        for grp, (p, d), (p_idx, d_idx) in zip(self.plan.groups, self.descs, xfer.per_group):
            keep = len(p_idx) - (grp.has_aux and not with_aux)
            out.append(([p[i] for i in p_idx[:keep]], [d[i] for i in d_idx[:keep]]))
        return out

    def raw_lists(self, prefill_ids: list[int], decode_ids: list[int]):
        """The prompt's KV on these pages of both sides as the fewest descriptors any WRITE can use:
        the maximal runs that are contiguous on both sides (kvferry's own merge of that room)."""
        xfer = geometry.request_indices(self.plan, prefill_page_ids=prefill_ids, decode_page_ids=decode_ids,
                                        prefill_aux_slot=0, decode_aux_slot=0)
        runs = [geometry.merge_runs(p, d) for p, d in self.selected(xfer, with_aux=False)]
        p_runs, d_runs = [r for p, _ in runs for r in p], [r for _, d in runs for r in d]
        group = self.plan.groups[0]
        return (self.engine.prep_local(p_runs, group.prefill_mem),
                self.engine.prep_remote(self.peer, d_runs, group.decode_mem), list(range(len(p_runs))))

    def run(self, tokens: int, iters: int, rng: random.Random) -> tuple[dict, dict, dict]:
        """Warm up and check each method, then time ``iters`` rotations; returns page ids, times and the
        descriptor counts NIXL reported, by method name."""
        n = math.ceil(tokens / PAGE_SIZE)
        prefill_ids = list(range(n))
        notif = wire.encode(wire.Notification(room=tokens, decode_id="bench", ok=True))
        nbytes = n * sum(p.item_len for g in self.plan.groups for p, _ in g.pairs)
        src = self.kv.buffer.view(torch.uint8).flatten()[:nbytes]
        dst = torch.empty_like(src)
        ids = {"raw": prefill_ids, "contiguous": prefill_ids,
               "fragmented": rng.sample(range(self.plan.num_decode_pages), n),
               "churned": churned_pages(self.plan.num_decode_pages, n, rng)}
        lists = {name: self.raw_lists(prefill_ids, ids[name]) for name in ("raw", "fragmented", "churned")}
        ids |= {f"{name}_nixl": ids[name] for name in LAYOUTS[1:]}
        counts: dict[str, list[int]] = {name: [] for name in ids}

        def raw(name: str, key: str):
            local, remote, idx = lists[name]
            return lambda: self.timed(lambda: write(self.engine, local, idx, remote, idx, notif, counts[key]))

        def kvferry(name: str):
            return lambda: self.kvferry_write(prefill_ids, ids[name], notif, counts[name])

        runs = {"raw": raw("raw", "raw"), "memcpy": lambda: self.timed(lambda: dst.copy_(src))}
        runs |= {name: kvferry(name) for name in LAYOUTS}
        runs |= {f"{name}_nixl": raw(name, f"{name}_nixl") for name in LAYOUTS[1:]}
        for name in LAYOUTS:  # the same rooms through the staging slots
            ids[f"staged_{name}"] = ids[name]
            runs[f"staged_{name}"] = (lambda name=name: self.staging.write(tokens, prefill_ids, ids[name], notif))
        expected = digest(self.kv, prefill_ids)
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
        for local, remote, _ in lists.values():
            self.engine.release_prepped(local)
            self.engine.release_prepped(remote)
        return ids, times, {name: sum(c[:len(self.plan.groups)]) for name, c in counts.items()}

    def staged_fields(self, tokens: int, ids: dict, times: dict, layout: str) -> dict:
        """The staged line's figures for one decode page pattern (bench/_staged_transfer.py)."""
        n = math.ceil(tokens / PAGE_SIZE)
        t = times[f"staged_{layout}"]
        ms = {key: round(median([x[i] for x in t]) * 1e3, 3)
              for i, key in enumerate(("staged_plan_ms", "staged_ms", "staged_write_ms", "staged_scatter_ms",
                                       "staged_e2e_ms"))}
        dec = self.staging.decision(list(range(n)), ids[layout])
        costs = self.staging.costs
        nbytes = n * sum(p.item_len for g in self.plan.groups for p, _ in g.pairs)
        kv_ms = median([x for _, x in times[layout]]) * 1e3
        return ms | {
            "staged_gbps": round(nbytes / ms["staged_ms"] / 1e6, 3),
            "ratio_staged_vs_raw": round(ratio(times["raw"], t), 4),
            "ratio_staged_vs_direct": round(ratio(times[layout], t), 4),
            "staged_beats_direct": ms["staged_ms"] < kv_ms, "staged_chunks": dec.chunks,
            "staging_chunk_bytes": self.staging.chunk_nbytes, "runs": dec.runs, "crossover_runs": dec.crossover,
            "chooser": dec.path, "chooser_reason": dec.reason,
            "model_direct_ms": dec.model_direct_ms, "model_staged_ms": dec.model_staged_ms,
            "per_write_us": round(costs.per_write_s * 1e6, 2) if costs else None,
            "per_desc_us": round(costs.per_descriptor_s * 1e6, 3) if costs else None,
            "copy_ns_per_byte": round(costs.copy_s_per_byte * 1e9, 4) if costs else None}

    def report(self, tokens: int, ids: dict, times: dict, nixl_counts: dict, args) -> None:
        n = math.ceil(tokens / PAGE_SIZE)
        nbytes = n * sum(p.item_len for g in self.plan.groups for p, _ in g.pairs)
        raw_s, memcpy_s = (median([t for _, t in times[k]]) for k in ("raw", "memcpy"))
        device = self.devices[0] if len(set(self.devices)) == 1 else "->".join(self.devices)
        for layout in LAYOUTS:
            xfer = geometry.request_indices(self.plan, prefill_page_ids=list(range(n)), decode_page_ids=ids[layout],
                                            prefill_aux_slot=0, decode_aux_slot=0)
            num_descs = sum(geometry.count_merged_descs(p, d) for p, d in self.selected(xfer, with_aux=True))
            if num_descs != nixl_counts[layout]:
                raise RuntimeError(f"{layout}: NIXL merged into {nixl_counts[layout]} descriptors, "
                                   f"count_merged_descs says {num_descs}")
            kv_s = median([t for _, t in times[layout]])
            record = {"bench": "transfer", "device": device, "layout": layout, "kv_layout": args.kv_layout,
                      "decode_kv_layout": args.decode_kv_layout, "kv_dtype": args.kv_dtype, "tokens": tokens,
                      "bytes": nbytes, "cache_form": self.cache_form,
                      "bytes_per_token": sum(p.item_len for g in self.plan.groups for p, _ in g.pairs) // PAGE_SIZE,
                      "descriptors": num_descs, "raw_descriptors": nixl_counts["raw"],
                      "raw_nixl_gbps": round(nbytes / raw_s / 1e9, 3),
                      "kvferry_gbps": round(nbytes / kv_s / 1e9, 3),
                      "memcpy_gbps": round(nbytes / memcpy_s / 1e9, 3),
                      "ratio_vs_raw": round(ratio(times["raw"], times[layout]), 4), "kvferry_ms": round(kv_s * 1e3, 3),
                      "raw_ms": round(raw_s * 1e3, 3),
                      "index_ms": round(median([i for i, _ in times[layout]]) * 1e3, 3)}
            if layout != "contiguous":  # NIXL's own floor for this scatter: the same runs, prepared as they are
                same = times[f"{layout}_nixl"]
                record |= {"nixl_same_descs_ms": round(median([t for _, t in same]) * 1e3, 3),
                           "ratio_vs_same_descs": round(ratio(same, times[layout]), 4)}
            record |= self.staged_fields(tokens, ids, times, layout)
            emit(record | {"iters": len(times[layout]), "layers": args.layers, "num_threads": args.num_threads,
                           "git": git_hash(), "hw": hardware(self.devices)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1024", help="prompt lengths, comma-separated")
    ap.add_argument("--cache-form", choices=tuple(FORMS), default="kv",
                    help="kv: Llama-3-8B K and V per layer (KvCache); mla: DeepSeek-V3's one latent row per layer "
                         "(LatentCache, 576 bf16 values per token)")
    ap.add_argument("--layers", type=int, help="default: the form's model (32 for kv, 61 for mla)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--prefill-device", help="default: cpu, or cuda:0 with --device cuda")
    ap.add_argument("--decode-device", help="default: the prefill device")
    ap.add_argument("--kv-layout", choices=KV_LAYOUTS, default="page-major", help="KV pool layout of both sides")
    ap.add_argument("--decode-kv-layout", choices=KV_LAYOUTS, help="the decode's layout (default: --kv-layout)")
    ap.add_argument("--num-threads", type=int, default=0, help="NIXL UCX backend threads")
    ap.add_argument("--kv-dtype", choices=("bfloat16", "float8_e4m3fn"), default="bfloat16",
                    help="both pools' dtype (float8_e4m3fn: an FP8 room, half the bytes of bf16's)")
    ap.add_argument("--staging-chunk-bytes", type=int, default=32 << 20,
                    help="staged line: one WRITE of a staged room (the prefill daemon's default)")
    ap.add_argument("--staging-crossover-runs", type=int, default=-1,
                    help="staged line's chooser: -1 = from costs measured at start-up (the daemon's default), "
                         "N = stage at N descriptors, 0 = never (every room is staged for the measurement)")
    tp = ap.add_argument_group("tensor parallelism (any of these runs bench/_tp_transfer.py: TP feeds, CPU)")
    tp.add_argument("--prefill-tp", type=int, help="prefill TP ranks (default 1)")
    tp.add_argument("--decode-tp", type=int, help="decode TP ranks (default 1)")
    tp.add_argument("--prefill-page-size", type=int, help=f"tokens per prefill page (default {PAGE_SIZE})")
    tp.add_argument("--decode-page-size", type=int, help=f"tokens per decode page (default {PAGE_SIZE})")
    args = ap.parse_args()
    args.decode_kv_layout = args.decode_kv_layout or args.kv_layout
    args.layers = FORMS[args.cache_form][2] if args.layers is None else args.layers
    if args.layers <= 0:
        ap.error(f"--layers must be > 0, got {args.layers}")
    if args.cache_form == "mla" and args.kv_dtype != "bfloat16":  # DeepseekModel.make_kv_cache refuses it too
        ap.error("--cache-form mla: the daemons keep an MLA latent pool in the model dtype only (bfloat16); "
                 "an FP8 latent room does not exist to measure")
    token_counts = [int(t) for t in args.tokens.split(",")]
    tp_flags = ("prefill_tp", "decode_tp", "prefill_page_size", "decode_page_size")
    if any(getattr(args, name) is not None for name in tp_flags):
        if args.device != "cpu" or args.prefill_device or args.decode_device:
            ap.error("--prefill-tp/--decode-tp/--*-page-size run on CPU only")
        if args.cache_form != "kv":
            ap.error("--prefill-tp/--decode-tp/--*-page-size measure dense K/V feeds only (bench/_tp_transfer.py); "
                     "drop --cache-form mla")
        for name, default in zip(tp_flags, (1, 1, PAGE_SIZE, PAGE_SIZE)):
            setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
            if getattr(args, name) <= 0:
                ap.error(f"--{name.replace('_', '-')} must be > 0")
        from bench._tp_transfer import tp_main

        torch.manual_seed(0)
        torch.set_num_threads(1)
        tp_main(args, token_counts)
        return
    prefill_dev = args.prefill_device or ("cpu" if args.device == "cpu" else "cuda:0")
    decode_dev = args.decode_device or prefill_dev
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the memcpy ceiling uses one thread, as the UCX copy does
    max_pages = max(math.ceil(t / PAGE_SIZE) for t in token_counts)
    mp_ctx = mp.get_context("spawn")
    conn, child_conn = mp_ctx.Pipe()
    child = mp_ctx.Process(target=decode_main, daemon=True, args=(
        child_conn, args.layers, POOL_FACTOR * max_pages, decode_dev, args.num_threads, args.decode_kv_layout,
        args.kv_dtype, args.cache_form))
    child.start()
    engine = NixlEngine("bench-prefill", num_threads=args.num_threads, capture_telemetry=True)
    try:
        prefill = Prefill(engine, conn, args, max_pages, [prefill_dev, decode_dev])
        rng = random.Random(0)
        for tokens in token_counts:
            prefill.report(tokens, *prefill.run(tokens, args.iters, rng), args)
    finally:
        engine.close()
        if child.is_alive():
            conn.send(("exit", None))
            child.join(30)


if __name__ == "__main__":
    main()
