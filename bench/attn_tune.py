"""The decode attention's split kernel (``common/kernels/triton_attention.py``) over its tiles and
split counts, beside the current default, in CUDA graphs.

    python bench/attn_tune.py [--batches 1,8,64,128] [--contexts 1024,8192] [--iters 20]

One JSON line per (batch, context) (with ``by_splits``: the fastest tiles of every split count
and fewest keys a split): Llama-3.1-8B's attention shape (32 query heads, 8 KV heads,
head dim 128), bf16 pages of 16 tokens spread at random over a page-major pool. Each line: the
fastest (tiles, splits) and its µs and GB/s (the K and V bytes the step reads, over the time),
the default's, and both as fractions of the HBM bandwidth of a 4 GiB device copy measured in the
same run. Every configuration's output is checked against the default's before it is timed. Each
captured call reads the next of enough copies of the pool that together they are three times L2
(``gemv_tune.copies_of``; ``--hot``: every call rereads one copy, which a batch-1 layer's few MB of
K and V are read from L2, not from HBM as in a step).
``--dry-run`` (with TRITON_INTERPRET=1) runs tiny shapes on CPU: the logic, not the times.
``--mla``: the MLA decode kernel (``common/kernels/triton_mla.py``) instead, DeepSeek-V2-Lite's
shape (16 heads over one latent row of 512 + 64 per token), the same tiles and split counts.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import bench.gemv_tune as gemv_tune  # noqa: E402
from bench._common import emit, git_hash, hardware  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def case(batch: int, context: int, device: str, dtype, seed: int = 0):
    """q, a one-layer page-major pool [pages, 2, Hkv, PAGE, D] (``kv_views``), the page table and the lengths."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // PAGE)
    num_pages = batch * per_seq + 8
    pool = torch.randn(num_pages, 2, KV_HEADS, PAGE, HEAD_DIM, generator=gen).to(dtype).to(device)
    table = torch.randperm(num_pages, generator=gen)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype).to(device)
    lens = torch.full((batch,), context, dtype=torch.int32)
    return q, pool, table.to(device), lens.to(device)


def kv_views(pool: torch.Tensor):
    """The K and V views [page, token, head, D] of a ``case`` pool."""
    return pool[:, 0].permute(0, 2, 1, 3), pool[:, 1].permute(0, 2, 1, 3)


MLA_HEADS, LATENT, ROPE = 16, 512, 64


