"""The tile tables of ``triton_gemv``'s kernels: which configuration a weight shape and row count
get, measured by ``bench/gemv_tune.py`` (bench/RESULTS.md), and the fit of a configuration's tiles
to a block's shared memory. Plain Python: importable without Triton.

A sweep's own table (``bench/gemv_tune.py --table-out FILE``) can stand in for the rules below
for the exact shapes it measured: ``KVFERRY_GEMV_TILES=FILE`` in the environment, read once.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

GROUP = 128  # block-FP8 group along K
SHARED_MEMORY_BYTES = 232448  # H100/H200: 227 KiB a block (triton_moe fits its tiles to it too)
FIT_HEADROOM_BYTES = 27 * 1024  # fit leaves this for Triton's own scratch: the tiles get 200 KiB


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 3
    split_k: int = 1  # programs along K (the dot path): each writes an fp32 partial, one more launch sums them
    # 1: a one-row program (BLOCK_M 1, no block scales) adds its products per column of a K step over the whole
    # loop and sums the columns once after it, not across its threads every step (``triton_gemv.late_sum``)
    late_sum: int = 0


TABLE_ENV = "KVFERRY_GEMV_TILES"
KINDS = ("bf16", "moe", "fp8", "fp8_x")  # gemv, a MoE slot's expert, fp8_gemv weight-only, fp8_gemv W8A8
_table: dict | None = None  # (kind, rows, n, k) -> GemvConfig; None: not read yet


def table_key(kind: str, rows: int, n: int, k: int) -> tuple[str, int, int, int]:
    """The key of a table entry: bf16 and moe entries are one row (a MoE slot) whatever ``rows``."""
    return kind, 1 if kind in ("bf16", "moe") else rows, n, k


def read_table(path: str) -> dict:
    """A tile table file: ``{"entries": [{"kind", "rows", "n", "k", "config": [block_n, block_k,
    num_warps, num_stages, split_k(, late_sum)]}, ...]}`` (late_sum 0 or 1, 0 where left out, as
    tables written before it). A file that is not that raises ValueError naming it."""
    try:
        with open(path) as f:
            entries = json.load(f)["entries"]
        table = {}
        for e in entries:
            if e["kind"] not in KINDS:
                raise ValueError(f"kind {e['kind']!r} is not one of {KINDS}")
            values = [int(v) for v in e["config"]]
            if len(values) not in (5, 6) or min(values[:5]) < 1 or values[5:] not in ([], [0], [1]):
                raise ValueError(f"config {e['config']} is not 5 positive integers and a late_sum of 0 or 1")
            cfg = GemvConfig(*values)
            table[table_key(e["kind"], int(e["rows"]), int(e["n"]), int(e["k"]))] = cfg
        return table
    except (OSError, KeyError, TypeError, json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"{TABLE_ENV}={path}: not a tile table ({type(e).__name__}: {e})") from e


def from_table(kind: str, rows: int, n: int, k: int) -> GemvConfig | None:
    """The table's configuration for this shape (``KVFERRY_GEMV_TILES``), None where it has none."""
    global _table
    if _table is None:
        path = os.environ.get(TABLE_ENV, "")
        _table = read_table(path) if path else {}
    return _table.get(table_key(kind, rows, n, k)) if _table else None


def fp8_config(num_rows: int, n: int, k: int, block: int | None, fp8_x: bool = False) -> GemvConfig:
    """The tile configuration for an FP8 weight [n, k] times ``num_rows`` rows: bench/gemv_tune.py's
    H100 sweeps (bench/RESULTS.md). One row: 1,024 columns a step over 8 weight rows, 4 warps (deep
    down, narrow o); else 512 columns, 8 warps, over 16 rows (q/k/v) or 32 (gate-up). Several rows
    share each weight tile through tl.dot, 128 columns a step (256 for 17 to 32 rows with per-row
    scales), 3 stages, K split over 4 programs (8 for the deep down past 16 rows) unless the weight
    is wide enough (gate-up) to give every SM programs of its own; 32 weight rows a program up to 16
    rows, 64 past (128 for gate-up). An e4m3 x (``fp8_x``, W8A8): 64 weight rows, 256 columns a
    step, K in 2 parts for a narrow (o, down) or deep weight, else whole; 4 stages but for a wide
    gate-up (the sweep with the weights read from HBM, tree ddbf030, H100, 64 rows: q/k/v 12.6 ->
    11.5 µs, o 10.2 -> 9.6, down 26.6 -> 25.3 with K in 2 parts where it had 4). One row with per-row
    scales sums late (``late_sum``) but for a weight past 8,192 rows (each kernel alone on an H100,
    tree e6bd70c: down 23.0 -> 21.8 µs, q/k/v 11.0 -> 10.5; the wide gate-up 41 -> 43.5, 64 running
    sums a thread). A table entry for the shape (per-row scales only) wins."""
    if block is None and (cfg := from_table("fp8_x" if fp8_x else "fp8", num_rows, n, k)) is not None:
        return cfg
    if fp8_x:
        return GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=3 if n > 8192 else 4,
                          split_k=2 if n <= 4096 or k > 8192 else 1)
    if num_rows == 1:
        late = int(block is None and n <= 8192)
        if k >= 8192 or n <= 4096:
            return GemvConfig(block_n=8, block_k=1024, num_warps=4, late_sum=late)
        return GemvConfig(block_n=32 if n > 8192 else 16, block_k=512, num_warps=8, late_sum=late)
    wide = n > 8192
    split = 1 if wide else 8 if k > 8192 and num_rows > 16 else 4
    block_k = 256 if 16 < num_rows <= 32 and block is None else GROUP
    block_n = 32 if num_rows <= 16 else 128 if wide else 64
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=4, num_stages=3, split_k=split)


