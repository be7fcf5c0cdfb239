"""Prefill over a cached prefix (a prefix hit's extend) against the same new tokens from scratch.

    python bench/extend.py --model DIR [--device cuda] [--cases 14x576@2560,14x576@7168] [--reps 3]
        [--profile]

A case ``NxM@C`` is one prefill batch of N chunks of M new tokens, each after C tokens already in
the pool (the prefix filled first by a prefill of its own, as a chunked prompt's earlier piece),
through ``ModelRunner.prefill``, as the prefill daemon runs a wave of prefix hits. Beside it, in the
same run:

- ``scratch``: the same number of new tokens as whole prompts from scratch (prompts of C + M tokens,
  as many as hold N x M new tokens; what the caches-off side computes per token);
- ``extend_kernel``: the same batch with the paged Triton extend kernel instead of SDPA
  (``DENSE_PREFILL_MIN_TOKENS`` raised past M);
- the GEMM-only floor: 2 x parameters x new tokens at the bf16 matmul peak measured in this run.

Times are the best of ``--reps`` after a warm-up. ``--profile`` adds the top CUDA kernels of one
extend batch (name, ms) from ``torch.profiler``: which SDPA kernel ran, and where the rest went.
One JSON line per case. On the CPU (the smoke test) the matmul peak is a 1,024^3 float32 matmul's
and the Triton extend kernel is the torch path's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, git_hash, hardware  # noqa: E402


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    """``"14x576@2560,..."`` -> [(chunks, new tokens, cached tokens), ...]."""
    out = []
    for item in filter(None, text.split(",")):
        try:
            chunks, rest = item.split("x")
            new, cached = rest.split("@")
            out.append((int(chunks), int(new), int(cached)))
        except ValueError:
            raise SystemExit(f"--cases: {item!r} is not NxM@C (chunks x new tokens @ cached tokens)") from None
    return out


def make_seqs(runner, count: int, length: int, tag: int):
    from kvferry.common.engine.sequence import Sequence
    from kvferry.common.sampling.sampler import SamplingParams

    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(f"{tag}-{i}", [(7 * i + 13 * tag + j) % 500 + 5 for j in range(length)], params)
            for i in range(count)]
    for s in seqs:
        runner.admit(s)
    return seqs


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_tflops(device: str, dtype) -> float:
    """The matmul peak the GEMM floor is measured against: CUDA bf16 at 8192^3 (bench/engine.py's),
    or the CPU's at 1,024^3 in ``dtype``."""
    import torch

    if device.startswith("cuda"):
        from bench.engine import ceilings

        return ceilings(device)[1]
    a = torch.randn(1024, 1024, dtype=dtype)
    a @ a
    started = time.perf_counter()
    for _ in range(5):
        a @ a
    return 2 * 1024**3 * 5 / (time.perf_counter() - started) / 1e12


def time_extend(runner, chunks: int, new: int, cached: int, reps: int, tag: int) -> float:
    """Best seconds of one batch of ``chunks`` extends of ``new`` tokens after ``cached``."""
    best = float("inf")
    for rep in range(reps + 1):  # the first is the warm-up
        seqs = make_seqs(runner, chunks, cached + new, tag * 100 + rep)
        if cached:
            runner.prefill(seqs, ends=[cached] * chunks)  # the prefix, as a chunked prompt's first piece
        sync(str(runner.target.kv.device))
        started = time.perf_counter()
        runner.prefill(seqs)  # ends with a host sync (the sampled first tokens)
        elapsed = time.perf_counter() - started
        for s in seqs:
            runner.release(s)
        if rep:
            best = min(best, elapsed)
    return best


def top_kernels(runner, chunks: int, new: int, cached: int, limit: int = 12) -> list[list]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    seqs = make_seqs(runner, chunks, cached + new, 999)
    runner.prefill(seqs, ends=[cached] * chunks)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.prefill(seqs)
    for s in seqs:
        runner.release(s)
    rows = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.self_device_time_total)
    return [[e.key[:80], round(e.self_device_time_total / 1e3, 2), e.count] for e in rows[:limit]]


