"""End-to-end TTFT and throughput: disaggregated against colocated, measured in the same run.

    python bench/e2e.py [--prompt-tokens 128,1024] [--concurrency 1,8] [--new-tokens 32] [--reps 20]

Three servers on loopback, started once: a prefill and a decode daemon, and a colocated server
(``--serve-colocated``: the daemons' HTTP layer, prefill batching and continuous batcher over one
runner, no KV transfer). Disaggregated requests send both legs at once (same body, bootstrap
fields, ``stream: true``), as sglang-router does; TTFT is send to the decode's first SSE event.
Colocated TTFT is send to the colocated server's first SSE event, so the difference
(``ttft_overhead_ms``) is the cost of disaggregation alone. ``kv_transfer_ms_p50`` is the prefill's
``kvferry_transfer_seconds`` (one room's WRITE, post to DONE), the mean of each wave from the
/metrics deltas (a wave is ``concurrency`` requests sent together; at concurrency 1, one request).
``ttft_ms_p50_inprocess`` is the bare prefill forward of the same wave in this process (no HTTP,
no executor), a floor (``--no-inprocess`` skips it: one model copy less on a GPU). The KV pool of
each server holds one wave at the largest size unless ``--max-total-tokens`` says otherwise.
TPOT is (stream end - first event) / (new_tokens - 1) per request, of the colocated server and
of the decode. One JSON line per (prompt_tokens, concurrency).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, git_hash, hardware  # noqa: E402
from bench.spec import tiny_dirs  # noqa: E402
from kvferry.common.daemon.procs import Proc, free_port, worker_proc  # noqa: E402


def post(url: str, body: dict) -> tuple[int, float, float]:
    """POST ``body``; returns (status, time of the first SSE event or of the headers, time done).
    A prefill answers one JSON object even to a stream (docs/routers.md)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    is_sse = resp.status == 200 and resp.getheader("content-type", "").startswith("text/event-stream")
    first = None if is_sse else time.perf_counter()
    for line in resp if is_sse else ():
        if line.startswith(b"data:") and first is None:
            first = time.perf_counter()
        if b'"error"' in line[:16]:
            raise SystemExit(f"{url}: stream ended with {line.decode()[:300]}")
        if line.strip() == b"data: [DONE]":
            break
    resp.read()
    conn.close()
    return resp.status, first, time.perf_counter()


