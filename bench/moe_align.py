"""The MoE slots sorted by expert: ``triton_moe.align_by_expert``'s one-launch counting sort
(``_align_kernel``, at several warp counts) beside the torch ops it replaces
(``align_by_expert_torch``), in the same run.

    python bench/moe_align.py [--cases 64x128x16,512x128x16,...] [--iters 50]

A case is SLOTSxEXPERTSxBLOCK_M (Qwen3-30B-A3B: 128 experts, k 8; DeepSeek-V2-Lite: 64, k 6; the
grouped GEMM's BLOCK_M 16 for decode-sized slot counts). One JSON line a case: each warp count's us,
the torch path's, their ratio. Outputs are checked equal before they are timed. Times are of
--iters calls replayed in one CUDA graph (``gemv_tune.timed_us``), as a decode step runs them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench import gemv_tune  # noqa: E402
from bench._common import emit, git_hash, hardware  # noqa: E402

CASES = "64x128x16,256x128x16,512x128x16,1024x128x16,2048x128x64,48x64x16,384x64x16,1536x64x64"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--warps", default="1,2,4,8,16")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dry-run", action="store_true",
                    help="on CPU under TRITON_INTERPRET=1 (set it): checks the logic, times nothing")
    args = ap.parse_args()
    if args.dry_run:
        gemv_tune.DEVICE, args.iters = "cpu", 1
    elif not torch.cuda.is_available():
        raise SystemExit("bench/moe_align.py times CUDA kernels; no CUDA device here")
    from kvferry.common.kernels import triton_moe

    triton_moe.ALIGN_KERNEL_MAX_SLOTS = 1 << 20  # the kernel at every case, also past the bound it is used to
    device = gemv_tune.DEVICE
    base = {"bench": "moe_align", "git": git_hash(), "hardware": hardware([device if device == "cpu" else "cuda:0"])}
    gen = torch.Generator().manual_seed(0)
    for case in args.cases.split(","):
        num_slots, num_experts, block_m = map(int, case.split("x"))
        ids = torch.randint(0, num_experts, (num_slots // 8 or 1, 8 if num_slots >= 8 else num_slots),
                            generator=gen).to(device)
        want = triton_moe.align_by_expert_torch(ids, num_experts, block_m)
        times = {}
        for warps in map(int, args.warps.split(",")):
            got = triton_moe.align_by_expert(ids, num_experts, block_m, num_warps=warps)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (case, warps)
            times[warps] = gemv_tune.timed_us(lambda: triton_moe.align_by_expert(ids, num_experts, block_m,
                                                                                 num_warps=warps), args.iters)
        torch_us = gemv_tune.timed_us(lambda: triton_moe.align_by_expert_torch(ids, num_experts, block_m), args.iters)
        best = min(times, key=times.get)
        emit({**base, "slots": num_slots, "experts": num_experts, "block_m": block_m,
              "kernel_us": {str(w): round(t, 2) for w, t in times.items()}, "best_warps": best,
              "best_us": round(times[best], 2), "torch_us": round(torch_us, 2),
              "torch_over_best": round(torch_us / times[best], 3)})


if __name__ == "__main__":
    main()
