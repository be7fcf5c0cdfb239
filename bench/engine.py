"""Engine speed on one device against its own roofline, measured in the same run.

    python bench/engine.py --model DIR [--batches 1,8,32,64,128] [--contexts 1024,8192]
        [--prefill 1024,8192,32768] [--attention-backend auto] [--disable-cuda-graph] [--kv-cache-dtype fp8_e4m3]
        [--fp8-gemv-rows 16,64] [--profile 1,64]

Decode: ``batch`` sequences whose ``context_tokens`` are already in the KV pool (pages allocated,
contents left as they are: the cost of a step does not depend on them) run ``--steps`` plain greedy
decode steps through ``ModelRunner.decode`` (forward, sampling, the host sync: ``step_ms``), then
as many overlapped, as the decode daemon runs them (``launch_decode`` of step N+1, fed on the
device, before step N's tokens are read: ``step_ms_overlap``, of which the host spent
``launch_ms_overlap`` launching each step). The roofline is the
bytes a step must read (weights, without the embedding table, plus the context's K/V) over the
HBM bandwidth of a large device-to-device copy (bytes read + written per second); for a MoE model
the weights are the dense ones plus, per sparse layer, the experts a batch touches in expectation
(``bench/_roofline.py``; the rows name the count and its source), and beside it the roofline of
the experts the router actually chose for the batch (``experts_routed_per_layer``, from one eager
step: a random checkpoint's router sends a batch to fewer experts than uniform routing). Prefill: one prompt through
``ModelRunner.prefill``; TFLOP/s (2 x weights each token multiplies through x tokens + causal
attention) against a large bf16 matmul, or for an FP8 checkpoint against an FP8 ``torch._scaled_mm``
of the same size (both measured every run: ``matmul_tflops``, ``fp8_matmul_tflops``). FP8 weights
count one byte per element plus their fp32 scales, an FP8 KV pool one byte per element. One JSON
line per configuration; combinations whose KV does not fit are skipped with a line saying so.

``--fp8-gemv-rows`` (FP8 checkpoints): the decode steps again for each bound on the rows that
``fp8.fp8_linear`` sends to the weight-only GEMV (graphs recaptured; the line's
``fp8_gemv_max_rows``), side by side with the default. ``--profile`` adds, for those batches at the
first context, one line of the CUDA kernels of a decode step (``torch.profiler`` over graph
replays): per kernel name its µs and launches per step, the last step's launches in order with each one's
µs (``step_launches``), and the step's kernel time against its wall time (the gap is launch latency
and idle). ``--pdl-ab`` reruns every case with the Triton kernels'
programmatic dependent launch in order 2 and off (``pdl`` on each line: 1 the default, 2, 0 off);
with PDL a kernel's profiled time includes its wait for the kernel before it.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, git_hash, hardware  # noqa: E402
from bench._engine_switches import AB_SWITCHES, hot_sweep_configs, other_side, recapture, switched  # noqa: E402
from bench._roofline import (WeightBytes, active_params_per_token, decode_roofline_ms,  # noqa: E402
                            decode_weight_bytes, moe_decode_fields, split_weights)


def ceilings(device) -> tuple[float, float, float]:
    """(HBM GB/s from a 4 GiB copy, bf16 matmul TFLOP/s at 8192^3, FP8 (e4m3, row-wise scales,
    bf16 out) ``torch._scaled_mm`` TFLOP/s at 8192^3)."""
    import torch

    src = torch.empty(4 << 30, dtype=torch.uint8, device=device)
    dst, a = torch.empty_like(src), torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    copy_ms = timed(lambda: dst.copy_(src), 10)
    matmul_ms = timed(lambda: a @ a, 20)
    a8 = a.to(torch.float8_e4m3fn)
    b8 = a8.t()  # column-major, as _scaled_mm wants its second operand
    sa = torch.ones(8192, 1, device=device, dtype=torch.float32)
    sb = torch.ones(1, 8192, device=device, dtype=torch.float32)
    fp8_ms = timed(lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), 20)
    return 2 * (4 << 30) / copy_ms / 1e6, 2 * 8192**3 / matmul_ms / 1e9, 2 * 8192**3 / fp8_ms / 1e9


def timed(fn, iters: int) -> float:
    """Mean ms per call after one warm-up, by CUDA events."""
    import torch

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def last_token(seq) -> int:
    """The token a sequence decodes next in the timed steps: a different one per sequence, so that a
    MoE router sees a batch of distinct tokens (one shared token sends the whole batch to the same
    experts: the step then reads k experts a layer, not the batch's spread)."""
    return (13 * int(seq.request_id[1:]) + 11) % 500 + 5


def sequences(runner, batch: int, context: int, new_tokens: int):
    from kvferry.common.engine.sequence import Sequence
    from kvferry.common.sampling.sampler import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(f"b{i}", [(7 * i + j) % 500 + 5 for j in range(context)], params) for i in range(batch)]
    for s in seqs:
        runner.admit(s)
    return seqs


