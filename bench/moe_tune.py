"""The fused MoE's grouped GEMMs (``common/kernels/triton_moe.py``) over a sweep of tile configurations,
to fill its table (``GEMM_CONFIGS``) from measurements on the GPU it serves on.

    python bench/moe_tune.py [--presets qwen3-30b-a3b,deepseek-v2-lite] [--tokens 64,128,1024,4096,8192,16384]
    TRITON_INTERPRET=1 python bench/moe_tune.py --device cpu --tiny     (the logic only: no meaningful times)

Per preset, both GEMMs of a sparse block with uniform random routing: w13 (N = 2I, K = H, the token's row
of x per slot) and w2 (N = H, K = I, a row per slot, times its top-k weight, fp32 out). For each token
count and each configuration of the sweep (``SWEEP`` plus every row of the table), the slots aligned by
the configuration's BLOCK_M, then the GEMM alone timed by CUDA events: the first call (compilation)
checked against the table's configuration (same result to bf16 rounding), whose output is checked
against a per-expert torch matmul, then ``--iters`` calls (fewer when one call is long). Configurations
that do not fit the GPU's shared memory are skipped. One JSON line per (preset, GEMM, tokens): the
fastest configuration, its ms, TFLOP/s and ratio to the bf16 matmul peak (``a @ a`` at 8192^3 in the
same run), the table's ("default") and the kernel's former single configuration's ("untuned") ms; then
one line per (preset, tokens) for the two GEMMs together, the fastest pair that shares a BLOCK_M (one
alignment serves both in fused_moe) against the table's pair. The routed experts only: DeepSeek's
shared experts are a dense MLP outside the kernel.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, git_hash, hardware  # noqa: E402
from kvferry.common.kernels import triton_moe  # noqa: E402
from kvferry.common.kernels.triton_moe import GemmConfig  # noqa: E402
from kvferry.common.layers.moe import select_experts  # noqa: E402

# (hidden, moe_intermediate, routed experts, top_k)
PRESETS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v2-lite": (2048, 1408, 64, 6)}
TINY = {"tiny": (64, 48, 8, 2)}
# The kernel's configuration before the table (BLOCK_M 16 up to 512 slots, else 64)
UNTUNED = (GemmConfig(16, 64, 64, 1, 4, 3), GemmConfig(64, 64, 64, 1, 4, 3))
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): the shapes vLLM's and SGLang's tuned files
# pick on H100/H200 for these sizes and their neighbours
SWEEP = [GemmConfig(*c) for c in [
    (16, 64, 128, 1, 4, 3), (16, 128, 128, 1, 4, 2), (16, 128, 64, 1, 4, 4),
    (32, 64, 128, 1, 4, 3), (32, 128, 128, 1, 8, 3), (32, 256, 128, 16, 4, 2), (32, 128, 64, 1, 4, 4),
    (64, 128, 64, 1, 4, 3), (64, 128, 64, 8, 4, 4), (64, 128, 128, 1, 4, 3), (64, 256, 64, 1, 8, 3),
    (64, 256, 64, 8, 8, 4), (64, 64, 128, 1, 4, 4), (64, 128, 64, 1, 4, 5),
    (128, 128, 64, 1, 8, 3), (128, 128, 64, 8, 8, 4), (128, 128, 64, 1, 4, 4), (128, 128, 128, 1, 8, 3),
    (128, 256, 64, 1, 8, 3), (128, 256, 64, 1, 8, 4), (128, 256, 64, 16, 8, 4), (128, 256, 64, 16, 8, 3),
    (128, 256, 128, 1, 8, 2), (128, 64, 64, 1, 4, 4), (128, 128, 64, 16, 8, 5), (128, 64, 128, 1, 4, 3),
    (256, 128, 64, 1, 8, 3), (256, 128, 128, 1, 8, 2), (256, 128, 64, 16, 8, 4),
]]
SMEM_BYTES = 232448  # H100/H200: 227 KiB of shared memory a block


def table_configs() -> list[GemmConfig]:
    rows = {triton_moe.SMALL_CONFIG, *triton_moe.DEFAULT_CONFIGS,
            *(c for row in triton_moe.GEMM_CONFIGS.values() for c in row)}
    return sorted(rows)


def sweep_list(tiny: bool) -> list[GemmConfig]:
    configs = list(dict.fromkeys([*UNTUNED, *table_configs(), *SWEEP]))
    # pipelined tiles of 16-bit operands; the interpreter has no such limit but gains nothing from them
    fits = [c for c in configs if c.num_stages * (c.block_m + c.block_n) * c.block_k * 2 <= SMEM_BYTES]
    return fits[:6] + fits[-2:] if tiny else fits


def warm_cache(configs: list[GemmConfig]) -> None:
    """Compiles both GEMMs' kernels (w13: bf16 out; w2: weighted, fp32 out) for ``configs`` on a small
    problem whose arguments specialize as the real ones do (sizes and strides multiples of 16), so that
    the timed runs load them from Triton's on-disk cache; run in parallel processes (``--compile-jobs``)."""
    import triton

    device = torch.device("cuda")
    num_experts, top_k, tokens, width = 4, 2, 64, 128
    x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
    b = torch.randn(num_experts, width, width, device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, num_experts, (tokens, top_k), device=device)
    weights = torch.rand(tokens * top_k, device=device, dtype=torch.bfloat16)
    for config in configs:
        aligned = triton_moe.align_by_expert(ids, num_experts, config.block_m)
        for a, a_top_k, w, out_dtype in ((x, top_k, None, torch.bfloat16),
                                          (x.repeat(top_k, 1), 1, weights, torch.float32)):
            out = torch.empty(tokens * top_k, width, device=device, dtype=out_dtype)
            try:
                triton_moe._grouped_gemm(a, b, out, *aligned, config, a_top_k, w)
            except triton.runtime.errors.OutOfResources:
                pass  # the timed run records it
    torch.cuda.synchronize()


