"""Fused MoE for the CUDA path: a sparse block's experts as two grouped GEMMs over token slots
sorted by expert. The reference is ``common/layers/moe.fused_moe_ref``.

A token slot is ``t * k + j``: token t's j-th expert. Over T tokens and k experts each::

    align_by_expert(topk_ids, E, BLOCK_M) -> sorted_slots [P], block_experts [P / BLOCK_M]
        expert e's slots in consecutive blocks of BLOCK_M rows, its last block padded with the
        sentinel T * k (masked off); block b's expert is block_experts[b] (-1: past the last block)
    grouped GEMM  x[slot // k] @ w13[e].T           -> gate_up [T * k, 2I]
    silu_mul                                        -> act [T * k, I]
    grouped GEMM  act[slot] @ w2[e].T * weight[slot] -> [T * k, H] (fp32)
    sum over the k slots of each token (+ extra)    -> [T, H]   (slot_sum: one launch)

No host sync anywhere: the sort runs on the device (one counting-sort launch for decode-sized slot
counts, torch ops past them), and P is bounded by shapes alone
(at most min(T * k, E) experts have a slot, each wasting under BLOCK_M rows of padding), so the
grid is fixed and a CUDA graph can capture the whole block.

Each GEMM's tile configuration (``gemm_config``) comes from a table by its (N, K) and its slots per
expert; ``bench/moe_tune.py`` sweeps configurations on the GPU to fill it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvferry.common.kernels.gemv_tiles import dense_config
from kvferry.common.kernels.pdl import enter as pdl_enter, kw as pdl_kw
from kvferry.common.kernels.quant_rows import SplitParts
from kvferry.common.kernels.split_sum import counters as sum_counters, last_of, slot_sum
from kvferry.common.kernels.triton_fused import silu_mul
from kvferry.common.kernels import triton_gemv
from kvferry.common.kernels.triton_gemv import MOE_GEMV_MAX_SLOTS, SHARED_MEMORY_BYTES, moe_gemv


# Up to this many slots align_by_expert is one launch (_align_kernel), at ALIGN_WARPS. bench/moe_align.py on an H100
# (CUDA graphs, 128 experts): 5.2 / 27.6 / 48.8 / 92.2 us at 64 / 512 / 1,024 / 2,048 slots, against 48.5 / 74.6 /
# 76.7 / 78.5 for the torch ops: one program's work grows with the slots, the torch ops' launches do not.
ALIGN_KERNEL_MAX_SLOTS = 1024
ALIGN_WARPS = 8


def _align_bound(num_slots: int, num_experts: int, block_m: int) -> int:
    """P: every slot, plus under ``block_m`` rows of padding for each expert that can have a slot."""
    return triton.cdiv(num_slots + min(num_slots, num_experts) * (block_m - 1), block_m) * block_m


@triton.jit
def _align_kernel(ids, sorted_slots, block_experts, S, E, BOUND, NUM_BLOCKS, BLOCK_S: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_FILL: tl.constexpr,
                  PDL: tl.constexpr = 0):
    """``align_by_expert`` in one program, a counting sort: the experts' slot counts, their padded
    starts (an exclusive cumsum), every row set to the sentinel S, then each slot written at its
    expert's start plus its rank among that expert's slots (the earlier chunks' count, plus the
    earlier slots of its chunk), then each block's expert (how many experts end at or before it)."""
    pdl_enter(PDL)
    e = tl.arange(0, BLOCK_E)
    j = tl.arange(0, BLOCK_S)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for s0 in range(0, S, BLOCK_S):
        x = tl.load(ids + s0 + j, mask=s0 + j < S, other=BLOCK_E).to(tl.int32)  # past S: no expert's bin
        counts += tl.sum((x[:, None] == e[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    f = tl.arange(0, BLOCK_FILL)
    for p0 in range(0, BOUND, BLOCK_FILL):
        tl.store(sorted_slots + p0 + f, S, mask=p0 + f < BOUND)
    tl.debug_barrier()  # the sentinels land before any slot overwrites them
    seen = tl.zeros((BLOCK_E,), dtype=tl.int32)  # each expert's slots in the chunks before
    for s0 in range(0, S, BLOCK_S):
        x = tl.load(ids + s0 + j, mask=s0 + j < S, other=BLOCK_E).to(tl.int32)
        hot = x[:, None] == e[None, :]  # [BLOCK_S, BLOCK_E]
        base = tl.sum(tl.where(hot, (starts + seen)[None, :], 0), 1)
        earlier = tl.sum(((x[:, None] == x[None, :]) & (j[None, :] < j[:, None])).to(tl.int32), 1)
        tl.store(sorted_slots + base + earlier, s0 + j, mask=s0 + j < S)
        seen += tl.sum(hot.to(tl.int32), 0)
    real = e < E
    for b0 in range(0, NUM_BLOCKS, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        expert = tl.sum(((ends[None, :] <= (b * BLOCK_M)[:, None]) & real[None, :]).to(tl.int32), 1)
        tl.store(block_experts + b, tl.where(expert < E, expert, -1), mask=b < NUM_BLOCKS)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_slots [P] int64, block_experts [P // block_m] int64).

    Invariants: every slot in [0, T * k) appears exactly once in ``sorted_slots``; every other entry
    is T * k; each block of ``block_m`` entries holds slots of the one expert ``block_experts[b]``
    (ascending expert order, slot order within an expert), and a block with no slot has expert -1.
    Up to ``ALIGN_KERNEL_MAX_SLOTS`` slots (decode batches) one launch (``_align_kernel``), else
    about a dozen torch ops (``align_by_expert_torch``): both give the same tensors.
    """
    num_slots = topk_ids.numel()
    if num_slots > ALIGN_KERNEL_MAX_SLOTS or num_slots == 0:
        return align_by_expert_torch(topk_ids, num_experts, block_m)
    bound = _align_bound(num_slots, num_experts, block_m)
    sorted_slots = torch.empty(bound, dtype=torch.int64, device=topk_ids.device)
    block_experts = torch.empty(bound // block_m, dtype=torch.int64, device=topk_ids.device)
    block_e = triton.next_power_of_2(num_experts)
    cap = max(16, 16384 // block_e)  # a [slots, experts] tile of at most 16K elements
    _align_kernel[(1,)](topk_ids.flatten(), sorted_slots, block_experts, num_slots, num_experts, bound,
                        bound // block_m, BLOCK_S=min(cap, 128, max(16, triton.next_power_of_2(num_slots))),
                        BLOCK_E=block_e, BLOCK_M=block_m,
                        BLOCK_B=min(cap, 128, max(16, triton.next_power_of_2(bound // block_m))), BLOCK_FILL=1024,
                        num_warps=num_warps or ALIGN_WARPS, **pdl_kw())
    return sorted_slots, block_experts


def align_by_expert_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``align_by_expert`` as torch ops on the device (a stable argsort by expert): any slot count."""
    flat = topk_ids.flatten()
    num_slots = flat.numel()
    # a scatter, not bincount: bincount on CUDA reads its maximum back to the host
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert
    experts = flat[order]
    # a slot's row: its expert's first padded row + its rank among that expert's slots
    rank = torch.arange(num_slots, device=flat.device) - (torch.cumsum(counts, 0) - counts)[experts]
    rows = (padded_ends - padded)[experts] + rank
    bound = _align_bound(num_slots, num_experts, block_m)
    sorted_slots = torch.full((bound,), num_slots, dtype=torch.int64, device=flat.device)
    sorted_slots[rows] = order
    block_starts = torch.arange(0, bound, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    return sorted_slots, torch.where(block_experts < num_experts, block_experts, -1)


class GemmConfig(NamedTuple):
    """One tile configuration of ``_grouped_gemm_kernel``: a program computes BLOCK_M slots x BLOCK_N
    columns, BLOCK_K deep per step; ``group_m`` row blocks share a band of programs (1: row block by
    row block), so that the A rows and the expert's B columns one band reads stay in L2."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# Small slot counts (decode batches: at most 512 slots), the kernel's configuration before the table.
SMALL_CONFIG = GemmConfig(16, 64, 64, 1, 4, 3)
# Larger slot counts by slots per expert (num_slots / num_experts, routing taken as uniform): below 16,
# 64, 256, and from 256. The rows come from vLLM's tuned H200 file for E=128, N=768 (Qwen3-30B-A3B; the
# "M" of its keys is tokens, so slots per expert = M * 8 / 128) and its H100 file for E=64, N=1408
# (DeepSeek-V2-Lite: M * 6 / 64; no H200 file there), where both GEMMs of a block share one
# configuration; bench/moe_tune.py measures them against a sweep on the GPU. A row's BLOCK_M is the
# same for both GEMMs of a preset, so fused_moe aligns the slots once.
SPE_BOUNDS = (16, 64, 256)
_QWEN3_30B = (GemmConfig(16, 128, 128, 1, 4, 2), GemmConfig(64, 128, 64, 1, 4, 3),
              GemmConfig(128, 256, 64, 16, 8, 4), GemmConfig(128, 256, 64, 16, 8, 4))
_DEEPSEEK_V2_LITE = (GemmConfig(32, 128, 128, 1, 8, 3), GemmConfig(64, 128, 64, 1, 4, 3),
                     GemmConfig(128, 128, 64, 1, 8, 3), GemmConfig(128, 256, 64, 16, 8, 4))
DEFAULT_CONFIGS = _QWEN3_30B  # any other (N, K): the H200 file's rows
GEMM_CONFIGS: dict[tuple[int, int], tuple[GemmConfig, ...]] = {
    (2 * 768, 2048): _QWEN3_30B, (2048, 768): _QWEN3_30B,  # (N, K) of w13 and of w2
    (2 * 1408, 2048): _DEEPSEEK_V2_LITE, (2048, 1408): _DEEPSEEK_V2_LITE,
}


def fit_shared_memory(config: GemmConfig, element_bytes: int) -> GemmConfig:
    """``config`` with fewer stages, then a shallower BLOCK_K, until its pipelined A and B tiles fit a
    block's shared memory at ``element_bytes`` per element: the table's bf16 rows are too large in
    float32 (the tiny models' dtype on the GPU; Triton refuses them as out of resources)."""
    while config.num_stages * (config.block_m + config.block_n) * config.block_k * element_bytes > SHARED_MEMORY_BYTES:
        if config.num_stages > 2:
            config = config._replace(num_stages=config.num_stages - 1)
        elif config.block_k > 16:
            config = config._replace(block_k=config.block_k // 2)
        else:
            break
    return config


def gemm_config(n: int, k: int, num_slots: int, num_experts: int) -> GemmConfig:
    """The tile configuration of a grouped GEMM with weights [E, n, k] over ``num_slots`` slots."""
    if num_slots <= 512:
        return SMALL_CONFIG
    per_expert = num_slots / num_experts
    bucket = sum(per_expert >= bound for bound in SPE_BOUNDS)
    return GEMM_CONFIGS.get((n, k), DEFAULT_CONFIGS)[bucket]


@triton.jit(do_not_specialize=["num_slots", "num_pid_m", "top_k"])
def _grouped_gemm_kernel(a, b, c, sorted_slots, block_experts, weights, N, K, num_slots, num_pid_m, top_k,
                         stride_am, stride_be, stride_bn, stride_cm,
                         MUL_WEIGHT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = 0):
    """c[slot, n] = a[slot // top_k] . b[expert, n] (* weights[slot]) for one block of BLOCK_M slots
    and BLOCK_N columns (top_k 1: a row per slot). A 1-D grid of num_pid_m x cdiv(N, BLOCK_N)
    programs, in bands of GROUP_M row blocks: a band's programs run together and share its A rows
    and its experts' B columns in L2. top_k is a runtime value so that one compiled kernel serves
    every model's k (the division is BLOCK_M integer ops a program)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * num_pid_n
    first_m = pid // band * GROUP_M
    band_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + pid % band % band_m
    pid_n = pid % band // band_m
    expert = tl.load(block_experts + pid_m)
    if expert < 0:  # past the last expert's blocks: only sentinels, nothing to compute or store
        return
    slots = tl.load(sorted_slots + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    # the sentinel T * k pads an expert's last block: those rows' loads and stores are masked
    has_rows = slots < num_slots
    expert = expert.to(tl.int64)
    a_rows = tl.where(has_rows, slots // top_k, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    has_cols = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a + a_rows[:, None] * stride_am + ks[None, :]
    b_ptrs = b + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = ks < K - k0
        a_tile = tl.load(a_ptrs, mask=has_rows[:, None] & in_k[None, :], other=0.0)
        b_tile = tl.load(b_ptrs, mask=in_k[:, None] & has_cols[None, :], other=0.0)
        acc = tl.dot(a_tile, b_tile, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc = acc * tl.load(weights + slots, mask=has_rows, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c + tl.where(has_rows, slots, 0).to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=has_rows[:, None] & has_cols[None, :])


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sorted_slots: torch.Tensor,
                  block_experts: torch.Tensor, config: GemmConfig, top_k: int, weights: torch.Tensor | None) -> None:
    """a [T * k / top_k, K] contiguous, b [E, N, K] contiguous, out [T * k, N]; ``weights`` [T * k] or
    None; ``sorted_slots`` and ``block_experts`` aligned by ``config.block_m``."""
    n, k = b.shape[1], b.shape[2]
    config = fit_shared_memory(config, a.element_size())
    num_pid_m = block_experts.numel()
    grid = (num_pid_m * triton.cdiv(n, config.block_n),)
    _grouped_gemm_kernel[grid](
        a, b, out, sorted_slots, block_experts, weights if weights is not None else out, n, k, out.shape[0],
        num_pid_m, top_k, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        MUL_WEIGHT=weights is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_kw())


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, extra: torch.Tensor | None = None,
              defer_sum: bool = False) -> torch.Tensor | SplitParts:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights and topk_ids [T, k] -> [T, H] in x's
    dtype; as ``fused_moe_ref`` to within one rounding of the dtype (the down projection is weighted
    in fp32 before it is rounded), plus ``extra`` [T, H] (the shared experts') in the same launch as
    the slot sum, rounded as torch's add. ``defer_sum`` (no extra): the weighted slot rows unsummed
    (``SplitParts.of_slots``), for the next residual add's launch (``triton_fused.add_rms_norm``)."""
    num_tokens, top_k = topk_ids.shape
    num_slots = num_tokens * top_k
    if num_slots <= MOE_GEMV_MAX_SLOTS:  # decode-sized: no sort by expert (triton_gemv.py)
        return moe_gemv(x, w13, w2, topk_weights, topk_ids, extra=extra, defer_sum=defer_sum)
    num_experts = w13.shape[0]
    up_config = gemm_config(w13.shape[1], w13.shape[2], num_slots, num_experts)
    down_config = gemm_config(w2.shape[1], w2.shape[2], num_slots, num_experts)
    sorted_slots, block_experts = align_by_expert(topk_ids, num_experts, up_config.block_m)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    gate_up = torch.empty(num_slots, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, sorted_slots, block_experts, up_config, top_k, None)
    if down_config.block_m != up_config.block_m:  # a row pair of the table keeps BLOCK_M equal
        sorted_slots, block_experts = align_by_expert(topk_ids, num_experts, down_config.block_m)
    down = torch.empty(num_slots, w2.shape[1], dtype=torch.float32, device=x.device)
    weights = topk_weights.flatten().contiguous()
    _grouped_gemm(silu_mul(gate_up), w2, down, sorted_slots, block_experts, down_config, 1, weights)
    return slot_sum(down, top_k, x.dtype, extra, defer=defer_sum)


@triton.jit
def _softmax_topk_kernel(logits, weights, ids, E, stride_l, scale, eps, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_K: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr = 0, PDL: tl.constexpr = 0):
    """Row t's k picks, then SHARED always-chosen experts (ids E, E + 1, ..., weight 1)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    x = tl.load(logits + t * stride_l + e, mask=ok, other=-float("inf")).to(tl.float32)
    _topk_row(x, e, ok, weights, ids, t, E, scale, eps, TOP_K, BLOCK_E, BLOCK_K, RENORM, SHARED)


@triton.jit
def _router_topk_kernel(x, w, logits, counts, weights, ids, E, H, stride_x, scale, eps, BLOCK_N: tl.constexpr,
                        BLOCK_H: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        RENORM: tl.constexpr, SHARED: tl.constexpr = 0, PDL: tl.constexpr = 0,
                        LATE_SUM: tl.constexpr = 0):
    """Token t's router logits, BLOCK_N experts a program (``triton_gemv.gemv``'s one-row dot, its
    sum every step or late as LATE_SUM: the same tiles give the same sums), stored in logits' dtype;
    the last of the token's programs to finish (``split_sum.last_of``) reads the row back and picks
    as ``_softmax_topk_kernel``."""
    pdl_enter(PDL)
    pid_n, t = tl.program_id(0), tl.program_id(1).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_ok = cols < E
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    wide = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)  # LATE_SUM's running sums
    for k0 in range(0, H, BLOCK_H):
        k = k0 + tl.arange(0, BLOCK_H)
        k_ok = k < H
        xv = tl.load(x + t * stride_x + k, mask=k_ok, other=0.0)
        wv = tl.load(w + cols[:, None] * H + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        prod = wv.to(tl.float32) * xv.to(tl.float32)[None, :]
        if LATE_SUM:
            wide += prod
        else:
            acc += tl.sum(prod, 1)
    if LATE_SUM:
        acc = tl.sum(wide, 1)
    tl.store(logits + t * E + cols, acc.to(logits.dtype.element_ty), mask=col_ok)
    if last_of(counts, t, tl.num_programs(0)):
        e = tl.arange(0, BLOCK_E)
        ok = e < E
        row = tl.load(logits + t * E + e, mask=ok, other=-float("inf"), cache_modifier=".cg").to(tl.float32)
        _topk_row(row, e, ok, weights, ids, t, E, scale, eps, TOP_K, BLOCK_E, BLOCK_K, RENORM, SHARED)


@triton.jit
def _topk_row(x, e, ok, weights, ids, t, E, scale, eps, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
              BLOCK_K: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr):
    """The k largest of softmax(x) (x: a row of logits, fp32, -inf past E) for row t, then SHARED."""
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(ok, p / tl.sum(p, 0), -1.0)
    j = tl.arange(0, BLOCK_K)
    picked = tl.zeros((BLOCK_K,), dtype=tl.float32)
    picked_ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for i in tl.static_range(TOP_K):  # the largest left, the lowest id among equals
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), 0)
        picked = tl.where(j == i, best, picked)
        picked_ids = tl.where(j == i, idx.to(tl.int64), picked_ids)
        p = tl.where(e == idx, -1.0, p)
    if RENORM:
        picked = picked / (tl.sum(picked, 0) + eps)
    picked = picked * scale
    row = t * (TOP_K + SHARED)
    tl.store(weights + row + j, picked.to(weights.dtype.element_ty), mask=j < TOP_K)
    tl.store(ids + row + j, picked_ids, mask=j < TOP_K)
    if SHARED > 0:
        tail = tl.arange(0, BLOCK_K)
        tl.store(weights + row + TOP_K + tail, tl.full((BLOCK_K,), 1.0, tl.float32).to(weights.dtype.element_ty),
                 mask=tail < SHARED)
        tl.store(ids + row + TOP_K + tail, (E + tail).to(tl.int64), mask=tail < SHARED)


def router_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype,
                scale: float = 1.0, eps: float = 0.0, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax_topk(gemv(x, weight), ...)`` in one launch for a few tokens: x [T, H] (unit column
    stride), the router's weight [E, H] contiguous; the logits are made with ``gemv``'s tiles, in
    its output dtype, so the picks equal the two launches' bit for bit."""
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    weights = torch.empty(num_tokens, top_k + shared, dtype=out_dtype, device=x.device)
    ids = torch.empty(num_tokens, top_k + shared, dtype=torch.int64, device=x.device)
    if num_tokens == 0:
        return weights, ids
    weight = weight.contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    logits = torch.empty(num_tokens, num_experts, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    cfg = dense_config(num_experts, hidden)
    grid = (triton.cdiv(num_experts, cfg.block_n), num_tokens)
    _router_topk_kernel[grid](x, weight, logits, sum_counters(x.device, num_tokens), weights, ids, num_experts, hidden,
                              x.stride(0), scale, eps, BLOCK_N=cfg.block_n, BLOCK_H=cfg.block_k, TOP_K=top_k,
                              BLOCK_E=triton.next_power_of_2(num_experts),
                              BLOCK_K=triton.next_power_of_2(max(top_k, shared)), RENORM=renormalize, SHARED=shared,
                              LATE_SUM=triton_gemv.late_sum(cfg), num_warps=cfg.num_warps, **pdl_kw())
    return weights, ids


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype, scale: float = 1.0,
                 eps: float = 0.0, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A router in one launch: logits [T, E] -> (weights [T, k] ``out_dtype``, ids [T, k] int64), the k
    largest of softmax(logits) in fp32, in descending order, divided by (their sum + ``eps``) when
    ``renormalize``, times ``scale``; then ``shared`` always-chosen experts (``moe.append_shared``:
    [T, k + shared]). As ``moe.select_experts`` (``scale`` 1, ``eps`` 0) and DeepSeek's greedy
    softmax ``route``; the torch composition is five to seven launches."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k + shared, dtype=out_dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k + shared, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    _softmax_topk_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0), scale, eps, TOP_K=top_k,
                                        BLOCK_E=triton.next_power_of_2(num_experts),
                                        BLOCK_K=triton.next_power_of_2(max(top_k, shared)), RENORM=renormalize,
                                        SHARED=shared, num_warps=4, **pdl_kw())
    return weights, ids