def decode_case(runner, a, batch: int, context: int, weights: WeightBytes, kv_token_bytes: int, bw: float) -> dict:
    seqs = sequences(runner, batch, context, a.steps + 8)
    for s in seqs:
        s.num_cached, s.output_ids = context, [last_token(s)]
    runner.decode(seqs)  # warm-up
    touched = routed_experts(runner, seqs) if weights.is_moe else None
    started = time.perf_counter()
    for _ in range(a.steps):
        runner.decode(seqs)  # each step ends in a host sync (the sampled tokens)
    step_ms = (time.perf_counter() - started) * 1e3 / a.steps
    for s in seqs:
        s.num_cached, s.output_ids = context, [last_token(s)]
    overlap_ms, launch_ms = overlapped_ms(runner, seqs, a.steps)
    for s in seqs:
        runner.release(s)
    kv_bytes = batch * (context + a.steps) * kv_token_bytes
    roofline_ms = decode_roofline_ms(weights, batch, kv_bytes, bw)
    routed = {}
    if touched is not None:  # the experts this batch's router chose (random weights route unevenly)
        routed_ms = (decode_weight_bytes(weights, touched) + kv_bytes) / bw / 1e6
        routed = {"experts_routed_per_layer": round(touched, 2), "roofline_ms_routed": round(routed_ms, 3),
                  "ratio_overlap_vs_routed_roofline": round(overlap_ms / routed_ms, 3)}
    return {"mode": "decode", "batch": batch, "context_tokens": context, "step_ms": round(step_ms, 3),
            "roofline_ms": round(roofline_ms, 3), **moe_decode_fields(weights, batch), **routed,
            "ratio_vs_roofline": round(step_ms / roofline_ms, 3),
            "tokens_per_s": round(batch * 1e3 / step_ms, 1), "step_ms_overlap": round(overlap_ms, 3),
            "launch_ms_overlap": round(launch_ms, 3),
            "ratio_overlap_vs_roofline": round(overlap_ms / roofline_ms, 3),
            "tokens_per_s_overlap": round(batch * 1e3 / overlap_ms, 1)}


def routed_experts(runner, seqs) -> float | None:
    """The mean number of distinct experts a sparse layer's router picks for ``seqs``' next tokens,
    from one eager step (graphs set aside) with ``select_experts`` observed; None when the model
    routes elsewhere (DeepSeek-V3's grouped router)."""
    attn, target = runner.target.model.attn, runner.target
    counts = []
    select = attn.select_experts

    def observed(logits, top_k, *args, **kwargs):
        weights, ids = select(logits, top_k, *args, **kwargs)
        counts.append(ids[:, :top_k].unique().numel())  # the routed ones (DeepSeek's shared experts follow)
        return weights, ids

    attn.select_experts, graphs, target.graphs = observed, target.graphs, []
    try:
        runner.decode(seqs)
    finally:
        del attn.select_experts  # the class's method again
        target.graphs = graphs
    return sum(counts) / len(counts) if counts else None


