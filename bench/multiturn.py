"""Multi-turn conversations through sglang-router, prefix caches on and off, in the same run.

    python bench/multiturn.py [--preset cpu|h200-8b] [--model DIR] [--device cpu|cuda]
                              [--sides off,on[,local]] [--apart] [--local-prefill-tokens N]

The workload: ``--conversations`` conversations share one ``--system-tokens`` system prompt; each
of ``--turns`` turns adds ``--user-tokens`` user tokens and ``--new-tokens`` greedy output tokens
(``ignore_eos``) to its history, so turn t's prompt is the system prompt, every earlier user
message and answer, and the new user message. One wave a turn: every conversation sends at once.

Each side is its own prefill, decode and sglang-router (PD mode, round robin, one prefill and one
decode, so every conversation keeps its decode):
- ``off``: both daemons with ``--disable-prefix-cache`` (every prompt computed and sent whole);
- ``on``: both caches on (the default): the prefill computes only what its cache lacks, the decode
  names the prompt tokens it holds (``decode_prefix_len``) and the prefill WRITEs only the rest;
- ``local``: as ``on``, and the decode prefills locally what it holds but for at most
  ``--local-prefill-tokens`` tokens (``--max-local-prefill-tokens``).
The prompts of every side are the ``off`` side's (its answers make the history), so each side
sees the same token lists; ``outputs_equal`` says whether a side's answers equal ``off``'s token
for token. By default the sides run interleaved (turn t on every side, then turn t+1); with
``--apart`` one side at a time (one side's daemons in memory at once: an 8B model on one GPU).

One JSON line per (turn, side): TTFT p50/p99 (send to the router's first SSE event), TPOT p50,
the prefill's computed prompt tokens (``kvferry_prompt_tokens_computed``) and KV bytes written
(``kvferry_transfer_bytes``), the hit tokens on each side (``kvferry_prefix_hit_tokens``), the
decode's locally computed tokens, and the ratios the issue's goals name:
``ttft_p50_vs_off`` (the same turn's TTFT p50 with caches off), ``computed_vs_not_held`` (computed
prompt tokens over the tokens no earlier prompt sent to that prefill began with) and
``bytes_vs_not_held`` (bytes written over the KV of the tokens no earlier prompt plus answer on
that decode began with). A last line (``"turn": "all"``) sums the turns from the second on.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import common_prefix, emit, flush_cache, git_hash, hardware  # noqa: E402
from kvferry.common.daemon.procs import Proc, free_port, http_json, router_proc, worker_proc  # noqa: E402

PRESETS = {  # conversations, system tokens, turns, user tokens per turn, new tokens per turn
    "cpu": dict(conversations=4, system_tokens=256, turns=4, user_tokens=64, new_tokens=16),
    "h200-8b": dict(conversations=16, system_tokens=2048, turns=8, user_tokens=512, new_tokens=64),
}
COUNTERS = {"computed": ("prefill", "kvferry_prompt_tokens_computed_total"),
            "bytes_written": ("prefill", "kvferry_transfer_bytes_total"),
            "prefill_hits": ("prefill", 'kvferry_prefix_hit_tokens_total{side="prefill"}'),
            "decode_hits": ("decode", 'kvferry_prefix_hit_tokens_total{side="decode"}'),
            "decode_computed": ("decode", "kvferry_prompt_tokens_computed_total"),
            "local_rooms": ("decode", "kvferry_local_prefill_rooms_total"),
            "batch_tokens": ("prefill", "kvferry_prefill_batch_tokens_total")}
# where a turn's TTFT goes: the prefill's batches (forward time; ``batches`` says how many), one room's WRITE, the
# decode's wait for the KV, and the decode's arrival to first token (each a histogram: the mean of the wave from
# its sum and count)
HISTOGRAMS = {"batch": ("prefill", "kvferry_prefill_batch_seconds"), "write": ("prefill", "kvferry_transfer_seconds"),
              "kv_wait": ("decode", "kvferry_kv_wait_seconds"), "decode_ttft": ("decode", "kvferry_ttft_seconds")}


def stream(url: str, body: dict, timeout_s: float) -> tuple[float, float, dict]:
    """POST /generate with ``stream: true``; (first SSE event time, end time, last object)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"{url}: HTTP {resp.status}: {resp.read()[:300]!r}")
    first, last = None, None
    for line in resp:
        if not line.startswith(b"data:"):
            continue
        first = first or time.perf_counter()
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        last = json.loads(payload)
        if "error" in last:
            raise SystemExit(f"{url}: stream ended with {payload[:300]!r}")
    conn.close()
    if last is None:
        raise SystemExit(f"{url}: no SSE event")
    return first, time.perf_counter(), last


