"""Weight-streaming GEMMs for decode-sized row counts: FP8 linears and the fused MoE's experts.

A decode step multiplies a few rows by every weight once, so it is bound by the bytes of the
weights, and what matters is streaming them at the HBM rate with nothing else in the way:

- ``fp8_gemv``: x [M, K] (M <= ``FP8_GEMV_MAX_ROWS``) times an e4m3 weight [N, K] with fp32 scales
  (one per row, or row-expanded 128 x 128 block scales [N, ceil(K/128)]), dequantised in
  registers: weight-only (W8A16). No activation quantisation, so no quant kernel before each
  linear, and a torch._scaled_mm that cuBLASLt does not run at the HBM rate for M = 1..16 is
  avoided (bench/RESULTS.md "FP8 on one H200": the FP8 step at batch 1 was 5.7 ms against bf16's
  5.0 with half the bytes). Prefill-sized M stays W8A8 (``common/layers/fp8.py``).
- ``gemv``: one row times a bf16/fp16 weight, the same kernel without scales (``use_gemv`` in
  the Triton backend; bench/engine.py measures it against cuBLAS).
- ``moe_gemv``: the fused MoE for a few token slots (T * k <= ``MOE_GEMV_MAX_SLOTS``): one
  program row per slot reads its expert's weights directly by ``topk_ids``, so there is no sort
  by expert (``align_by_expert``: about fifteen small launches per sparse layer) and no padding of
  each expert's rows to a tensor-core tile. The down projection reads silu(gate) * up straight
  from the gate-up rows and weights each slot in fp32. A batch whose tokens share experts reads a
  shared expert once per slot instead of once: at T * k <= 32 that costs less than the sort.

Programs: axis 0 over BLOCK_N output columns, axis 1 over row blocks (BLOCK_M rows of x; a MoE
slot each). With BLOCK_M 1 each program is a dot product of x's row with BLOCK_N weight rows on
the CUDA cores (``tl.sum``); with BLOCK_M >= 16 the rows share each weight tile through
``tl.dot``. Block scales are applied per 128-column group before the group's sum is added.
Which tiles a shape gets: ``gemv_tiles.py``.

The torch references: ``fp8.reference_weight_only``, F.linear and ``moe.fused_moe_ref``
(``tests/gpu/test_triton_gemv.py``; TRITON_INTERPRET=1 runs the same tests on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvferry.common.kernels.pdl import enter as pdl_enter, enter_prefetching as pdl_enter_prefetching
from kvferry.common.kernels.pdl import kw as pdl_kw, prefetching as pdl_prefetching
from kvferry.common.kernels.split_sum import counters as sum_counters, last_of, sum_in_order
from kvferry.common.kernels.split_sum import slot_sum, sum_parts
from kvferry.common.kernels.quant_rows import SplitParts
from kvferry.common.kernels.triton_fused import silu_times_up
from kvferry.common.kernels.gemv_tiles import (FIT_HEADROOM_BYTES, GROUP, SHARED_MEMORY_BYTES, GemvConfig,  # noqa: F401
                                                dense_config, fitted_tiles, fp8_config, moe_config, takes_rows)

FP8_GEMV_MAX_ROWS = 128  # the most rows fp8_gemv takes; fp8.FP8_GEMV_MAX_ROWS says how many fp8_linear sends here
MOE_GEMV_MAX_SLOTS = 32

SCALE_NONE, SCALE_ROW, SCALE_BLOCK = 0, 1, 2


@triton.jit
def _gemv_kernel(x, w, scale, out, bias, experts, slot_weights, x_scale, final, extra, counts,
                 M, N, K, K_PER, stride_xm, stride_we, stride_wn, stride_om, stride_os, stride_sn,
                 TOP_K: tl.constexpr, SCALE: tl.constexpr, GROUP: tl.constexpr, HAS_EXPERTS: tl.constexpr,
                 FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, X_SCALE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 SUM: tl.constexpr = 0, SLOTS: tl.constexpr = 1, HAS_EXTRA: tl.constexpr = 0,
                 PDL: tl.constexpr = 0, PREFETCH: tl.constexpr = 0, LINE: tl.constexpr = 128,
                 LATE_SUM: tl.constexpr = 0):
    """out[r, n] = sum_k act(x)[row(r), k] * w[expert(r), n, k] * scale (+ bias) (* slot weight).

    Rows r: BLOCK_M consecutive rows of x (dense), or one MoE slot per program (HAS_EXPERTS,
    BLOCK_M 1): x row slot // TOP_K, expert experts[slot]. FUSE_SILU: x holds [gate | up] per row
    (2K wide) and the row read is silu(gate) * up, rounded to x's dtype as ``silu_mul`` rounds.
    X_SCALE: x is e4m3 with a scale per row (``x_scale`` [M]); the dot then runs on FP8 tensor cores.
    Axis 2 splits K into K_PER-wide parts (a multiple of BLOCK_K): part p writes its fp32 sum
    (scaled, no bias) at out + p * stride_os. The parts are added in part order by a launch of their
    own (``split_sum.sum_parts``), or, with SUM 1, by the last program of each output tile to finish,
    + bias, into ``final`` [M, N] (``split_sum.last_of``, counts in ``counts``). SUM 2: out holds a
    MoE token's SLOTS consecutive slot rows, and the last of a token's slot programs for a column
    block adds them in slot order into final [M / SLOTS, N], rounded, + extra (HAS_EXTRA) rounded.
    SLOTS is the count of parts either way (the split for SUM 1: the grid's axis 2).
    PDL order 2: the first PREFETCH BLOCK_K steps of the program's weight rows are asked of L2 (LINE
    elements a line) before the wait; not for MoE slots, whose expert a kernel before chose.
    LATE_SUM (one row, no block scales): the products add up per column of a K step over the whole
    loop, and the columns are summed once after it, instead of a sum across the program's threads
    every step (``late_sum``)."""
    if HAS_EXPERTS:
        pdl_enter(PDL)
    else:
        pdl_enter_prefetching(PDL, w, stride_wn, N, K, K_PER, BLOCK_N, BLOCK_K, PREFETCH, LINE)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    if HAS_EXPERTS:
        expert = tl.load(experts + pid_m).to(tl.int64)
        w_base = w + expert * stride_we
        out_rows = pid_m + tl.arange(0, BLOCK_M)
        x_rows = (out_rows // TOP_K).to(tl.int64)
    else:
        w_base = w
        out_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        x_rows = out_rows.to(tl.int64)
    row_ok = out_rows < M
    w_rows = w_base + cols[:, None] * stride_wn  # [BLOCK_N, 1]
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        wide = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # LATE_SUM's running sums (unused otherwise)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER
    for k0 in range(k_start, tl.minimum(K, k_start + K_PER), BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x_ptrs = x + x_rows[:, None] * stride_xm + k[None, :]  # [BLOCK_M, BLOCK_K]
        x_mask = row_ok[:, None] & k_ok[None, :]
        if FUSE_SILU:
            xv = silu_times_up(x_ptrs, x_mask, K)
        else:
            xv = tl.load(x_ptrs, mask=x_mask, other=0.0)
        wv = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if BLOCK_M == 1:
            prod = wv.to(tl.float32) * tl.reshape(xv, (BLOCK_K,)).to(tl.float32)[None, :]
            if SCALE == 2:
                # per 128-column group: the group's sum times its scale
                grouped = tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // GROUP, GROUP)), 2)
                g_idx = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
                s = tl.load(scale + cols[:, None] * stride_sn + g_idx[None, :],
                            mask=col_ok[:, None] & (g_idx[None, :] * GROUP < K), other=0.0)
                acc += tl.sum(grouped * s, 1)
            elif LATE_SUM:
                wide += prod
            else:
                acc += tl.sum(prod, 1)
        else:
            part = tl.dot(xv, tl.trans(wv.to(xv.dtype)), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
            if SCALE == 2:  # BLOCK_K == GROUP: one scale per column per step
                s = tl.load(scale + cols * stride_sn + k0 // GROUP, mask=col_ok, other=0.0)
                acc += part * s[None, :]
            else:
                acc += part
    if BLOCK_M == 1:
        if LATE_SUM and SCALE != 2:
            acc = tl.sum(wide, 1)
    if SCALE == 1:
        s_row = tl.load(scale + cols, mask=col_ok, other=0.0)
        if BLOCK_M == 1:
            acc = acc * s_row
        else:
            acc = acc * s_row[None, :]
    if X_SCALE:  # an e4m3 x (W8A8 on the dot path): its per-row scales
        acc = acc * tl.load(x_scale + x_rows, mask=row_ok, other=0.0)[:, None]
    if HAS_BIAS and SUM == 0:
        b = tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)
        if BLOCK_M == 1:
            acc += b
        else:
            acc += b[None, :]
    if MUL_WEIGHT:
        if BLOCK_M == 1:
            acc = acc * tl.load(slot_weights + pid_m).to(tl.float32)
        else:
            acc = acc * tl.load(slot_weights + out_rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    parts = out
    out += pid_k.to(tl.int64) * stride_os
    if BLOCK_M == 1:
        tl.store(out + pid_m.to(tl.int64) * stride_om + cols, acc.to(out.dtype.element_ty), mask=col_ok)
    else:
        o_ptrs = out + out_rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    if SUM == 1:  # the split-K parts of this tile, by its last part's program
        if last_of(counts, pid_m * tl.num_programs(0) + pid_n, SLOTS):
            mask = row_ok[:, None] & col_ok[None, :]
            total = sum_in_order(parts, out_rows.to(tl.int64)[:, None] * stride_om + cols[None, :], stride_os,
                                 SLOTS, mask)
            if HAS_BIAS:
                total += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(final + out_rows.to(tl.int64)[:, None] * N + cols[None, :], total.to(final.dtype.element_ty),
                     mask=mask)
    elif SUM == 2:  # a token's slots (BLOCK_M 1), by the last of its slot programs for these columns
        token = (pid_m // SLOTS).to(tl.int64)
        if last_of(counts, token * tl.num_programs(0) + pid_n, SLOTS):
            total = sum_in_order(parts, token * SLOTS * stride_om + cols, stride_om, SLOTS, col_ok)
            r = total.to(final.dtype.element_ty)
            if HAS_EXTRA:
                r = (r.to(tl.float32) + tl.load(extra + token * N + cols, mask=col_ok, other=0.0).to(tl.float32))
                r = r.to(final.dtype.element_ty)
            tl.store(final + token * N + cols, r, mask=col_ok)


PREFETCH_BYTES = 16384  # weight bytes a program asks of L2 before its PDL wait (pdl.enter_prefetching)


def prefetch_steps(block_n: int, block_k: int, k_per: int, elem_bytes: int) -> int:
    """BLOCK_K steps of its weight rows a program prefetches before its PDL wait: up to
    ``PREFETCH_BYTES``, at least one, at most its part of K; 0 unless PDL runs in order 2 (no
    kernel variants for a value that is not used)."""
    if not pdl_prefetching():
        return 0
    return max(1, min(triton.cdiv(k_per, block_k), PREFETCH_BYTES // (block_n * block_k * elem_bytes)))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int | None,
             bias: torch.Tensor | None = None, config: GemvConfig | None = None,
             x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
             defer_sum: bool = False) -> torch.Tensor | SplitParts:
    """x [M, K] (M <= FP8_GEMV_MAX_ROWS, unit column stride) @ (weight [N, K] e4m3 * scale).T + bias
    -> [M, N] in x's dtype (``out_dtype``), fp32 accumulation. ``scale``: [N] per row, or
    [N, ceil(K/128)] with ``block`` 128. ``x_scale`` [M, 1]: x is e4m3 (W8A8, per-row scales only,
    M > 1). A ``split_k`` configuration sums its fp32 parts in part order (the result does not
    depend on which part finishes first): in the same launch (``SPLIT_SUM_IN_KERNEL``) or a second;
    with ``defer_sum`` (no bias) it returns them unsummed (``SplitParts``), for a consumer that adds
    them (``triton_fused.add_rms_norm``)."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} for a weight {tuple(weight.shape)}")
    if num_rows > FP8_GEMV_MAX_ROWS:
        raise ValueError(f"fp8_gemv takes at most {FP8_GEMV_MAX_ROWS} rows, got {num_rows}")
    if block not in (None, GROUP):
        raise ValueError(f"fp8_gemv: block scales of {block} columns; only {GROUP} is supported")
    if x_scale is not None and (block is not None or num_rows < 2):
        raise ValueError("fp8_gemv: an e4m3 x takes per-row weight scales and at least 2 rows")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg, block_m, block_k, k_per, split = fitted_tiles(config or fp8_config(num_rows, n, k, block, x_scale is not None),
                                                       num_rows, k, x.element_size(), block)
    in_kernel = split > 1 and SPLIT_SUM_IN_KERNEL
    deferred = split > 1 and defer_sum and bias is None and not in_kernel and num_rows > 0
    # deferred: out is only the kernel's placeholder pointer (of the dtype the launch is specialized on)
    out = torch.empty((1,) if deferred else (num_rows, n), dtype=out_dtype or x.dtype, device=x.device)
    if num_rows == 0:
        return out
    parts = out if split == 1 else torch.empty((split, num_rows, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(num_rows, block_m), split)
    has_bias = bias is not None and (split == 1 or in_kernel)
    _gemv_kernel[grid](
        x, weight, scale, parts, bias if has_bias else out, out, out, x_scale if x_scale is not None else out,
        out, out, sum_counters(x.device, grid[0] * grid[1]) if in_kernel else out,
        num_rows, n, k, k_per, x.stride(0), 0, weight.stride(0), n, num_rows * n, scale.stride(0) if block else 0,
        TOP_K=1, SCALE=SCALE_ROW if block is None else SCALE_BLOCK, GROUP=GROUP, HAS_EXPERTS=False,
        FUSE_SILU=False, MUL_WEIGHT=False, HAS_BIAS=has_bias, X_SCALE=x_scale is not None,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, PRECISION=_precision(x.dtype),
        SUM=int(in_kernel), SLOTS=split if in_kernel else 1,
        PREFETCH=prefetch_steps(cfg.block_n, block_k, k_per, weight.element_size()), LINE=128 // weight.element_size(),
        LATE_SUM=block_m == 1 and block is None and late_sum(cfg), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_kw())
    if deferred:
        return SplitParts(parts, out.dtype)
    if split > 1 and not in_kernel:
        sum_parts(parts, split, n, num_rows * n, out, bias=bias)
    return out


# True: split-K parts are added by each output tile's last program (one launch fewer); False (the default): by a
# second launch (``sum_parts``). On an H100 (tree 5c0ffc8) the 8B FP8 batch-64 step took 7.34 ms with the parts
# added in the kernel against 7.25 with the launch: the last program's sum runs after every part's (--split-sum-ab)
SPLIT_SUM_IN_KERNEL = False
# True: ``moe_gemv``'s down projection adds each token's slots in the last of its slot programs; False (the default):
# ``slot_sum`` in a launch of its own. On an H100 (tree 5c0ffc8) Qwen3-30B-A3B's batch-1 step took 0.590 ms either
# way (0.589 with the launch), so the simpler path stays (--slot-last-ab)
SLOT_SUM_IN_KERNEL = False
# None (the default): a one-row GEMV (gemv, an FP8 row with per-row scales, a MoE slot) sums late where its tile
# configuration says so (``GemvConfig.late_sum``: its products added per column of a K step across the loop, the
# columns summed once at the end, one cross-thread sum a program, not one a step); True / False: every one-row GEMV
# sums late / every K step (bench/engine.py --late-sum-ab, --late-all-ab). The two orders are equal within fp32
# rounding, not bit for bit. On an H100 (tree e6bd70c, bench/RESULTS.md) the late sum for all made
# DeepSeek-V2-Lite's batch-1 step 3 % faster and Qwen3-30B-A3B's and the 8B FP8's 1 % slower: it wins for some
# shapes and loses for others, which gemv_tiles' rules follow
ONE_ROW_LATE_SUM: bool | None = None


def late_sum(cfg: GemvConfig) -> bool:
    """Whether a one-row launch with ``cfg`` sums late (``ONE_ROW_LATE_SUM`` over the configuration's own choice)."""
    return bool(cfg.late_sum) if ONE_ROW_LATE_SUM is None else ONE_ROW_LATE_SUM


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """F.linear for one row: x [1, K] (unit column stride), weight [N, K] contiguous -> [1, N] in x's
    dtype, or fp32 for an fp32 weight (a router's: x taken exactly), fp32 accumulation. A batch-1
    decode step is this shape for every projection."""
    n, k = weight.shape
    if x.shape[0] != 1:
        raise ValueError(f"gemv takes one row, got {x.shape[0]}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = config or dense_config(n, k)
    out = torch.empty((1, n), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), 1, 1)](
        x, weight, out, out, bias if bias is not None else out, out, out, out, out, out, out,
        1, n, k, k, x.stride(0), 0, weight.stride(0), out.stride(0), 0, 0,
        TOP_K=1, SCALE=SCALE_NONE, GROUP=GROUP, HAS_EXPERTS=False, FUSE_SILU=False, MUL_WEIGHT=False,
        HAS_BIAS=bias is not None, X_SCALE=False, BLOCK_M=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION=_precision(x.dtype), PREFETCH=prefetch_steps(cfg.block_n, cfg.block_k, k, weight.element_size()),
        LINE=128 // weight.element_size(), LATE_SUM=late_sum(cfg), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_kw())
    return out


def expert_gemv(x: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, top_k: int,
                fuse_silu: bool, slot_weights: torch.Tensor | None, config: GemvConfig | None = None,
                summed: torch.Tensor | None = None, slots: int = 1, extra: torch.Tensor | None = None) -> None:
    """out[s] = act(x[s // top_k]) @ w[topk_ids[s]].T (* slot_weights[s]) for every slot s of
    ``topk_ids`` [S] (int64); w [E, N, K] contiguous; x [S / top_k, K] (or [.., 2K] with
    ``fuse_silu``); out [S, N]. ``summed`` [S / slots, N] (contiguous): also each token's ``slots``
    rows of out (fp32) added in slot order, rounded, + ``extra`` rounded, by the last of the
    token's programs for each column block (``slot_sum``'s result, in the same launch)."""
    num_slots = topk_ids.numel()
    n, k = w.shape[1], w.shape[2]
    cfg = config or moe_config(n, k, fuse_silu)
    grid = (triton.cdiv(n, cfg.block_n), num_slots, 1)
    counts = sum_counters(x.device, grid[0] * (num_slots // slots)) if summed is not None else out
    _gemv_kernel[grid](
        x, w, out, out, out, topk_ids, slot_weights if slot_weights is not None else out, out,
        summed if summed is not None else out, extra if extra is not None else out, counts,
        num_slots, n, k, k, x.stride(0), w.stride(0), w.stride(1), out.stride(0), 0, 0,
        TOP_K=top_k, SCALE=SCALE_NONE, GROUP=GROUP, HAS_EXPERTS=True, FUSE_SILU=fuse_silu,
        MUL_WEIGHT=slot_weights is not None, HAS_BIAS=False, X_SCALE=False, BLOCK_M=1, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, PRECISION=_precision(x.dtype), SUM=0 if summed is None else 2, SLOTS=slots,
        HAS_EXTRA=extra is not None, LATE_SUM=late_sum(cfg), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_kw())


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, configs: tuple[GemvConfig, GemvConfig] | None = None,
             extra: torch.Tensor | None = None, defer_sum: bool = False) -> torch.Tensor | SplitParts:
    """``triton_moe.fused_moe`` for T * k <= MOE_GEMV_MAX_SLOTS: x [T, H], w13 [E, 2I, H],
    w2 [E, H, I] -> [T, H] in x's dtype (gate-up rounded to x's dtype, the weighted down
    projection in fp32, summed over the k slots, then rounded; + ``extra`` [T, H], rounded).
    ``defer_sum`` (no extra): the weighted slot rows come back unsummed (``SplitParts.of_slots``)."""
    num_tokens, top_k = topk_ids.shape
    num_slots = num_tokens * top_k
    if num_slots > MOE_GEMV_MAX_SLOTS:
        raise ValueError(f"moe_gemv takes at most {MOE_GEMV_MAX_SLOTS} token slots, got {num_slots}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    ids = topk_ids.flatten().contiguous()
    gate_up = torch.empty(num_slots, w13.shape[1], dtype=x.dtype, device=x.device)
    down = torch.empty(num_slots, w2.shape[1], dtype=torch.float32, device=x.device)
    if num_slots == 0:
        out = torch.zeros(num_tokens, w2.shape[1], dtype=x.dtype, device=x.device)
        return out if extra is None else out + extra
    cfg13, cfg2 = configs or (None, None)
    expert_gemv(x, w13, ids, gate_up, top_k, False, None, cfg13)
    weights = topk_weights.flatten().contiguous()
    if SLOT_SUM_IN_KERNEL:
        out = torch.empty(num_tokens, w2.shape[1], dtype=x.dtype, device=x.device)
        extra = extra if extra is None or extra.is_contiguous() else extra.contiguous()
        expert_gemv(gate_up, w2, ids, down, 1, True, weights, cfg2, summed=out, slots=top_k, extra=extra)
        return out
    expert_gemv(gate_up, w2, ids, down, 1, True, weights, cfg2)
    return slot_sum(down, top_k, x.dtype, extra, defer=defer_sum)