def overlapped_ms(runner, seqs, steps: int) -> tuple[float, float]:
    """(ms per step when step N+1 is launched before step N's tokens are read (the batcher's loop),
    ms of it the host spends launching a step). A launch close to the step means the host bounds it:
    the GPU waits for the next step's inputs and kernels."""
    prev = runner.launch_decode(seqs)  # warm-up step, read inside the timing like any other
    launching = 0.0
    started = time.perf_counter()
    for _ in range(steps):
        at = time.perf_counter()
        step = runner.launch_decode(seqs, prev)
        launching += time.perf_counter() - at
        for s, pairs in zip(seqs, prev.result()):
            s.output_ids.append(pairs[0][0])
        prev = step
    prev.result()
    return (time.perf_counter() - started) * 1e3 / steps, launching * 1e3 / steps


def prefill_case(runner, tokens: int, num_params: int, cfg, peak: float) -> dict:
    """``num_params``: the parameters each token multiplies through (a MoE token: its top-k experts)."""
    import torch

    times = []
    for _ in range(3):  # the first is the warm-up
        seq = sequences(runner, 1, tokens, 1)[0]
        torch.cuda.synchronize()
        started = time.perf_counter()
        runner.prefill([seq])  # ends with a device sync
        times.append(time.perf_counter() - started)
        runner.release(seq)
    seconds = min(times[1:])
    # causal attention: QK over the key width and PV over the value width, their mean standing for
    # head_dim. MLA counts the model's own FLOPs, the expanded form's (q/k nope + rope, v per head:
    # what the prefill runs, common/layers/mla.py), not the absorbed form's 576/512-wide latent
    # attention, which would credit work the prefill no longer does
    attn_dim = (cfg.head_dim if cfg.deepseek is None
                else (cfg.deepseek.qk_head_dim + cfg.deepseek.v_head_dim) / 2)
    flops = 2 * num_params * tokens + 2 * cfg.num_hidden_layers * tokens**2 * cfg.num_attention_heads * attn_dim
    tflops = flops / seconds / 1e12
    return {"mode": "prefill", "batch": 1, "context_tokens": tokens, "step_ms": round(seconds * 1e3, 2),
            "tflops": round(tflops, 1), "ratio_vs_matmul_peak": round(tflops / peak, 3),
            "tokens_per_s": round(tokens / seconds, 1)}