def counters(url: str) -> dict[str, float]:
    status, text = http_json(url + "/metrics", timeout_s=30)
    if status != 200:
        raise SystemExit(f"{url}/metrics: HTTP {status}")
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


class Side:
    """One side's prefill, decode and router, and its metric readings."""

    def __init__(self, name: str, a, target: str, log_dir: Path):
        self.name, self.procs = name, []
        flags = ["--device", a.device, "--dtype", a.dtype, "--max-total-tokens", str(a.max_total_tokens),
                 "--log-level", "warning"]
        extra = {"off": ["--disable-prefix-cache"], "on": [], "local": []}[name]
        decode_extra = ["--max-local-prefill-tokens", str(a.local_prefill_tokens)] if name == "local" else []
        env = {"OMP_NUM_THREADS": str(a.threads), "KVFERRY_DISABLE_PREFIX_CACHE": str(name == "off").lower()}
        try:
            self.prefill = self._start(worker_proc("prefill", target, port=free_port(), log_dir=log_dir,
                                                   bootstrap_port=free_port(), env=env,
                                                   extra=flags + extra + a.prefill_args.split()))
            self.decode = self._start(worker_proc("decode", target, port=free_port(), log_dir=log_dir, env=env,
                                                  extra=flags + extra + decode_extra + a.decode_args.split()))
            self.router = self._start(router_proc([(self.prefill.url, self.prefill.bootstrap_port)],
                                                  [self.decode.url], port=None, log_dir=log_dir), "/readiness")
        except BaseException:
            self.stop()
            raise

    def _start(self, proc: Proc, path: str = "/health") -> Proc:
        self.procs.append(proc.start())
        proc.wait_ready(900, path=path)
        return proc

    def read(self) -> dict[str, float]:
        got = {"prefill": counters(self.prefill.url), "decode": counters(self.decode.url)}
        out = {k: got[who].get(name, 0.0) for k, (who, name) in COUNTERS.items()}
        out["legs"] = sum(v for k, v in got["prefill"].items() if k.startswith("kvferry_requests_total{"))
        for k, (who, name) in HISTOGRAMS.items():
            out[k] = (got[who].get(name + "_sum", 0.0), got[who].get(name + "_count", 0.0))
        return out

    def flush(self) -> None:
        for proc in (self.prefill, self.decode):
            flush_cache(proc.url)  # 409 while rooms of the warm-up wave are still being released

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(30)


def held(prompt: list[int], earlier: list[list[int]]) -> int:
    """The longest prefix of ``prompt`` that an earlier token list begins with."""
    return max((common_prefix(prompt, e) for e in earlier), default=0)


def wave(pool, side: Side, prompts: list[list[int]], sampling: dict, timeout_s: float) -> dict:
    before = side.read()
    sent = time.perf_counter()
    futures = [pool.submit(stream, side.router.url, {"input_ids": p, "sampling_params": sampling, "stream": True},
                           timeout_s) for p in prompts]
    answers = [f.result() for f in futures]
    # A client has its answer from the decode while the prefill may still be closing the wave's legs: read
    # until the prefill has counted every leg's outcome (kvferry_requests_total, after its prompt was counted,
    # computed or hit, and cached), for at most 10 s (a side that never gets there is reported as it is). A
    # local room's leg computes nothing when the decode's word came before its forward began.
    settle_by = time.monotonic() + 10.0
    after = side.read()
    while after["legs"] - before["legs"] < len(prompts) and time.monotonic() < settle_by:
        time.sleep(0.05)
        after = side.read()
    ttft = [first - sent for first, _, _ in answers]
    tpot = [(end - first) / max(sampling["max_new_tokens"] - 1, 1) for first, end, _ in answers]
    return {"ttft": ttft, "tpot": tpot, "outputs": [last["output_ids"] for _, _, last in answers],
            "metas": [last["meta_info"] for _, _, last in answers],
            **{k: after[k] - before[k] for k in COUNTERS},
            **{k + "_ms_mean": round(1e3 * (after[k][0] - before[k][0]) / max(after[k][1] - before[k][1], 1), 2)
               for k in HISTOGRAMS}, "batches": int(after["batch"][1] - before["batch"][1])}


