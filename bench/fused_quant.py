"""The per-token quant fused into the kernels that feed a W8A8 linear (``triton_fused.add_rms_norm``
and ``silu_mul`` with ``quant``), over their launch configurations, beside the two launches they
replace (the kernel alone, then ``triton_fp8_gemm.per_token_quant``), in the same run.

    python bench/fused_quant.py [--rows 32,64] [--iters 50]

Cases (one JSON line per case and row count), Llama-3.1-8B's widths: ``norm`` (hidden 4,096, what
feeds qkv and gate-up) and ``silu`` (intermediate 14,336, what feeds down). Each line: the fastest
configuration and its us, the default's, and the separate pair's (``baseline_us``, at the default).
Every output is checked against the separate pair's at the same configuration (bit for bit: the
norm's warps set the order of its sum of squares) before it is timed. Times are of --iters calls
replayed in one CUDA graph (``gemv_tune.timed_us``), as a decode step runs them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench import gemv_tune  # noqa: E402
from bench._common import emit, git_hash, hardware  # noqa: E402

HIDDEN, INTER = 4096, 14336
SILU_CONFIGS = [(16384, 16), (16384, 32), (8192, 16), (8192, 8), (4096, 8), (4096, 16), (2048, 4), (2048, 8),
                (1024, 4)]
NORM_WARPS = [4, 8, 16]


def _equal(got, want) -> None:
    rows, q, s = want
    assert torch.equal(got.rows, rows) and torch.equal(got.scale, s)
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))


def case(name: str, rows: int, separate, fused, configs, default, iters: int, base: dict) -> None:
    """``separate(config)`` -> (rows, q, scale) of the unfused kernel at ``config`` (the norm's warps
    set its sum's order) and the separate quant; ``fused(config)`` -> TokenQuantized; ``default``: the
    config the kernel takes by itself, the baseline's too."""
    times = {}
    for config in configs:
        _equal(fused(config), separate(config))
        times[config] = gemv_tune.timed_us(lambda: fused(config), iters)
    best = min(times, key=times.get)
    baseline = gemv_tune.timed_us(lambda: separate(default), iters)
    emit({**base, "case": name, "rows": rows, "best": list(best) if isinstance(best, tuple) else best,
          "best_us": round(times[best], 2), "default_us": round(times[default], 2), "baseline_us": round(baseline, 2),
          "speedup_best_vs_baseline": round(baseline / times[best], 3),
          "all": {str(c): round(t, 2) for c, t in times.items()}})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="32,64")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on CPU under TRITON_INTERPRET=1 (set it): checks the logic, times nothing")
    args = ap.parse_args()
    global HIDDEN, INTER, SILU_CONFIGS, NORM_WARPS
    dtype = torch.bfloat16
    if args.dry_run:
        gemv_tune.DEVICE, dtype, args.iters = "cpu", torch.float16, 1
        HIDDEN, INTER, SILU_CONFIGS, NORM_WARPS = 96, 600, [(1024, 4), (256, 4)], [4]
    elif not torch.cuda.is_available():
        raise SystemExit("bench/fused_quant.py times CUDA kernels; no CUDA device here")
    from kvferry.common.kernels import triton_fp8_gemm, triton_fused

    device = gemv_tune.DEVICE
    torch.manual_seed(0)
    base = {"bench": "fused_quant", "git": git_hash(), "hardware": hardware([device if device == "cpu" else "cuda:0"])}
    for rows in map(int, args.rows.split(",")):
        x, delta = (torch.randn(rows, HIDDEN, device=device).to(dtype) for _ in range(2))
        weight = torch.rand(HIDDEN, device=device).to(dtype) + 0.5

        def norm_separate(warps):
            _, h = triton_fused.add_rms_norm(x, delta, weight, 1e-5, num_warps=warps)
            return (h, *triton_fp8_gemm.per_token_quant(h))

        case("norm", rows, norm_separate,
             lambda warps: triton_fused.add_rms_norm(x, delta, weight, 1e-5, quant=True, num_warps=warps)[1],
             NORM_WARPS, 8 if 8 in NORM_WARPS else NORM_WARPS[0], args.iters, base)
        gate_up = (torch.randn(rows, 2 * INTER, device=device) * 3).to(dtype)

        def silu_separate(config):
            h = triton_fused.silu_mul(gate_up)  # elementwise: the same at any configuration
            return (h, *triton_fp8_gemm.per_token_quant(h))

        default = (min(triton_fused.SILU_QUANT_BLOCK, 1 << (INTER - 1).bit_length()), triton_fused.SILU_QUANT_WARPS)
        configs = SILU_CONFIGS if default in SILU_CONFIGS else [default, *SILU_CONFIGS]
        case("silu", rows, silu_separate,
             lambda c: triton_fused.silu_mul(gate_up, quant=True, block=c[0], num_warps=c[1]),
             configs, default, args.iters, base)


if __name__ == "__main__":
    main()