def mla_case(batch: int, context: int, device: str, dtype, seed: int = 0):
    """q [B, 16, 576], one layer's latent cache [pages, PAGE, 576], the page table and the lengths."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // PAGE)
    num_pages = batch * per_seq + 8
    cache = torch.randn(num_pages, PAGE, LATENT + ROPE, generator=gen).to(dtype).to(device)
    table = torch.randperm(num_pages, generator=gen)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    q = torch.randn(batch, MLA_HEADS, LATENT + ROPE, generator=gen).to(dtype).to(device)
    return q, cache, table.to(device), torch.full((batch,), context, dtype=torch.int32).to(device)


def configs(quick: bool, mla: bool = False):
    from kvferry.common.kernels.triton_attention import DecodeTiles

    if mla:  # the [16, 512] fp32 accumulator and a [keys, 512] latent tile share the registers
        ns, warps, stages, mins = ((16, 32), (4,), (2,), (0, 64)) if quick else ((16, 32, 64), (4, 8), (1, 2, 3),
                                                                                (0, 64, 128, 256))
    else:
        ns, warps, stages, mins = ((32, 64), (4,), (2,), (0, 64)) if quick else ((32, 64, 128), (4, 8), (2, 3, 4),
                                                                                (0, 256))
    return [DecodeTiles(n, w, s, m) for n, w, s, m in itertools.product(ns, warps, stages, mins)]


def main() -> None:
    from kvferry.common.kernels import triton_attention as ta

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,64,128")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--splits", default="1,2,4,8,16,32", help="split counts tried beside the default's")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="a few tiles only")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1 (set it)")
    ap.add_argument("--mla", action="store_true", help="the MLA decode kernel (DeepSeek-V2-Lite's latent rows)")
    ap.add_argument("--hot", action="store_true",
                    help="every captured call rereads one pool (out of L2 when it fits there), not the next of copies "
                         "worth 3x L2")
    args = ap.parse_args()
    gemv_tune.COLD = not args.hot
    device, dtype = "cuda", torch.bfloat16
    if args.dry_run:
        device, dtype, args.quick, args.iters = "cpu", torch.float16, True, 1
        args.batches, args.contexts, args.splits = "2", "40", "1,2"
        gemv_tune.DEVICE = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("bench/attn_tune.py times CUDA kernels; no CUDA device here")
    num_sms = 132 if args.dry_run else torch.cuda.get_device_properties(0).multi_processor_count
    hbm = gemv_tune.hbm_gbps()
    base = {"bench": "attn_tune", "git": git_hash(), "hardware": hardware([device if device == "cpu" else "cuda:0"]),
            "hbm_gbps": round(hbm, 1), "page_size": PAGE, "l2": "hot" if args.hot else "cold",
            **({"kernel": "mla", "heads": [MLA_HEADS, LATENT, ROPE]} if args.mla else
               {"heads": [HEADS, KV_HEADS, HEAD_DIM]})}
    scale = HEAD_DIM ** -0.5
    for batch, context in itertools.product(map(int, args.batches.split(",")), map(int, args.contexts.split(","))):
        if args.mla:
            from kvferry.common.kernels import triton_mla

            q, cache, table, lens = mla_case(batch, context, device, dtype)
            nbytes = batch * context * (LATENT + ROPE) * q.element_size()
            default_splits = ta.num_decode_splits(batch, 1, num_sms)
            caches = gemv_tune.copies_of(cache, cache.numel() * cache.element_size())

            def run(tiles, splits):
                return triton_mla.decode_attention(q, caches(), table, lens, LATENT, scale, splits, tiles)

            default = (triton_mla.decode_tiles(default_splits), default_splits)
        else:
            q, pool, table, lens = case(batch, context, device, dtype)
            nbytes = 2 * batch * context * KV_HEADS * HEAD_DIM * q.element_size()
            default_splits = ta.num_decode_splits(batch, KV_HEADS, num_sms)
            pools = gemv_tune.copies_of(pool, pool.numel() * pool.element_size())

            def run(tiles, splits):
                return ta.decode_attention(q, *kv_views(pools()), table, lens, scale, None, splits, tiles=tiles)

            default = (ta.decode_tiles(HEAD_DIM, default_splits), default_splits)
        want = run(*default)
        best, by_splits = None, {}
        for tiles, splits in itertools.product(configs(args.quick, args.mla), sorted({default_splits, *map(int, args.splits.split(","))})):
            try:
                got = run(tiles, splits)
            except Exception as e:  # a tile the compiler refuses (shared memory, registers)
                print(f"skip {tiles} x{splits}: {type(e).__name__}: {e}"[:200], file=sys.stderr)
                continue
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            us = gemv_tune.timed_us(lambda: run(tiles, splits), args.iters)
            if best is None or us < best[2]:
                best = (tiles, splits, us)
            key = f"{splits}/{tiles.min_split}"  # the fastest tiles of each split count and fewest keys a split
            if key not in by_splits or us < by_splits[key][-1]:
                by_splits[key] = [tiles.block_n, tiles.num_warps, tiles.num_stages, round(us, 2)]
        default_us = gemv_tune.timed_us(lambda: run(*default), args.iters)

        def frac(us: float) -> float:
            return round(nbytes / us / 1e3 / hbm, 3) if hbm else 0.0

        emit({**base, "batch": batch, "context": context, "bytes": nbytes,
              "best": {**best[0]._asdict(), "splits": best[1]}, "best_us": round(best[2], 2),
              "best_of_copy": frac(best[2]),
              "default": {**default[0]._asdict(), "splits": default[1]}, "default_us": round(default_us, 2),
              "default_of_copy": frac(default_us), "speedup": round(default_us / best[2], 3),
              "by_splits": by_splits, "by_splits_key": "splits/min_split: [block_n, warps, stages, us]"})


if __name__ == "__main__":
    main()