def gemv_cases(model) -> list[dict]:
    """One row through each projection of the first layer that has it (a MoE model's dense MLP may
    sit past layer 0, or nowhere: then no MLP rows): cuBLAS (F.linear) against the Triton GEMV."""
    import torch

    from kvferry.common.kernels import triton_gemv

    out = []
    for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
        weight = next((w for w in (getattr(layer, name, None) for layer in model.layers) if w is not None), None)
        if weight is None:
            continue
        x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
        nbytes = weight.numel() * weight.element_size()
        cublas_ms = timed(lambda: torch.nn.functional.linear(x, weight), 50)
        triton_ms = timed(lambda: triton_gemv.gemv(x, weight), 50)
        out.append({"mode": "gemv", "weight": name, "shape": list(weight.shape),
                    "cublas_us": round(cublas_ms * 1e3, 1), "triton_us": round(triton_ms * 1e3, 1),
                    "cublas_gb_s": round(nbytes / cublas_ms / 1e6), "triton_gb_s": round(nbytes / triton_ms / 1e6)})
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--prefill", default="1024,8192,32768")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kv-budget-gib", type=float, default=80.0, help="KV pool size")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--fp8-gemv-rows", default="",
                    help="FP8 checkpoints: decode again with each of these bounds on the weight-only GEMV's rows")
    ap.add_argument("--fp8-unfused-quant", action="store_true",
                    help="FP8 per-channel checkpoints: decode (and profile, prefill) again with the per-token quant "
                         "as its own kernel, not fused into the norms and silu (fp8.FUSE_TOKEN_QUANT off)")
    ap.add_argument("--moe-align-torch", action="store_true",
                    help="MoE models: decode (and profile, prefill) again with the slots sorted by torch ops "
                         "instead of the one-launch counting sort (triton_moe.ALIGN_KERNEL_MAX_SLOTS 0)")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="decode (and profile, prefill) again with the Triton kernels' programmatic dependent launch "
                         "in order 2 (each lets the next be scheduled, then waits; the GEMV prefetches weights "
                         "meanwhile) and off, side by side with the default (order 1: kernels.pdl)")
    ap.add_argument("--greedy-graph-ab", action="store_true",
                    help="decode (and profile) again with the greedy picks made by torch ops after the graph, side by "
                         "side with the default (picked in the decode graph's greedy head: ModelRunner.greedy_in_graph)")
    ap.add_argument("--gemv-configs-ab", action="store_true",
                    help="decode (and profile) again with the GEMV tiles of tree 6c7418e (swept with the weights "
                         "reread out of L2: triton_gemv.fp8_config / dense_config / moe_config), side by side with the "
                         "current ones")
    ap.add_argument("--gemv-table-ab", action="store_true",
                    help="with a tile table in KVFERRY_GEMV_TILES: decode (and profile) again with the tile rules "
                         "alone (gemv_tiles' rules, the table set aside), side by side with the table's tiles")
    ap.add_argument("--attn-tiles-ab", action="store_true",
                    help="decode (and profile) again with the decode attention's split count and tiles of tree d8d7159 "
                         "(4 programs per SM, 64 keys a step, 2 stages, always merged), side by side with the current ones")
    for flag, (_, _, _, what) in AB_SWITCHES.items():
        ap.add_argument(f"--{flag.replace('_', '-')}-ab", action="store_true",
                        help=f"decode (and profile) again with {what}, side by side with the default")
    ap.add_argument("--moe-align-warps", type=int, default=0, help="warps of the one-launch slot sort (triton_moe.ALIGN_WARPS)")
    ap.add_argument("--silu-quant-config", default="",
                    help="BLOCK,WARPS of the silu kernel that also quantizes (triton_fused.SILU_QUANT_BLOCK/_WARPS)")
    ap.add_argument("--profile", default="", help="batches whose decode step's CUDA kernels to list (first context)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3"),
                    help="the KV pool's dtype (fp8_e4m3: one byte per element, the roofline counts it so)")
    return ap.parse_args()