def takes_rows(num_rows: int, n: int) -> bool:
    """Whether the weight-only ``fp8_gemv`` beats what it replaces for ``num_rows`` rows of an [n, .]
    block-scaled weight (the W8A8 block GEMM) or per-row-scaled one (torch._scaled_mm after the
    activation quant), as the H100 sweep measured: 1.3-3.0x up to 16 rows; past 16 only for the
    narrower weights (gate-up at 32 and 64 rows and q/k/v at 64 measured 0.72-1.0x)."""
    return num_rows <= 16 or (num_rows <= 32 and n <= 8192) or (num_rows <= 64 and n <= 4096)


def fit(cfg: GemvConfig, block_m: int, x_bytes: int, block_k: int) -> tuple[GemvConfig, int]:
    """Fewer stages, then a shallower K step, until the pipelined x and weight tiles and the weight
    tile converted to x's dtype fit a block's shared memory (float32 x at 128 rows would not)."""
    def need(stages: int, bk: int) -> int:
        return stages * (block_m * x_bytes + cfg.block_n) * bk + cfg.block_n * bk * x_bytes

    stages = cfg.num_stages
    while need(stages, block_k) > SHARED_MEMORY_BYTES - FIT_HEADROOM_BYTES:
        if stages > 2:
            stages -= 1
        elif block_k > 32:
            block_k //= 2
        else:
            break
    return cfg._replace(num_stages=stages), block_k


class Tiles(NamedTuple):
    """What ``fp8_gemv`` launches a configuration with (``fitted_tiles``)."""

    config: GemvConfig  # its stages fitted to shared memory
    block_m: int
    block_k: int
    k_per: int  # the K columns a part takes: whole BLOCK_K steps (whole 128-column groups)
    parts: int  # K parts (1: K whole)


def fitted_tiles(cfg: GemvConfig, num_rows: int, k: int, x_bytes: int, block: int | None = None) -> Tiles:
    """``cfg`` as ``fp8_gemv`` runs it for ``num_rows`` rows of ``x_bytes`` over a K-deep weight (block
    scales of ``block`` columns or per-row): one row a program for one row, else BLOCK_M rows (16 up to a
    power of two) sharing each weight tile through tl.dot, over ``fit``'s stages and K step (one 128-column
    group a step for block scales); K split in ``cfg.split_k`` parts of whole steps at most."""
    block_m = 1 if num_rows == 1 else max(16, 1 << (num_rows - 1).bit_length())
    block_k = cfg.block_k if block_m == 1 or block is None else GROUP  # tl.dot over block scales: one group a step
    if block_m > 1:
        cfg, fitted = fit(cfg, block_m, x_bytes, block_k)
        block_k = fitted if block is None else block_k
    split = 1 if block_m == 1 else max(1, min(cfg.split_k, -(-k // block_k)))
    k_per = -(-(-(-k // split)) // block_k) * block_k
    return Tiles(cfg, block_m, block_k, k_per, -(-k // k_per))


def dense_config(n: int, k: int) -> GemvConfig:
    """One row times a bf16/fp16 weight [n, k] (``gemv``), from the sweep with the weights read from
    HBM (tree ddbf030, H100): 1,024 columns a step, 8 warps, over 8 weight rows, or 4 past 4,096
    rows, with 4 stages past 8,192 (Qwen3-30B-A3B's q/k/v 9.5 -> 8.6 µs, DeepSeek-V2-Lite's dense
    gate-up 32.5 -> 30.2 against the hot sweep's tiles). Summed late (``late_sum``) up to 2,048 rows:
    the routers and o_proj (each kernel alone on an H100, tree e6bd70c: DeepSeek's router 6.2 -> 4.0
    µs, its o_proj 5.8 -> 4.6, Qwen3's o_proj 7.9 -> 7.6), not the wider q/k/v (Qwen3 9.1 -> 9.7,
    DeepSeek 6.9 -> 7.5). A table entry for the shape wins."""
    if (cfg := from_table("bf16", 1, n, k)) is not None:
        return cfg
    if n > 4096:
        return GemvConfig(block_n=4, block_k=1024, num_warps=8, num_stages=4 if n > 8192 else 3)
    return GemvConfig(block_n=8, block_k=1024, num_warps=8, late_sum=int(n <= 2048))


def moe_config(n: int, k: int, silu: bool = False) -> GemvConfig:
    """The tile configuration of one MoE slot's [n, k] expert weight (bf16/fp16): in the sweep no
    configuration beat this one by more than a few per cent on either preset's projections. The
    gate-up sums late (``late_sum``), not the down projection, which makes silu(gate) * up as it
    reads (``silu``; each kernel alone on an H100, tree e6bd70c: DeepSeek-V2-Lite's gate-up 35.6 ->
    31.9 µs, Qwen3-30B-A3B's 19.0 -> 18.8; the downs 17.3 -> 20.5 and 9.9 -> 11.7). A table entry for
    the shape wins."""
    if (cfg := from_table("moe", 1, n, k)) is not None:
        return cfg
    return GemvConfig(block_n=16 if n <= 4096 else 32, block_k=256, num_warps=4, late_sum=int(not silu))