def p(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(1e3 * values[min(len(values) - 1, int(q * len(values)))], 2)


def record(turn, side: str, got: dict, off: dict | None, prompts, not_held_prefill: int, not_held_decode: int,
           kv_per_token: int) -> dict:
    out = {"bench": "multiturn", "turn": turn, "side": side, "requests": len(prompts),
           "prompt_tokens": sum(len(x) for x in prompts),
           "ttft_ms_p50": p(got["ttft"], 0.5), "ttft_ms_p99": p(got["ttft"], 0.99),
           "tpot_ms_p50": round(1e3 * statistics.median(got["tpot"]), 3),
           **{k: int(got[k]) for k in COUNTERS}, **{k + "_ms_mean": got[k + "_ms_mean"] for k in HISTOGRAMS},
           "batches": got["batches"],
           "not_held_prefill_tokens": not_held_prefill, "not_held_decode_tokens": not_held_decode,
           "computed_vs_not_held": round(got["computed"] / max(not_held_prefill, 1), 3),
           "bytes_vs_not_held": round(got["bytes_written"] / max(not_held_decode * kv_per_token, 1), 3),
           "meta_cached_tokens": sum(int(m.get("cached_tokens", 0)) for m in got["metas"])}
    if off is not None:
        out["ttft_p50_vs_off"] = round(out["ttft_ms_p50"] / max(p(off["ttft"], 0.5), 1e-9), 3)
        out["outputs_equal"] = got["outputs"] == off["outputs"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), help="workload sizes (default: cpu on cpu, h200-8b on "
                                                                "cuda); the flags below override them")
    for name in PRESETS["cpu"]:
        ap.add_argument("--" + name.replace("_", "-"), type=int)
    ap.add_argument("--model", help="checkpoint folder (default: the embedded tiny model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="both daemons' --dtype (auto: float32 on cpu, bfloat16 on cuda)")
    ap.add_argument("--sides", default="off,on", help="comma list of off, on, local; off is always run first")
    ap.add_argument("--apart", action="store_true", help="one side's daemons at a time, not interleaved")
    ap.add_argument("--local-prefill-tokens", type=int, default=1024, help="the local side's "
                                                                            "--max-local-prefill-tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-total-tokens", type=int, help="KV pool of each daemon (default: every conversation's "
                                                         "last turn, plus a warm-up wave)")
    ap.add_argument("--prefill-args", default="", help="more flags for both sides' prefill daemons")
    ap.add_argument("--decode-args", default="", help="more flags for both sides' decode daemons")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    ap.add_argument("--log-dir", help="keep the daemons' and routers' logs here (default: a temporary folder)")
    a = ap.parse_args()
    for k, v in PRESETS[a.preset or ("h200-8b" if a.device.startswith("cuda") else "cpu")].items():
        setattr(a, k, getattr(a, k) if getattr(a, k) is not None else v)
    sides = ["off"] + [s for s in a.sides.split(",") if s and s != "off"]
    if any(s not in ("on", "local") for s in sides[1:]):
        raise SystemExit(f"--sides: unknown side in {a.sides!r} (off, on, local)")
    last_prompt = a.system_tokens + a.turns * (a.user_tokens + a.new_tokens)
    a.max_total_tokens = a.max_total_tokens or a.conversations * (last_prompt + a.new_tokens) + 8192
    if a.model:
        target = a.model
    else:
        from bench.spec import tiny_dirs

        target = tiny_dirs()[0]
    from kvferry.common.daemon.start import kv_bytes_per_token
    from kvferry.common.models.config import ModelConfig

    dtype = a.dtype if a.dtype != "auto" else "float32" if a.device == "cpu" else "bfloat16"
    kv_per_token = kv_bytes_per_token([ModelConfig.from_dir(target)], 1, dtype)
    rng = random.Random(a.seed)
    tokens = lambda n: [rng.randrange(5, 500) for _ in range(n)]  # noqa: E731
    system = tokens(a.system_tokens)
    users = [[tokens(a.user_tokens) for _ in range(a.turns)] for _ in range(a.conversations)]
    warm = [tokens(a.system_tokens + a.user_tokens) for _ in range(a.conversations)]
    sampling = {"max_new_tokens": a.new_tokens, "temperature": 0, "ignore_eos": True}
    common = {"conversations": a.conversations, "system_tokens": a.system_tokens, "user_tokens": a.user_tokens,
              "new_tokens": a.new_tokens, "device": a.device, "dtype": dtype, "model": Path(target).name,
              "apart": a.apart,
              "local_prefill_tokens": a.local_prefill_tokens if "local" in sides else 0,
              "kv_bytes_per_token": kv_per_token, "hw": hardware([a.device]), "git": git_hash()}
    results: dict[str, list[dict]] = {s: [] for s in sides}
    prompts_by_turn: list[list[list[int]]] = []

    def run_turn(pool, side: Side, turn: int) -> None:
        if side.name == "off":  # the off side's answers make every side's history
            histories = ([system] * a.conversations if turn == 0 else
                         [q + o for q, o in zip(prompts_by_turn[-1], results["off"][-1]["outputs"])])
            prompts_by_turn.append([h + users[c][turn] for c, h in enumerate(histories)])
        got = wave(pool, side, prompts_by_turn[turn], sampling, a.timeout)
        results[side.name].append(got)
        earlier = [q for t in range(turn) for q in prompts_by_turn[t]]
        answered = [q + o[:-1] for t in range(turn) for q, o in zip(prompts_by_turn[t], results[side.name][t]["outputs"])]
        prompts = prompts_by_turn[turn]
        not_prefill = sum(len(q) - held(q, earlier) for q in prompts)
        not_decode = sum(len(q) - held(q, answered) for q in prompts)
        emit({**record(turn + 1, side.name, got, results["off"][turn] if side.name != "off" else None, prompts,
                       not_prefill, not_decode, kv_per_token), **common})

    with tempfile.TemporaryDirectory(prefix="kvferry-multiturn-") as tmp, \
            ThreadPoolExecutor(2 * a.conversations) as pool:
        logs = a.log_dir or tmp
        Path(logs).mkdir(parents=True, exist_ok=True)
        live: list[Side] = []
        try:
            groups = [[s] for s in sides] if a.apart else [sides]
            for group in groups:
                live = [Side(name, a, target, Path(logs)) for name in group]
                for side in live:  # warm-up (kernels, graphs; a second turn over the first), then empty caches
                    first = wave(pool, side, warm, sampling, a.timeout)
                    wave(pool, side, [w + o + u[0] for w, o, u in zip(warm, first["outputs"], users)], sampling,
                         a.timeout)
                    side.flush()
                for turn in range(a.turns):
                    for side in live:
                        run_turn(pool, side, turn)
                for side in live:
                    side.stop()
                live = []
        finally:
            for side in live:
                side.stop()
    for name in sides[1:]:  # turns 2.. summed
        rows, off = results[name][1:], results["off"][1:]
        ttft = [p(r["ttft"], 0.5) / max(p(o["ttft"], 0.5), 1e-9) for r, o in zip(rows, off)]  # each turn's ratio
        emit({"bench": "multiturn", "turn": "all", "side": name, "turns": a.turns,
              "ttft_p50_vs_off_max": round(max(ttft), 3) if ttft else None,
              "ttft_p50_vs_off_median": round(statistics.median(ttft), 3) if ttft else None,
              "computed": int(sum(r["computed"] for r in rows)), "computed_off": int(sum(o["computed"] for o in off)),
              "bytes_written": int(sum(r["bytes_written"] for r in rows)),
              "bytes_written_off": int(sum(o["bytes_written"] for o in off)),
              "outputs_equal": all(r["outputs"] == o["outputs"] for r, o in zip(results[name], results["off"])),
              **common})


if __name__ == "__main__":
    main()