def precompile(configs: list[GemmConfig], jobs: int) -> None:
    """``warm_cache`` over ``jobs`` spawned processes: Triton compiles one kernel at a time per process,
    and some 60 kernels one after another would take most of the run. A failure here only costs time:
    the timed runs compile what is missing."""
    import multiprocessing as mp

    try:
        with mp.get_context("spawn").Pool(jobs) as pool:
            pool.map(warm_cache, [configs[i::jobs] for i in range(jobs)])
    except Exception as e:  # noqa: BLE001
        print(f"precompile: {type(e).__name__}: {e}; compiling in the timed runs", file=sys.stderr)


def matmul_peak(device: torch.device) -> float | None:
    """bf16 matmul TFLOP/s at 8192^3 (mean of 20 after a warm-up), as bench/engine.py measures it."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return 2 * 8192**3 / cuda_ms(lambda: a @ a, 20) / 1e9


def cuda_ms(fn, iters: int) -> float:
    """Mean ms per call after one warm-up, by CUDA events."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def reference(a, b, ids, top_k, weights) -> torch.Tensor:
    """The grouped GEMM as one torch matmul per expert, in fp32: out[slot] = a[slot // top_k] @ b[e].T."""
    flat = ids.flatten()
    out = torch.zeros(flat.numel(), b.shape[1], dtype=torch.float32, device=a.device)
    for expert in torch.unique(flat).tolist():
        slots = (flat == expert).nonzero().flatten()
        out[slots] = a[slots // top_k].float() @ b[expert].float().T
    return out if weights is None else out * weights.float()[:, None]


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    # one bf16 rounding apart, with an absolute floor for the values that cancel near zero
    return torch.allclose(got.float(), want.float(), rtol=2**-7, atol=2e-2)


def tune_case(preset: str, gemm: str, dims, tokens: int, configs, dtype, device, iters: int, peak) -> dict:
    hidden, inter, num_experts, top_k = dims
    g = torch.Generator(device=device).manual_seed(tokens)
    n, k = (2 * inter, hidden) if gemm == "w13" else (hidden, inter)
    num_slots = tokens * top_k
    weights, ids = select_experts(torch.randn(tokens, num_experts, device=device, generator=g), top_k, True)
    b = (torch.randn(num_experts, n, k, device=device, generator=g) / k**0.5).to(dtype)
    if gemm == "w13":
        a = torch.randn(tokens, k, device=device, generator=g).to(dtype)
        a_top_k, w, out_dtype = top_k, None, dtype
    else:
        a = torch.randn(num_slots, k, device=device, generator=g).to(dtype)
        a_top_k, w, out_dtype = 1, weights.flatten().to(dtype).contiguous(), torch.float32
    default = triton_moe.gemm_config(n, k, num_slots, num_experts)
    untuned = UNTUNED[0] if num_slots <= 512 else UNTUNED[1]
    aligned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    outs = {}
    flops = 2.0 * num_slots * n * k

    def run(config):
        if config.block_m not in aligned:
            aligned[config.block_m] = triton_moe.align_by_expert(ids, num_experts, config.block_m)
        out = outs.setdefault(config, torch.empty(num_slots, n, dtype=out_dtype, device=device))
        return lambda: triton_moe._grouped_gemm(a, b, out, *aligned[config.block_m], config, a_top_k, w)

    ordered = [default, *(c for c in configs if c != default)]
    times, mismatched, failed = {}, [], []
    want = None
    for config in ordered:
        try:
            call = run(config)
            start = time.perf_counter()
            call()  # compiles; its result is checked before any timing
            if device.type == "cuda":
                torch.cuda.synchronize()
            first_s = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 (out of shared memory or registers on this GPU: skipped)
            failed.append({"config": list(config), "error": f"{type(e).__name__}: {str(e)[:120]}"})
            outs.pop(config, None)
            continue
        got = outs[config]
        if want is None:  # the table's configuration, against torch
            ref = reference(a, b, ids, a_top_k, w)
            if not close(got, ref):
                raise SystemExit(f"{preset} {gemm} tokens={tokens}: the table's {config} differs from torch "
                                 f"(max abs diff {(got.float() - ref).abs().max().item():.3g})")
            want = got.clone()
        elif not close(got, want):
            mismatched.append(list(config))
            outs.pop(config)
            continue
        if device.type == "cuda":
            once = cuda_ms(call, 1)
            times[config] = cuda_ms(call, max(2, min(iters, math.ceil(25.0 / max(once, 1e-3)))))
        else:
            times[config] = first_s * 1e3  # the interpreter's: logic only
        outs.pop(config)  # frees the output before the next configuration's
    best = min(times, key=times.get)

    def tflops(ms):
        return round(flops / ms / 1e9, 1)

    def ratio(ms):
        return None if peak is None else round(flops / ms / 1e9 / peak, 3)

    return {"preset": preset, "gemm": gemm, "E": num_experts, "top_k": top_k, "N": n, "K": k, "tokens": tokens,
            "slots": num_slots, "slots_per_expert": round(num_slots / num_experts, 1),
            "best": list(best), "best_ms": round(times[best], 4), "best_tflops": tflops(times[best]),
            "best_ratio_vs_matmul_peak": ratio(times[best]),
            "default": list(default), "default_ms": round(times[default], 4), "default_tflops": tflops(times[default]),
            "default_ratio_vs_matmul_peak": ratio(times[default]),
            "untuned": list(untuned), "untuned_ms": round(times[untuned], 4) if untuned in times else None,
            "configs_timed": len(times), "mismatched": mismatched, "failed": failed,
            "_times": times, "_flops": flops}


def pair_record(up: dict, down: dict, peak) -> dict:
    """Both GEMMs of one block: the fastest pair with a common BLOCK_M, against the table's pair."""
    flops = up["_flops"] + down["_flops"]
    pairs = {}
    for cu, tu in up["_times"].items():
        for cd, td in down["_times"].items():
            if cu.block_m == cd.block_m and (cu.block_m not in pairs or tu + td < pairs[cu.block_m][2]):
                pairs[cu.block_m] = (cu, cd, tu + td)
    cu, cd, best_ms = min(pairs.values(), key=lambda p: p[2])
    default_ms = up["default_ms"] + down["default_ms"]
    untuned_ms = None
    if up["untuned_ms"] is not None and down["untuned_ms"] is not None:
        untuned_ms = up["untuned_ms"] + down["untuned_ms"]
    out = {"preset": up["preset"], "gemm": "w13+w2", "tokens": up["tokens"], "slots_per_expert": up["slots_per_expert"],
           "best_w13": list(cu), "best_w2": list(cd), "best_ms": round(best_ms, 4),
           "best_tflops": round(flops / best_ms / 1e9, 1), "default_ms": round(default_ms, 4),
           "default_tflops": round(flops / default_ms / 1e9, 1),
           "untuned_ms": None if untuned_ms is None else round(untuned_ms, 4)}
    if peak is not None:
        out["best_ratio_vs_matmul_peak"] = round(flops / best_ms / 1e9 / peak, 3)
        out["default_ratio_vs_matmul_peak"] = round(flops / default_ms / 1e9 / peak, 3)
        if untuned_ms is not None:
            out["untuned_ratio_vs_matmul_peak"] = round(flops / untuned_ms / 1e9 / peak, 3)
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--tokens", default="64,128,1024,4096,8192,16384")
    ap.add_argument("--iters", type=int, default=10, help="timed calls a configuration, at most")
    ap.add_argument("--compile-jobs", type=int, default=min(8, os.cpu_count() or 1),
                    help="processes that compile the sweep's kernels first (CUDA; 0: none)")
    ap.add_argument("--tiny", action="store_true", help="small shapes and a few configurations (CPU, interpreter)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("on CPU the kernel runs only under Triton's interpreter: TRITON_INTERPRET=1")
    presets = TINY if args.tiny else {p: PRESETS[p] for p in args.presets.split(",")}
    tokens_list = [16, 300] if args.tiny else [int(t) for t in args.tokens.split(",")]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    configs = sweep_list(args.tiny)
    started = time.monotonic()
    if device.type == "cuda" and args.compile_jobs > 0:
        precompile(configs, args.compile_jobs)
    compile_s = time.monotonic() - started
    peak = matmul_peak(device)
    base = {"bench": "moe_tune", "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "matmul_tflops": None if peak is None else round(peak, 1), "configs": len(configs),
            "config_fields": list(GemmConfig._fields), "precompile_s": round(compile_s, 1),
            "hw": hardware([str(device)]), "git": git_hash()}
    for preset, dims in presets.items():
        for tokens in tokens_list:
            records = [tune_case(preset, gemm, dims, tokens, configs, dtype, device, args.iters, peak)
                       for gemm in ("w13", "w2")]
            for r in records:
                emit({**base, **{k: v for k, v in r.items() if not k.startswith("_")}})
            emit({**base, **pair_record(*records, peak), "elapsed_s": round(time.monotonic() - started, 1)})


if __name__ == "__main__":
    main()
