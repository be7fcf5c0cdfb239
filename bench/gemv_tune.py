"""The decode-sized GEMMs of ``common/kernels/triton_gemv.py`` over a sweep of tile configurations,
beside what they replace, in the same run.

    python bench/gemv_tune.py [--iters 50] [--quick]

Cases (one JSON line each), Llama-3.1-8B's projections and the two MoE presets' experts:
  fp8-row / fp8-block  an e4m3 weight [N, K] with per-row or 128 x 128 block scales times M rows
                       (--rows, default 1 to 128; the K split is swept too; --w8a8: past 16 rows
                       also with x quantized per token, the dot on FP8 tensor cores); baseline:
                       what the step ran before (per-token quant + torch._scaled_mm for per-row,
                       the Triton W8A8 block GEMM for block)
  bf16                 the same [N, K] in bf16 at M 1 through ``gemv`` (no scales);
                       baseline: cuBLAS (F.linear), what the bf16 step runs
  moe                  one sparse layer's experts for T tokens (T * k <= 32): ``moe_gemv`` (both
                       projections and the weighted sum); baseline: the grouped path (sort by
                       expert + two grouped GEMMs)
One-row configurations are swept with their columns summed every K step and once after the loop
(``late_sum``). Each line: the fastest configuration and its us and GB/s (bytes the case must read: the weight
once, or the experts the slots touch, over the time), the current default's, the baseline's, and
the HBM bandwidth of a 4 GiB device copy measured in this run (``hbm_gbps``, bytes read + written).
Every configuration's output is checked against the default's before it is timed. Times are of
--iters calls replayed in one CUDA graph, as a decode step runs them (launched from Python, every
call here would take the ~30-60 us of its launch instead). Each call reads the next of enough copies
of the weight that together they are three times L2 (``--cold``, the default): a decode step reads
each weight once, from HBM. With ``--hot`` the calls reread one copy, which a weight under L2's size
(50 MB on an H100) serves from L2 after the first call: the sweeps before tree 8b95ca1 timed that.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench._common import captured, emit, git_hash, hardware  # noqa: E402

DEVICE = "cuda"
DTYPE = torch.bfloat16  # float16 under the interpreter (--dry-run), which has no bfloat16
LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LM_HEAD = {"lm_head": (128256, 4096)}  # bf16 in the FP8 checkpoints too (their ignore lists keep it)
# the MoE presets' one-row bf16 projections outside the experts: Qwen3-30B-A3B's attention and lm_head, DeepSeek-V2-Lite's lm_head
MOE_DENSE = {"qwen3_qkv": (5120, 2048), "qwen3_o": (2048, 4096), "qwen3_lm_head": (151936, 2048),
             "dsv2_lm_head": (102400, 2048), "dsv2_qkv_a": (3648, 2048), "dsv2_o": (2048, 2048),
             "dsv2_gate_up": (21888, 2048), "dsv2_down": (2048, 10944)}
MOE = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408)}  # E, k, hidden, inter


COLD = True  # --hot: every call reads the same copy of its weight
TABLE = {"path": "", "min_gain": 0.03}  # --table-out, --table-min-gain


def table_entry(kind: str, rows: int, n: int, k: int, r: dict) -> None:
    """With --table-out, a swept shape whose best configuration beat the default by more than the
    minimum gain is merged into that file at once (a table ``gemv_tiles.read_table`` reads; an
    entry of the same shape is replaced), so a sweep cut short keeps what it measured."""
    from kvferry.common.kernels.gemv_tiles import read_table, table_key

    path = TABLE["path"]
    if not path or r["best_us"] >= r["default_us"] * (1 - TABLE["min_gain"]):
        return
    entries = {key: list(cfg) for key, cfg in (read_table(path) if Path(path).exists() else {}).items()}
    b = r["best"]
    entries[table_key(kind, rows, n, k)] = [b["block_n"], b["block_k"], b["num_warps"], b["num_stages"], b["split_k"],
                                            b["late_sum"]]
    lines = [json.dumps({"kind": kind, "rows": rows, "n": n, "k": k, "config": cfg})
             for (kind, rows, n, k), cfg in sorted(entries.items())]
    Path(path).write_text('{"entries": [\n' + ",\n".join(lines) + "\n]}\n")


def copies_of(t, nbytes: int) -> "Rotation":
    """A tensor (or a tuple of them) ``t`` and enough clones that ``nbytes`` (what one call reads)
    over all of them is 3x L2."""
    if not COLD or DEVICE == "cpu":
        return Rotation([t])
    l2 = torch.cuda.get_device_properties(DEVICE).L2_cache_size
    clone = (lambda: tuple(a.clone() for a in t)) if isinstance(t, tuple) else t.clone
    return Rotation([t] + [clone() for _ in range(-(-3 * l2 // max(1, nbytes)) - 1)])


class Rotation:
    """Calling it gives the next of its tensors, round robin: each captured call reads another copy."""

    def __init__(self, tensors: list) -> None:
        self.tensors, self.i = tensors, -1

    def __call__(self) -> torch.Tensor:
        self.i = (self.i + 1) % len(self.tensors)
        return self.tensors[self.i]


def timed_us(fn, iters: int) -> float:
    """Mean us per call of ``iters`` calls captured in one CUDA graph (a decode step's kernels run
    inside graphs: timing them launched from Python would time the launches, ~30-60 us each)."""
    if DEVICE == "cpu":  # --dry-run: the logic only, under Triton's interpreter
        fn()
        return 1.0
    graph = captured(fn, iters)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (3 * iters)


def hbm_gbps() -> float:
    if DEVICE == "cpu":
        return 0.0
    src = torch.empty(4 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    us = timed_us(lambda: dst.copy_(src), 5)
    return 2 * (4 << 30) / us / 1e3


def gemv_configs(dot: bool, quick: bool, rows: int = 1, narrow: bool = False, wide: bool = False):
    from kvferry.common.kernels.triton_gemv import GemvConfig

    splits, lates = (1,), (0,)
    if wide:  # the W8A8 dot past 16 rows: wider tiles, 8 warps, deeper K steps and pipelines
        ns, ks, warps, stages, splits = (64, 128, 256), (128, 256, 512), (4, 8), (3, 4), (1, 2, 4, 8)
    elif rows > 16:  # past 16 rows: wider weight tiles, K split over programs
        ns, ks, warps, stages, splits = (32, 64, 128), (128, 256), (4,), (3, 4), (1, 2, 4, 8)
        if narrow:  # the tiles that won a full sweep on an H100 (bench/RESULTS.md)
            ns, stages = (64, 128), (3,)
    elif dot:  # 256: per-row scales only
        ns, ks, warps, stages, splits = (16, 32, 64), (128, 256), (4,), (3, 4), (1, 2, 4)
    else:  # one row: its columns summed every K step or once after the loop (late_sum)
        ns, ks, warps, stages, lates = (4, 8, 16, 32), (256, 512, 1024), (4, 8), (3,) if quick else (3, 4), (0, 1)
    if quick:
        ns, ks, splits = ns[:2], ks[:2], splits[:2]
    return [GemvConfig(n, k, w, s, p, late)
            for n, k, w, s, p, late in itertools.product(ns, ks, warps, stages, splits, lates)]


def sweep(run, configs, default, nbytes: int, iters: int) -> dict:
    """run(config) -> output; the fastest of ``configs`` (each checked against the default's output)."""
    want = run(default)
    best = None
    for cfg in configs:
        try:
            got = run(cfg)
        except Exception as e:  # a configuration the compiler refuses (registers, shared memory)
            print(f"skip {cfg}: {type(e).__name__}: {e}"[:200], file=sys.stderr)
            continue
        if not torch.allclose(got.float(), want.float(), rtol=2**-6, atol=2**-6):
            raise AssertionError(f"configuration {cfg} disagrees with the default {default}")
        us = timed_us(lambda: run(cfg), iters)
        if best is None or us < best[1]:
            best = (cfg, us)
    default_us = timed_us(lambda: run(default), iters)
    return {"best": dict(best[0]._asdict()), "best_us": round(best[1], 2), "best_gbps": round(nbytes / best[1] / 1e3, 1),
            "default": dict(default._asdict()), "default_us": round(default_us, 2),
            "default_gbps": round(nbytes / default_us / 1e3, 1)}


def fp8_cases(args, base: dict) -> None:
    from kvferry.common.kernels import triton_fp8_gemm, triton_gemv
    from kvferry.common.layers import fp8

    blocks = [None if kind == "row" else 128 for kind in args.scales.split(",")]
    for (name, (n, k)), block, rows in itertools.product(_chosen(LLAMA_8B, args), blocks, map(int, args.rows.split(","))):
        w = (torch.randn(n, k, device=DEVICE) * 0.02)
        if block is None:
            q, scale = fp8.quantize_rows(w.cpu())
        else:
            q, scale_inv = fp8.quantize_blocks(w.cpu(), block)
            scale = scale_inv.repeat_interleave(block, dim=0)[:n]
        q, scale = q.to(DEVICE), scale.to(DEVICE).contiguous()
        x = torch.randn(rows, k, device=DEVICE, dtype=DTYPE)
        nbytes = q.numel() + scale.numel() * 4
        qs = copies_of(q, nbytes)
        if args.w8a8_wide and rows > 16 and block is None:
            w8a8_kernel_case(args, base, name, qs, scale, x, nbytes)
            continue
        default = triton_gemv.fp8_config(rows, n, k, block)
        configs = [c for c in gemv_configs(rows > 1, args.quick, rows, args.narrow)  # the dot path: one group a step;
                   if (rows == 1 or block is None or c.block_k == triton_gemv.GROUP)  # block scales: a sum a step
                   and not (block is not None and c.late_sum)]
        result = sweep(lambda cfg: triton_gemv.fp8_gemv(x, qs(), scale, block, None, cfg), configs, default, nbytes,
                       args.iters)
        if block is None:
            table_entry("fp8", rows, n, k, result)

            def baseline():
                xq, xs = triton_fp8_gemm.per_token_quant(x)
                return torch._scaled_mm(xq, qs().t(), scale_a=xs, scale_b=scale[None, :], out_dtype=DTYPE)
        else:
            def baseline():
                return triton_fp8_gemm.w8a8_block_linear(x, qs(), scale, block)
        base_us = timed_us(baseline, args.iters)
        emit({**base, "case": "fp8-row" if block is None else "fp8-block", "weight": name, "shape": [n, k],
              "rows": rows, "bytes": nbytes, **result, "baseline": "scaled_mm" if block is None else "w8a8_block",
              "baseline_us": round(base_us, 2), "baseline_gbps": round(nbytes / base_us / 1e3, 1),
              "speedup_vs_baseline": round(base_us / result["best_us"], 3)})
        if block is None and rows > 16 and args.w8a8:  # the same kernel with x quantized per token (FP8 dot)
            def w8a8(cfg):
                xq, xs = triton_fp8_gemm.per_token_quant(x)
                return triton_gemv.fp8_gemv(xq, qs(), scale, None, None, cfg, x_scale=xs, out_dtype=DTYPE)

            a8 = sweep(w8a8, configs, default, nbytes, args.iters)
            emit({**base, "case": "fp8-row-w8a8", "weight": name, "shape": [n, k], "rows": rows, "bytes": nbytes,
                  **a8, "baseline": "scaled_mm", "baseline_us": round(base_us, 2),
                  "speedup_vs_baseline": round(base_us / a8["best_us"], 3),
                  "speedup_vs_w8a16": round(result["best_us"] / a8["best_us"], 3),
                  "note": "best_us includes the per-token quant launch"})


def w8a8_kernel_case(args, base: dict, name: str, qs: Rotation, scale, x, nbytes: int) -> None:
    """The W8A8 dot alone (x quantized once, before: in the step the norms and silu hand it over
    quantized) over the wide tiles, beside the default; x's per-token quant is timed on its own."""
    from kvferry.common.kernels import triton_fp8_gemm, triton_gemv

    (n, k), rows = qs.tensors[0].shape, x.shape[0]
    xq, xs = triton_fp8_gemm.per_token_quant(x)
    default = triton_gemv.fp8_config(rows, n, k, None, fp8_x=True)
    result = sweep(lambda cfg: triton_gemv.fp8_gemv(xq, qs(), scale, None, None, cfg, x_scale=xs, out_dtype=DTYPE),
                   gemv_configs(True, args.quick, rows, wide=True), default, nbytes, args.iters)
    table_entry("fp8_x", rows, n, k, result)
    quant_us = timed_us(lambda: triton_fp8_gemm.per_token_quant(x), args.iters)
    emit({**base, "case": "fp8-row-w8a8-kernel", "weight": name, "shape": [n, k], "rows": rows, "bytes": nbytes,
          **result, "speedup_vs_default": round(result["default_us"] / result["best_us"], 3),
          "of_copy": round(nbytes / result["best_us"] / 1e3 / base["hbm_gbps"], 3) if base["hbm_gbps"] else 0.0,
          "quant_us": round(quant_us, 2)})


def bf16_cases(args, base: dict) -> None:
    from kvferry.common.kernels import triton_gemv

    for name, (n, k) in _chosen({**LLAMA_8B, **LM_HEAD, **MOE_DENSE}, args):
        w = torch.randn(n, k, device=DEVICE, dtype=DTYPE) * 0.02
        x = torch.randn(1, k, device=DEVICE, dtype=DTYPE)
        nbytes = w.numel() * 2
        ws = copies_of(w, nbytes)
        default = triton_gemv.dense_config(n, k)
        result = sweep(lambda cfg: triton_gemv.gemv(x, ws(), None, cfg), gemv_configs(False, args.quick), default,
                       nbytes, args.iters)
        table_entry("bf16", 1, n, k, result)
        base_us = timed_us(lambda: torch.nn.functional.linear(x, ws()), args.iters)
        emit({**base, "case": "bf16", "weight": name, "shape": [n, k], "rows": 1, "bytes": nbytes, **result,
              "baseline": "cublas", "baseline_us": round(base_us, 2), "baseline_gbps": round(nbytes / base_us / 1e3, 1),
              "speedup_vs_baseline": round(base_us / result["best_us"], 3)})


def _chosen(shapes: dict, args) -> list:
    """The (name, shape) items of ``shapes`` that --weights names (all without it)."""
    return [(name, shape) for name, shape in shapes.items() if not args.weights or name in args.weights.split(",")]


def moe_cases(args, base: dict) -> None:
    from kvferry.common.kernels import triton_gemv, triton_moe
    from kvferry.common.layers.moe import select_experts

    for (name, (experts, top_k, hidden, inter)), tokens in itertools.product(MOE.items(), map(int, args.tokens.split(","))):
        if tokens * top_k > triton_gemv.MOE_GEMV_MAX_SLOTS:
            continue
        w13 = torch.randn(experts, 2 * inter, hidden, device=DEVICE, dtype=DTYPE) * 0.02
        w2 = torch.randn(experts, hidden, inter, device=DEVICE, dtype=DTYPE) * 0.02
        x = torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE)
        weights, ids = select_experts(torch.randn(tokens, experts, device=DEVICE), top_k, True)
        weights = weights.to(DTYPE)
        touched = ids.unique().numel()
        nbytes = touched * (w13[0].numel() + w2[0].numel()) * 2
        pairs = copies_of((w13, w2), nbytes)
        for proj, (n, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
            default = triton_gemv.moe_config(n, k, silu=proj == "w2")  # the down makes silu(gate) * up

            def run(cfg, proj=proj):
                pair = (cfg, None) if proj == "w13" else (None, cfg)
                return triton_gemv.moe_gemv(x, *pairs(), weights, ids, pair)

            result = sweep(run, gemv_configs(False, args.quick), default,
                           touched * (n * k) * 2, args.iters)
            table_entry("moe", 1, n, k, result)
            emit({**base, "case": f"moe-{proj}", "preset": name, "shape": [experts, n, k], "tokens": tokens,
                  "top_k": top_k, "experts_touched": touched, **result,
                  "note": "best_us / default_us time the whole moe_gemv with this projection's configuration varied"})
        gemv_us = timed_us(lambda: triton_gemv.moe_gemv(x, *pairs(), weights, ids), args.iters)

        def grouped():  # fused_moe above MOE_GEMV_MAX_SLOTS: sort by expert, two grouped GEMMs
            num_slots = ids.numel()
            w13, w2 = pairs()
            up = triton_moe.gemm_config(2 * inter, hidden, num_slots, experts)
            down_cfg = triton_moe.gemm_config(hidden, inter, num_slots, experts)
            sorted_slots, block_experts = triton_moe.align_by_expert(ids, experts, up.block_m)
            gate_up = torch.empty(num_slots, 2 * inter, dtype=x.dtype, device=x.device)
            triton_moe._grouped_gemm(x, w13, gate_up, sorted_slots, block_experts, up, top_k, None)
            down = torch.empty(num_slots, hidden, dtype=torch.float32, device=x.device)
            triton_moe._grouped_gemm(triton_moe.silu_mul(gate_up), w2, down, sorted_slots, block_experts, down_cfg,
                                     1, weights.flatten().contiguous())
            return down.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)

        torch.testing.assert_close(grouped().float(), triton_gemv.moe_gemv(x, w13, w2, weights, ids).float(),
                                   rtol=2**-6, atol=2**-6)
        grouped_us = timed_us(grouped, args.iters)
        emit({**base, "case": "moe", "preset": name, "tokens": tokens, "top_k": top_k, "experts_touched": touched,
              "bytes": nbytes, "gemv_us": round(gemv_us, 2), "gemv_gbps": round(nbytes / gemv_us / 1e3, 1),
              "grouped_us": round(grouped_us, 2), "grouped_gbps": round(nbytes / grouped_us / 1e3, 1),
              "speedup_vs_grouped": round(grouped_us / gemv_us, 3)})


