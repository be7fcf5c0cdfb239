"""Speculative decoding speedup: plain and speculative greedy generation side by side, one run.

    python bench/spec.py [--batch 1] [--k 4] [--new-tokens 128] [--reps 5]

Prompts are seeded windows of the tiny model's corpus. Each repetition times both engines on the
same batch, back to back, alternating which goes first; in float32 the outputs must be identical
(greedy); in bfloat16 the k+1-token verify batch may round a near-tie differently from a one-token
step, so the share of leading tokens both agree on is reported (``common_prefix_fraction``).
tokens/s are totals over the repetitions; ``speedup`` is the median of the per-repetition ratios
(plain seconds / speculative seconds), which cancels the load drift of a shared machine. Prints
one JSON line.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._common import common_prefix, emit, git_hash, hardware  # noqa: E402


def tiny_dirs() -> tuple[str, str]:
    """The embedded tiny checkpoint (target, draft) under .tiny/seed0, made on first use."""
    from kvferry.common.models.tiny import ensure_tiny_model

    target, draft = ensure_tiny_model(REPO / ".tiny" / "seed0", seed=0)
    return str(target), str(draft)


def corpus_prompts(tokenizer, num_prompts: int, num_tokens: int, seed: int) -> list[list[int]]:
    """Seeded windows of the tiny corpus (natural text, as the tiny model was built for)."""
    from kvferry.common.models.tiny_corpus import CORPUS

    ids = tokenizer.encode(CORPUS, add_special_tokens=False)
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(ids) - num_tokens) for _ in range(num_prompts)]
    return [ids[s:s + num_tokens] for s in starts]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model"), ap.add_argument("--draft")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (both engines)")
    ap.add_argument("--dtype", help="default: float32 on CPU, bfloat16 on GPU; the outputs must be equal in "
                                    "float32 (bfloat16 verify batches may round a near-tie the other way)")
    a = ap.parse_args()
    import torch

    from kvferry.common.engine.colocated import ColocatedEngine
    from kvferry.common.engine.factory import build_runner
    from kvferry.common.sampling.sampler import SamplingParams
    from kvferry.common.text.tokenizer import Tokenizer

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    target, draft = (a.model, a.draft) if a.model else tiny_dirs()
    tok = Tokenizer.from_dir(target)
    room = a.batch * (a.prompt_tokens + a.new_tokens + 64)
    engines = {"plain": ColocatedEngine(build_runner(target, None, device=a.device, dtype=a.dtype,
                                                     max_total_tokens=room), tok),
               "spec": ColocatedEngine(build_runner(target, draft, device=a.device, dtype=a.dtype,
                                                    max_total_tokens=room, spec_k=a.k), tok)}
    dtype = str(engines["plain"].runner.target.kv.dtype).removeprefix("torch.")
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=0.0, ignore_eos=True)
    batches = [corpus_prompts(tok, a.batch, a.prompt_tokens, a.seed + rep) for rep in range(a.reps + 1)]
    seconds, ratios, accepted, proposed, agreed = {"plain": 0.0, "spec": 0.0}, [], 0, 0, []
    for rep, prompts in enumerate(batches):  # batch 0 is the warm-up
        order = ("plain", "spec") if rep % 2 else ("spec", "plain")
        outs, took = {}, {}
        for name in order:
            started = time.perf_counter()
            outs[name] = engines[name].generate(prompts, params)
            took[name] = time.perf_counter() - started
        same = [common_prefix(p.output_ids, q.output_ids) for p, q in zip(outs["plain"], outs["spec"])]
        if dtype == "float32" and min(same) < a.new_tokens:
            raise SystemExit(f"repetition {rep}: speculative greedy output differs from plain greedy")
        if rep:
            agreed.extend(same)
            seconds = {name: seconds[name] + took[name] for name in seconds}
            ratios.append(took["plain"] / took["spec"])  # back to back: load drift cancels in the pair
            accepted += sum(r.num_accepted for r in outs["spec"])
            proposed += sum(r.num_proposed for r in outs["spec"])
    num_tokens = a.reps * a.batch * a.new_tokens
    emit({"bench": "spec", "k": a.k, "batch": a.batch, "prompt_tokens": a.prompt_tokens,
          "new_tokens": a.new_tokens, "reps": a.reps, "threads": a.threads, "seed": a.seed,
          "acceptance_rate": round(accepted / max(proposed, 1), 4),
          "tokens_per_s_plain": round(num_tokens / seconds["plain"], 1),
          "tokens_per_s_spec": round(num_tokens / seconds["spec"], 1),
          "speedup": round(statistics.median(ratios), 3), "dtype": dtype,
          "outputs_equal": min(agreed) == a.new_tokens,
          "common_prefix_fraction": round(sum(agreed) / (len(agreed) * a.new_tokens), 4),
          "model": Path(target).name, "device": a.device, "hw": hardware([a.device]), "git": git_hash()})


if __name__ == "__main__":
    main()