def sdpa_backends(cfg, device: str, dtype, new: int, cached: int) -> dict:
    """Which SDPA backends accept an extend chunk's call as ``prefill_attention.sdpa_prefill`` makes it
    (GQA, lower-right causal over ``cached + new`` keys): {backend: "ok" or the first line of its refusal}."""
    import warnings

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q = torch.randn(1, cfg.num_attention_heads, new, cfg.head_dim, device=device, dtype=dtype)
    k = torch.randn(1, cfg.num_key_value_heads, cached + new, cfg.head_dim, device=device, dtype=dtype)
    out = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with warnings.catch_warnings(), sdpa_kernel([backend]):
                warnings.simplefilter("ignore")
                torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=causal_lower_right(new, cached + new),
                                                                 enable_gqa=True)
            out[backend.name] = "ok"
        except RuntimeError as exc:
            out[backend.name] = str(exc).strip().splitlines()[0][:120]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cases", default="14x576@2560,14x576@7168")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv-budget-gib", type=float, default=24.0)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    cases = parse_cases(a.cases)
    import torch

    from kvferry.common.engine.factory import build_runner
    from kvferry.common.layers import attn_backend
    from kvferry.common.models.config import ModelConfig

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {a.device}: CUDA is not available")
    if a.profile and not a.device.startswith("cuda"):
        raise SystemExit("--profile lists CUDA kernels: it needs --device cuda")
    peak = matmul_tflops(a.device, getattr(torch, a.dtype))
    cfg = ModelConfig.from_dir(a.model)
    kv_token_bytes = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * torch.empty(
        0, dtype=getattr(torch, a.dtype)).element_size()
    runner = build_runner(a.model, device=a.device, dtype=a.dtype,
                          max_total_tokens=int(a.kv_budget_gib * 2**30 // kv_token_bytes))
    model = runner.target.model
    # the GEMMs every new token runs through (the LM head only for each chunk's last token: left out)
    num_params = sum(p.numel() for name, p in model.named_parameters() if name not in ("embed", "lm_head"))
    base = {"bench": "extend", "device": a.device, "dtype": a.dtype, "attention_backend": model.attn.name,
            "matmul_tflops": round(peak, 3), "model": Path(a.model).name, "hw": hardware([a.device]),
            "git": git_hash()}
    for i, (chunks, new, cached) in enumerate(cases):
        tokens = chunks * new
        extend_s = time_extend(runner, chunks, new, cached, a.reps, 3 * i)
        # the same new tokens as whole prompts of cached + new tokens from scratch
        length = cached + new
        prompts = max(1, round(tokens / length))
        scratch_s = time_extend(runner, prompts, length, 0, a.reps, 3 * i + 1)
        scratch_per_token = scratch_s / (prompts * length)
        saved, attn_backend.DENSE_PREFILL_MIN_TOKENS = attn_backend.DENSE_PREFILL_MIN_TOKENS, 1 << 30
        try:
            kernel_s = time_extend(runner, chunks, new, cached, a.reps, 3 * i + 2)
        finally:
            attn_backend.DENSE_PREFILL_MIN_TOKENS = saved
        floor_s = 2 * num_params * tokens / (peak * 1e12)
        record = {**base, "chunks": chunks, "new_tokens": new, "cached_tokens": cached,
                  "extend_ms": round(extend_s * 1e3, 2), "extend_us_per_token": round(extend_s / tokens * 1e6, 2),
                  "extend_kernel_ms": round(kernel_s * 1e3, 2),
                  "scratch_prompts": prompts, "scratch_prompt_tokens": length,
                  "scratch_ms": round(scratch_s * 1e3, 2),
                  "scratch_us_per_token": round(scratch_per_token * 1e6, 2),
                  "extend_vs_scratch_per_token": round(extend_s / tokens / scratch_per_token, 3),
                  "extend_kernel_vs_sdpa": round(kernel_s / extend_s, 3),
                  "gemm_floor_ms": round(floor_s * 1e3, 2), "extend_vs_gemm_floor": round(extend_s / floor_s, 3)}
        if a.profile:
            record["top_kernels_ms"] = top_kernels(runner, chunks, new, cached)
            record["sdpa_backends"] = sdpa_backends(cfg, a.device, getattr(torch, a.dtype), new, cached)
        emit(record)


if __name__ == "__main__":
    main()