def profile_case(runner, batch: int, context: int, steps: int = 10, limit: int = 25) -> dict:
    """The CUDA kernels of ``steps`` plain decode steps, per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    seqs = sequences(runner, batch, context, steps + 16)
    for s in seqs:
        s.num_cached, s.output_ids = context, [last_token(s)]
    for _ in range(3):
        runner.decode(seqs)
    torch.cuda.synchronize()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.decode(seqs)
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - started) * 1e6 / steps
    for s in seqs:
        runner.release(s)
    rows = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                  key=lambda e: -e.self_device_time_total)
    # the last step's launches in stream order (name, µs): which GEMV of a layer runs below the bandwidth
    done = sorted((e for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU),
                  key=lambda e: e.time_range.start)
    last = done[len(done) - len(done) // steps:]
    total = sum(e.self_device_time_total for e in rows) / steps
    launches = sum(e.count for e in rows) / steps
    return {"mode": "profile", "batch": batch, "context_tokens": context, "steps": steps,
            "wall_us_per_step": round(wall_us, 1), "kernel_us_per_step": round(total, 1),
            "launches_per_step": round(launches, 1),
            "kernels": [[e.key[:90], round(e.self_device_time_total / steps, 1), round(e.count / steps, 1)]
                        for e in rows[:limit]],
            "step_launches": [[e.name[:32], round(e.time_range.elapsed_us(), 1)] for e in last]}


def with_fp8_gemv_rows(runner, a, base: dict, weights: WeightBytes, kv_token_bytes: int, bw: float,
                       max_tokens: int) -> None:
    """The decode steps again for each bound of ``--fp8-gemv-rows`` (graphs recaptured), then the default back."""
    from kvferry.common.layers import fp8

    for rows in map(int, a.fp8_gemv_rows.split(",")):
        with switched(runner, fp8, "FP8_GEMV_MAX_ROWS", rows):
            recapture(runner)
            decode_cases(runner, a, {**base, "fp8_gemv_max_rows": rows}, weights, kv_token_bytes, bw, max_tokens)


def rerun(runner, a, base: dict, weights: WeightBytes, kv_token_bytes: int, bw: float, max_tokens: int,
          prefill_peak: float) -> None:
    """The decode steps, profiles and prefills again (graphs recaptured first), each line with ``base``:
    for a switch set before the call (``--fp8-unfused-quant``, ``--moe-align-torch``)."""
    recapture(runner)
    decode_cases(runner, a, base, weights, kv_token_bytes, bw, max_tokens)
    profile_and_prefill_cases(runner, a, base, weights, prefill_peak)


def decode_cases(runner, a, base: dict, weights: WeightBytes, kv_token_bytes: int, bw: float, max_tokens: int,
                 say_skipped: bool = False) -> None:
    """One line per --contexts x --batches decode case the pool holds (a "skipped" line for the others
    when ``say_skipped``)."""
    for context in map(int, a.contexts.split(",")):
        for batch in map(int, a.batches.split(",")):
            if batch * (context + a.steps + 24) <= max_tokens:
                emit({**base, **decode_case(runner, a, batch, context, weights, kv_token_bytes, bw)})
            elif say_skipped:
                emit({**base, "mode": "decode", "batch": batch, "context_tokens": context,
                      "skipped": f"needs {batch * context} KV tokens, the pool holds {max_tokens}"})


def profile_and_prefill_cases(runner, a, base: dict, weights: WeightBytes, prefill_peak: float) -> None:
    """One line per --profile batch (a decode step's kernels) and per --prefill length."""
    for batch in (map(int, a.profile.split(",")) if a.profile else []):
        emit({**base, **profile_case(runner, batch, int(a.contexts.split(",")[0]))})
    for tokens in (map(int, a.prefill.split(",")) if a.prefill else []):
        emit({**base, **prefill_case(runner, tokens, active_params_per_token(weights), runner.target.model.config,
                                     prefill_peak)})


def with_gemv(runner, a, base: dict, weights: WeightBytes, kv_token_bytes: int, bw: float) -> None:
    """Batch 1 again with the other choice for every one-row bf16 projection (graphs recaptured):
    cuBLAS when the backend runs the Triton GEMV (its CUDA default), else the GEMV. ``"gemv"`` says
    which one the line ran."""
    attn = runner.target.model.attn
    with switched(runner, attn, "use_gemv", not attn.use_gemv):
        recapture(runner)
        for context in map(int, a.contexts.split(",")):
            emit({**base, "gemv": attn.use_gemv, **decode_case(runner, a, 1, context, weights, kv_token_bytes, bw)})


def main() -> None:
    a = parse_args()
    import torch

    from kvferry.common.engine.factory import build_runner
    from kvferry.common.models.config import ModelConfig
    from kvferry.common.kernels import pdl

    if not a.device.startswith("cuda") or not torch.cuda.is_available():
        raise SystemExit(f"bench/engine.py measures a CUDA device against its roofline; got --device {a.device}")
    torch.manual_seed(0)
    bw, peak, fp8_peak = ceilings(a.device)
    cfg = ModelConfig.from_dir(a.model)
    elem_bytes = 1 if a.kv_cache_dtype == "fp8_e4m3" else torch.empty(0, dtype=getattr(torch, a.dtype)).element_size()
    # K and V per layer; an MLA model (DeepSeek) one latent row of kv_lora_rank + qk_rope_head_dim per layer
    per_layer = cfg.deepseek.latent_width if cfg.deepseek is not None else 2 * cfg.num_key_value_heads * cfg.head_dim
    kv_token_bytes = cfg.num_hidden_layers * per_layer * elem_bytes
    max_tokens = int(a.kv_budget_gib * 2**30 // kv_token_bytes)
    if a.moe_align_warps:
        from kvferry.common.kernels import triton_moe

        triton_moe.ALIGN_WARPS = a.moe_align_warps
    if a.silu_quant_config:
        from kvferry.common.kernels import triton_fused

        triton_fused.SILU_QUANT_BLOCK, triton_fused.SILU_QUANT_WARPS = map(int, a.silu_quant_config.split(","))
    started = time.perf_counter()
    runner = build_runner(a.model, device=a.device, dtype=a.dtype, max_total_tokens=max_tokens,
                          attention_backend=a.attention_backend, disable_cuda_graph=a.disable_cuda_graph,
                          kv_cache_dtype=a.kv_cache_dtype)
    model = runner.target.model
    weight_format = "bf16" if model.config.quantization is None else f"fp8-{model.config.quantization.strategy.value}"
    base = {"bench": "engine", "device": a.device, "dtype": a.dtype, "weights": weight_format,
            "kv_cache_dtype": runner.target.kv.kv_dtype, "attention_backend": model.attn.name,
            "cuda_graph": bool(runner.target.graphs), "startup_s": round(time.perf_counter() - started, 1),
            "capture_s": round(sum(g.capture_s for g in runner.target.graphs), 2),
            "hbm_gb_s": round(bw, 1), "matmul_tflops": round(peak, 1), "fp8_matmul_tflops": round(fp8_peak, 1),
            "model": Path(a.model).name,
            "hw": hardware([a.device]), "git": git_hash(), "pdl": pdl.mode()}
    plain = model.config.quantization is None  # the Triton GEMV reads bf16 weights
    from kvferry.common.layers import fp8

    fp8_rows = fp8.FP8_GEMV_MAX_ROWS
    if not plain:
        base["fp8_fuse_quant"] = fp8.FUSE_TOKEN_QUANT
    if model.attn.name == "triton" and plain:
        for record in gemv_cases(model):
            emit({**base, **record})
    moe = model.config.moe
    if a.moe_align_torch:
        base["moe_align"] = "kernel"
    if a.greedy_graph_ab:
        base["greedy"] = "graph"
    if a.gemv_configs_ab:
        base["gemv_configs"] = "cold"
    if a.attn_tiles_ab:
        base["attn_tiles"] = "sweep"
    if a.gemv_table_ab:
        base["gemv_tiles"] = "table"
    for flag, (key, default, _, _) in AB_SWITCHES.items():
        if getattr(a, f"{flag}_ab"):
            base[key] = default
    # FP8 linears keep their e4m3 weight and fp32 scales as buffers (common/layers/fp8.py): the bytes a step reads
    tensors = [*model.named_parameters(), *model.named_buffers()]
    weights = split_weights([(name, p.numel(), p.element_size()) for name, p in tensors
                             if name != "embed" or model.config.has_tied_embeddings],
                            *((moe.num_experts, moe.num_experts_per_tok, 0) if moe else
                              (ds.n_routed_experts, ds.num_experts_per_tok, ds.n_shared_experts)
                              if (ds := model.config.deepseek) else (0, 0, 0)))
    # A process's first decode reading, right after the graphs are captured, reads high (7-25 % on an H100, whatever
    # the batch: bench/RESULTS.md, "first reading"): one is taken and dropped before any case is emitted.
    first = int(a.batches.split(",")[0]), int(a.contexts.split(",")[0])
    if first[0] * (first[1] + a.steps + 24) <= max_tokens:
        decode_case(runner, a, *first, weights, kv_token_bytes, bw)
    decode_cases(runner, a, {**base, **({"fp8_gemv_max_rows": fp8_rows} if not plain else {})}, weights,
                 kv_token_bytes, bw, max_tokens, say_skipped=True)
    if model.attn.name == "triton" and runner.target.graphs and plain:
        with_gemv(runner, a, base, weights, kv_token_bytes, bw)
    if a.fp8_gemv_rows and not plain:
        with_fp8_gemv_rows(runner, a, base, weights, kv_token_bytes, bw, max_tokens)
    prefill_peak = peak if plain else fp8_peak  # against the peak of the GEMMs the weights run on
    profile_and_prefill_cases(runner, a, base, weights, prefill_peak)
    again = (weights, kv_token_bytes, bw, max_tokens, prefill_peak)
    if a.fp8_unfused_quant and not plain:  # the per-token quant as its own launch, not in the norms and silu
        with switched(runner, fp8, "FUSE_TOKEN_QUANT", False):
            rerun(runner, a, {**base, "fp8_fuse_quant": False}, *again)
    if a.pdl_ab and pdl.enabled():  # order 2, then every kernel launched plainly: each grid waits for the last
        for on, early in ((True, True), (False, False)):
            pdl.set_enabled(on, early=early)
            rerun(runner, a, {**base, "pdl": pdl.mode()}, *again)
        pdl.set_enabled(None)
        recapture(runner)
    if a.gemv_configs_ab:  # the GEMV tiles as the sweeps that read weights out of L2 chose them
        from kvferry.common.kernels import triton_gemv, triton_moe

        old = hot_sweep_configs()
        with switched(runner, triton_gemv, "moe_config", old["moe_config"]), \
                switched(runner, triton_gemv, "fp8_config", old["fp8_config"], False), \
                switched(runner, triton_moe, "dense_config", old["dense_config"], False), \
                switched(runner, triton_gemv, "dense_config", old["dense_config"], False):  # the outer one recaptures
            rerun(runner, a, {**base, "gemv_configs": "hot"}, *again)
    if a.gemv_table_ab:  # the rules alone: from_table finds no entry in an empty table
        from kvferry.common.kernels import gemv_tiles

        with switched(runner, gemv_tiles, "_table", {}):
            rerun(runner, a, {**base, "gemv_tiles": "rules"}, *again)
    if a.attn_tiles_ab and model.attn.name == "triton":  # the split count and tiles before the attention sweep
        from kvferry.common.kernels import triton_attention as ta

        with switched(runner, ta, "num_decode_splits", functools.partial(ta.num_decode_splits, per_sm=4)), \
                switched(runner, ta, "decode_tiles", lambda block_d, splits: ta.DecodeTiles(32 if block_d > 128 else 64)):
            rerun(runner, a, {**base, "attn_tiles": "d8d7159"}, *again)
    switches_run = False  # the graphs are captured again once, after the last switch is undone
    for flag, (key, _, other, _) in AB_SWITCHES.items():
        settings = other_side(flag, model) if getattr(a, f"{flag}_ab") else []
        if settings:
            with ExitStack() as stack:
                for owner, name, value in settings:
                    stack.enter_context(switched(runner, owner, name, value, again=False))
                rerun(runner, a, {**base, key: other}, *again)
            switches_run = True
    if switches_run:
        recapture(runner)
    if a.greedy_graph_ab and runner.target.graphs:  # the greedy picks by torch ops after each replay
        with switched(runner, runner, "greedy_in_graph", False):
            rerun(runner, a, {**base, "greedy": "torch"}, *again)
    if a.moe_align_torch and (moe or model.config.deepseek):  # the slots sorted by torch ops, not _align_kernel
        from kvferry.common.kernels import triton_moe

        with switched(runner, triton_moe, "ALIGN_KERNEL_MAX_SLOTS", 0):
            rerun(runner, a, {**base, "moe_align": "torch"}, *again)


if __name__ == "__main__":
    main()