def histogram(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram on ``url``/metrics."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return tuple(float(re.search(rf"^{name}_{k} (\S+)$", text, re.M).group(1)) for k in ("sum", "count"))


def wave(pool, servers: list[Proc], prompts, sampling, bootstrap_port: int) -> dict:
    """One wave: each prompt goes to every server at once (prefill and decode, or the colocated
    server). TTFT is the last server's first SSE event; also the first server's answer time."""
    started, legs = time.perf_counter(), []
    for ids in prompts:
        body = {"input_ids": ids, "sampling_params": sampling, "stream": True, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": bootstrap_port, "bootstrap_room": random.getrandbits(63)}
        legs.append(([pool.submit(post, s.url, body) for s in servers], time.perf_counter()))
    out = {"ttft": [], "tpot": [], "first_answer": [], "seconds": 0.0}
    for futures, sent in legs:
        answers = [f.result() for f in futures]
        if any(status != 200 for status, _, _ in answers):
            raise SystemExit(f"request failed: {[(s.name, a[0]) for s, a in zip(servers, answers)]}")
        out["ttft"].append(answers[-1][1] - sent)
        out["tpot"].append((answers[-1][2] - answers[-1][1]) / max(sampling["max_new_tokens"] - 1, 1))
        out["first_answer"].append(answers[0][2] - sent)
        out["seconds"] = max(out["seconds"], answers[-1][2] - started)
    return out


def churn(pool, prefill: Proc, decode: Proc, num_requests: int, seed: int, max_tokens: int) -> dict:
    """``num_requests`` disaggregated requests of random prompt lengths (16 .. ``max_tokens``) and
    output lengths (1 .. 64), 16 in flight, each ending on its own: pages are freed out of order, so
    the decode's pool fragments as a long-running one does. Returns what the prefill counted."""
    rng = random.Random(seed)
    bodies = [{"input_ids": [rng.randrange(5, 512) for _ in range(rng.randrange(16, max_tokens))],
               "sampling_params": {"max_new_tokens": rng.randrange(1, 64), "temperature": 0, "ignore_eos": True},
               "stream": True, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
               "bootstrap_room": rng.getrandbits(63)} for _ in range(num_requests)]
    started = time.perf_counter()
    for i in range(0, num_requests, 16):
        legs = [pool.submit(post, s.url, b) for b in bodies[i:i + 16] for s in (prefill, decode)]
        if any(f.result()[0] != 200 for f in legs):
            raise SystemExit("a churn request failed")
    return {"churn_requests": num_requests, "churn_s": round(time.perf_counter() - started, 1)}


def staging_counts(url: str) -> dict:
    """The prefill's rooms by path (staged / direct by reason) so far."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {f"{m.group(1)}:{m.group(2)}" if m.group(2) else m.group(1): float(m.group(3)) for m in re.finditer(
        r'^kvferry_staging_rooms_total\{path="(\w+)",reason="(\w*)"\} (\S+)$', text, re.M)}


def inprocess_ttft(runner, tokenizer, prompts, params) -> list[float]:
    """Bare prefill forward of a wave, in batches of at most 8,192 tokens as the servers run them
    (each batch's pages freed before the next, so the pool needs one batch only)."""
    from kvferry.common.engine.sequence import Sequence

    batches, num_tokens = [[]], 0
    for i, p in enumerate(prompts):
        if batches[-1] and num_tokens + len(p) > 8192:
            batches, num_tokens = batches + [[]], 0
        batches[-1].append(Sequence(str(i), list(p), params))
        num_tokens += len(p)
    ttfts, started = [], time.perf_counter()
    for batch in batches:
        for s in batch:
            runner.admit(s)
        runner.prefill(batch, with_draft=True)
        tokenizer.decode([s.output_ids[0] for s in batch])
        ttfts += [time.perf_counter() - started] * len(batch)
        for s in batch:
            runner.release(s)
    return ttfts


def measure(a, pool, local, servers, num_prompt_tokens: int, concurrency: int) -> dict:
    from kvferry.common.sampling.sampler import SamplingParams

    prefill, decode, colocated = servers
    rng = random.Random(a.seed)
    sampling = {"max_new_tokens": a.new_tokens, "temperature": 0, "ignore_eos": True}
    waves = [[[rng.randrange(5, 512) for _ in range(num_prompt_tokens)] for _ in range(concurrency)]
             for _ in range(a.reps + 1)]
    got = {k: [] for k in ("col", "dis", "col_tpot", "dis_tpot", "inproc", "write", "kv_wait", "prefill_answer")}
    seconds = {"col": 0.0, "dis": 0.0}
    for rep, prompts in enumerate(waves):  # wave 0 warms every path up
        inproc = inprocess_ttft(*local, prompts, SamplingParams(max_new_tokens=1, temperature=0.0)) if local else []
        col = wave(pool, [colocated], prompts, sampling, prefill.bootstrap_port)
        before = histogram(prefill.url, "kvferry_transfer_seconds"), histogram(decode.url, "kvferry_kv_wait_seconds")
        dis = wave(pool, [prefill, decode], prompts, sampling, prefill.bootstrap_port)
        after = histogram(prefill.url, "kvferry_transfer_seconds"), histogram(decode.url, "kvferry_kv_wait_seconds")
        if rep:
            got["inproc"] += inproc
            got["col"] += col["ttft"]
            got["dis"] += dis["ttft"]
            got["col_tpot"] += col["tpot"]
            got["dis_tpot"] += dis["tpot"]
            got["prefill_answer"] += dis["first_answer"]
            for key, b, e in zip(("write", "kv_wait"), before, after):
                got[key].append((e[0] - b[0]) / max(e[1] - b[1], 1))
            seconds["col"] += col["seconds"]
            seconds["dis"] += dis["seconds"]
    p50 = {k: round(1e3 * statistics.median(v), 3) if v else None for k, v in got.items()}
    overhead = round(p50["dis"] - p50["col"], 3)
    num_tokens = a.reps * concurrency * a.new_tokens
    return {"bench": "e2e", "prompt_tokens": num_prompt_tokens, "concurrency": concurrency,
            "new_tokens": a.new_tokens, "reps": a.reps, "colocated_mode": "http",
            "ttft_ms_p50_colocated": p50["col"], "ttft_ms_p50_disagg": p50["dis"], "ttft_overhead_ms": overhead,
            "kv_transfer_ms_p50": p50["write"], "overhead_minus_transfer_ms": round(overhead - p50["write"], 3),
            "kv_wait_ms_p50": p50["kv_wait"], "prefill_answer_ms_p50": p50["prefill_answer"],
            "ttft_ms_p50_inprocess": p50["inproc"],
            "tpot_ms_p50_colocated": p50["col_tpot"], "tpot_ms_p50_disagg": p50["dis_tpot"],
            "tokens_per_s_colocated": round(num_tokens / seconds["col"], 1),
            "tokens_per_s_disagg": round(num_tokens / seconds["dis"], 1)}


def start_servers(a, target: str, draft: str | None, log_dir: Path) -> list[Proc]:
    """Prefill, decode, colocated server, one after the other: each picks its ports only once the
    previous one is up, since a starting daemon's UCX listeners take ephemeral ports too."""
    flags = ["--device", a.device, "--max-total-tokens", str(a.max_total_tokens)]
    env = {"OMP_NUM_THREADS": str(a.threads)}
    quiet = flags + ["--log-level", "warning"]

    def colocated(port: int) -> Proc:
        args = [sys.executable, __file__, "--serve-colocated", str(port), "--model", target,
                *(["--draft", draft] if draft else []), *flags]
        return Proc(f"colocated:{port}", args, f"http://127.0.0.1:{port}", log_dir / f"colocated-{port}.log", env=env)

    makers = [lambda: worker_proc("prefill", target, port=free_port(), log_dir=log_dir, bootstrap_port=free_port(),
                                  extra=quiet + a.prefill_args.split(), env=env),
              lambda: worker_proc("decode", target, port=free_port(), log_dir=log_dir, draft=draft,
                                  extra=quiet + a.decode_args.split(), env=env),
              lambda: colocated(free_port())]
    servers = []
    try:
        for make in makers:
            servers.append(make().start())
            servers[-1].wait_ready(600)
    except BaseException:
        for proc in reversed(servers):
            proc.stop(30)
        raise
    prefill = servers[0]
    prefill.bootstrap_port = int(prefill.args[prefill.args.index("--bootstrap-port") + 1])
    return servers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model"), ap.add_argument("--draft", help="draft model of the decode and colocated servers")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-tokens", default="128,1024")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-total-tokens", type=int, help="KV pool of each server (default: enough for the run)")
    ap.add_argument("--no-inprocess", action="store_true", help="skip the in-process floor (one model copy less)")
    ap.add_argument("--prefill-args", default="", help="more flags for the prefill daemon, e.g. '--xfer-threads 8'")
    ap.add_argument("--decode-args", default="", help="more flags for the decode daemon, e.g. '--staging-bytes 0'")
    ap.add_argument("--churn", type=int, default=0, help="requests of random lengths through the pair before the "
                                                        "measured waves (fragments the decode's pool); each "
                                                        "(size, concurrency) is measured before and after")
    ap.add_argument("--max-wave-tokens", type=int, help="skip (prompt_tokens, concurrency) pairs whose wave "
                                                         "holds more prompt tokens than this")
    ap.add_argument("--serve-colocated", type=int, metavar="PORT", help=argparse.SUPPRESS)
    a = ap.parse_args()
    lengths, levels = [int(x) for x in a.prompt_tokens.split(",")], [int(x) for x in a.concurrency.split(",")]
    a.max_total_tokens = a.max_total_tokens or max(65536, max(levels) * (max(lengths) + a.new_tokens + 64))
    target, draft = (a.model, a.draft) if a.model else (tiny_dirs()[0], None)
    import torch

    torch.set_num_threads(a.threads)
    if a.serve_colocated:
        from kvferry.common.daemon.lifecycle import run

        from kvferry.common.engine.colocated_server import ColocatedServer

        sys.exit(run(ColocatedServer(target, draft, device=a.device, max_total_tokens=a.max_total_tokens,
                                     port=a.serve_colocated)))
    from kvferry.common.engine.factory import build_runner
    from kvferry.common.text.tokenizer import Tokenizer

    local = None if a.no_inprocess else (build_runner(target, draft, device=a.device,
                                                       max_total_tokens=max(lengths) + 8192 + 1024),
                                          Tokenizer.from_dir(target))
    with tempfile.TemporaryDirectory(prefix="kvferry-e2e-") as logs:
        servers = start_servers(a, target, draft, Path(logs))
        try:
            with ThreadPoolExecutor(max(2 * max(levels), 32)) as pool:
                for phase in (["fresh", "churned"] if a.churn else ["fresh"]):
                    extra = {}
                    if phase == "churned":
                        extra = churn(pool, servers[0], servers[1], a.churn, a.seed + 1, max(lengths) * 2)
                    for num_prompt_tokens in lengths:
                        for concurrency in levels:
                            if a.max_wave_tokens and num_prompt_tokens * concurrency > a.max_wave_tokens:
                                continue
                            paths = staging_counts(servers[0].url)
                            record = measure(a, pool, local, servers, num_prompt_tokens, concurrency)
                            after = staging_counts(servers[0].url)
                            rooms = {k: v - paths.get(k, 0.0) for k, v in after.items() if v - paths.get(k, 0.0)}
                            emit({**record, "pool": phase, **extra, "rooms_by_path": rooms,
                                  "prefill_args": a.prefill_args, "decode_args": a.decode_args, "device": a.device,
                                  "model": Path(target).name, "draft": bool(draft), "threads": a.threads,
                                  "hw": hardware([a.device]), "git": git_hash()})
        finally:
            for proc in reversed(servers):
                proc.stop(30)


if __name__ == "__main__":
    main()
