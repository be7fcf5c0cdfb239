"""What asking L2 for a weight during an idle window saves the GEMV after it.

    python bench/l2_prefetch.py [--windows-us 3,8,20] [--reps 10]

One CUDA graph a case repeats: a read of a 256 MiB buffer (L2 then holds none of the weight), a
window in which HBM is idle (``torch.cuda._sleep``, as a decode step's norms, rope and attention
over a short context are), then the GEMV a decode step runs over that weight. The variants differ
only in who asks L2 for the weight during the window:
  none             nobody (what the step does today);
  bulk-G           ``prefetch`` on a side stream forked before the window, about G programs, one
                   ``cp.async.bulk.prefetch.L2`` a thread;
  line-G           the same, a ``prefetch.global.L2`` per 128-byte line;
  inline-bulk-G    ``prefetch`` launched in the main stream before the window (no fork).
Cases: one-row bf16 GEMVs (``triton_gemv.gemv``) of DeepSeek-V2-Lite's o_proj and fused q/kv_a and
of 32 MiB, and the 8B FP8 step's W8A8 q/k/v and down at 64 rows (``fp8_gemv`` with x per token).
``prefetch_mib`` caps what is asked (the whole weight unless the case says). One JSON line a case
and window: each variant's µs a repetition, the GEMV's share (minus the same graph without the
GEMV) and what it saved against ``none``, side by side in one process.

Why: a batch-1 decode step alternates weight-streaming GEMVs with small kernels (norms, rope,
attention over a short context, routing) during which HBM is mostly idle; a weight whose address
is known at capture could be asked of L2 then. On an H100 (bench/RESULTS.md, "Weights asked of L2")
it saved 0-3 µs a GEMV, too little for the step: the step does not use it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench._common import captured, emit, git_hash, hardware  # noqa: E402

MIB = 1 << 20
LANES = 32  # shares a program asks for: one a thread of its one warp


@triton.jit
def _l2_prefetch_kernel(base, nbytes, PIECE: tl.constexpr, BULK: tl.constexpr):
    """Program p asks L2 for bytes [s, s + PIECE) of ``base`` for its LANES shares s; the last share
    is cut at ``nbytes`` (a multiple of 16); shares past it ask again for the first line."""
    starts = (tl.program_id(0) * 32 + tl.arange(0, 32)).to(tl.int64) * PIECE
    ok = starts < nbytes
    ptrs = tl.where(ok, base + starts, base)
    if BULK:
        size = tl.where(ok, tl.minimum(nbytes - starts, PIECE), 16).to(tl.int32)
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                  [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        for off in range(0, PIECE, 128):
            p = tl.where(ok & (starts + off < nbytes), ptrs + off, base)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                                      is_pure=False, pack=1)


def plan(nbytes: int, programs: int) -> tuple[int, int]:
    """(piece bytes, programs) that cover ``nbytes`` with about ``programs`` programs of LANES pieces
    each: a piece is a multiple of 4 KiB, at least one."""
    if nbytes <= 0 or programs <= 0:
        raise ValueError(f"l2_prefetch.plan: nbytes {nbytes} and programs {programs} must be positive")
    piece = max(4096, triton.cdiv(triton.cdiv(nbytes, programs * LANES), 4096) * 4096)
    return piece, triton.cdiv(nbytes, piece * LANES)


def prefetch(t: torch.Tensor, nbytes: int | None = None, programs: int = 32, bulk: bool = True) -> None:
    """Asks L2 for the first ``nbytes`` (default all, rounded down to 16) of ``t``'s storage from
    ``programs`` programs (about), on the current stream. ``t`` must be contiguous."""
    if not t.is_contiguous():
        raise ValueError("l2_prefetch.prefetch: the tensor must be contiguous")
    total = t.numel() * t.element_size()
    nbytes = min(total if nbytes is None else nbytes, total) // 16 * 16
    if nbytes <= 0:
        return
    piece, grid = plan(nbytes, programs)
    _l2_prefetch_kernel[(grid,)](t.view(-1).view(torch.uint8), nbytes, PIECE=piece, BULK=bulk, num_warps=1)


def graph_us(body, reps: int, replays: int = 7) -> float:
    """Median µs of one ``body()`` over ``replays`` replays of a graph of ``reps`` bodies."""
    graph = captured(body, reps)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return statistics.median(times)


def sleep_cycles_per_us() -> float:
    """torch.cuda._sleep's cycles a µs on this GPU, from a graph of long sleeps."""
    cycles = 2_000_000
    return cycles / graph_us(lambda: torch.cuda._sleep(cycles), 3)