def main() -> None:
    global DEVICE, DTYPE, LLAMA_8B, LM_HEAD, MOE_DENSE, MOE, COLD
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="a few configurations only")
    ap.add_argument("--cases", default="fp8,bf16,moe")
    ap.add_argument("--rows", default="1,4,8,16,32,64,128", help="the fp8 cases' row counts")
    ap.add_argument("--weights", default="",
                    help="only these of qkv,o,gate_up,down and (bf16 cases only) lm_head," + ",".join(MOE_DENSE))
    ap.add_argument("--tokens", default="1,2,4", help="the moe cases' token counts")
    ap.add_argument("--scales", default="row,block", help="the fp8 cases' scale kinds: row, block or both")
    ap.add_argument("--narrow", action="store_true", help="past 16 rows, only the tiles that won the full sweep")
    ap.add_argument("--w8a8", action="store_true",
                    help="past 16 rows, also the GEMV with x quantized per token (fp8-row-w8a8 lines)")
    ap.add_argument("--w8a8-wide", action="store_true",
                    help="past 16 rows (per-row scales), only the W8A8 dot, its x quantized beforehand, over wider "
                         "tiles (fp8-row-w8a8-kernel lines)")
    ap.add_argument("--table-out", default="",
                    help="merge the shapes whose best tiles beat the default by more than --table-min-gain into this "
                         "tile table (KVFERRY_GEMV_TILES reads it: common/kernels/gemv_tiles.py)")
    ap.add_argument("--table-min-gain", type=float, default=0.03)
    ap.add_argument("--hot", action="store_true",
                    help="every call rereads one copy of its weight (L2 serves one under its size), as before")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on CPU under TRITON_INTERPRET=1 (set it): checks the logic, times nothing")
    args = ap.parse_args()
    COLD = not args.hot
    TABLE.update(path=args.table_out, min_gain=args.table_min_gain)
    if args.dry_run:
        DEVICE, DTYPE, args.quick, args.iters = "cpu", torch.float16, True, 1
        LLAMA_8B, LM_HEAD = {"qkv": (96, 256), "down": (64, 384)}, {"lm_head": (512, 128)}
        MOE_DENSE = {}
        MOE = {"tiny": (8, 4, 64, 48)}
    elif not torch.cuda.is_available():
        raise SystemExit("bench/gemv_tune.py times CUDA kernels; no CUDA device here")
    torch.manual_seed(0)
    base = {"bench": "gemv_tune", "git": git_hash(), "hardware": hardware([DEVICE if DEVICE == "cpu" else "cuda:0"]),
            "hbm_gbps": round(hbm_gbps(), 1), "l2": "hot" if args.hot else "cold"}
    cases = args.cases.split(",")
    if "fp8" in cases:
        fp8_cases(args, base)
    if "bf16" in cases:
        bf16_cases(args, base)
    if "moe" in cases:
        moe_cases(args, base)


if __name__ == "__main__":
    main()