def cases(device: torch.device):
    from kvferry.common.kernels import triton_gemv
    from kvferry.common.kernels.triton_fp8_gemm import per_token_quant

    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in {"dsv2_o": (2048, 2048), "dsv2_qkv_a": (3648, 2048), "bf16_32mib": (8192, 2048)}.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16, generator=gen)
        yield name, w, None, (lambda w=w, x=x: triton_gemv.gemv(x, w))
    for name, (n, k), cap in (("fp8_qkv_64", (6144, 4096), None), ("fp8_down_64", (4096, 14336), 24 * MIB)):
        w = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(torch.float8_e4m3fn)
        scale = torch.rand(n, device=device, generator=gen) * 0.01 + 0.01
        xq, xs = per_token_quant(torch.randn(64, k, device=device, dtype=torch.bfloat16, generator=gen))
        yield name, w, cap, (lambda w=w, s=scale, xq=xq, xs=xs: triton_gemv.fp8_gemv(
            xq, w, s, None, x_scale=xs, out_dtype=torch.bfloat16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows-us", default="3,8,20")
    ap.add_argument("--programs", default="8,32,132")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    device = torch.device("cuda")
    flush_buf = torch.ones(256 * MIB // 4, device=device)
    sink = torch.empty((), device=device)
    side = torch.cuda.Stream()
    per_us = sleep_cycles_per_us()
    programs = [int(p) for p in args.programs.split(",")]

    def flush():
        torch.amax(flush_buf, dim=0, out=sink)

    for name, w, cap, run in cases(device):
        nbytes = w.numel() * w.element_size() if cap is None else min(cap, w.numel() * w.element_size())
        for window in (float(v) for v in args.windows_us.split(",")):
            cycles = max(1, int(window * per_us))

            def body(ask=None, inline=False):
                flush()
                if ask is not None and inline:
                    ask()
                elif ask is not None:
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        ask()
                torch.cuda._sleep(cycles)
                run()
                if ask is not None and not inline:
                    torch.cuda.current_stream().wait_stream(side)

            def idle():
                flush()
                torch.cuda._sleep(cycles)

            variants = {"none": lambda: body()}
            for g in programs:
                variants[f"bulk-{g}"] = lambda g=g: body(lambda: prefetch(w, nbytes, g))
                variants[f"line-{g}"] = lambda g=g: body(lambda: prefetch(w, nbytes, g, bulk=False))
            variants[f"inline-bulk-{programs[-1]}"] = lambda: body(lambda: prefetch(w, nbytes, programs[-1]), True)
            base_us = graph_us(idle, args.reps)
            us = {v: graph_us(fn, args.reps) for v, fn in variants.items()}
            gemv_us = {v: round(t - base_us, 2) for v, t in us.items()}
            emit({"bench": "l2_prefetch", "case": name, "weight_mib": round(w.numel() * w.element_size() / MIB, 2),
                  "prefetch_mib": round(nbytes / MIB, 2), "window_us": window, "idle_us": round(base_us, 2),
                  "gemv_us": gemv_us, "saved_us": {v: round(gemv_us["none"] - t, 2) for v, t in gemv_us.items()},
                  "git": git_hash(), "hw": hardware(["cuda:0"])})


if __name__ == "__main__":
    main()
