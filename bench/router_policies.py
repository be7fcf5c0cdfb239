"""What sglang-router's PD policies give the prefix caches: 2 prefills x 2 decodes, multi-turn chat.

    python bench/router_policies.py [--pairs PREFILL:DECODE[:OPT[+OPT]],...] [--conversations 6]
                                    [--turns 4] [--model DIR] [--device cpu]

Two prefill and two decode daemons (prefix caches on) are started once; each policy pair
(``PREFILL:DECODE``: sglang-router's ``--prefill-policy`` and ``--decode-policy``) gets a fresh
router process in PD mode, and every daemon's cache is emptied (``POST /flush_cache``) before it.
A pair's options: ``text`` (prompts sent as ``text``, not ``input_ids``), ``nokey`` (no routing
key header), ``random|min_load|min_group`` (``--assignment-mode`` of the manual policy). First a
warm-up, through a router of its own, sends requests until every (prefill, decode) link has carried
one: a decode's first request to a prefill it has not registered with takes no decode hit.

The workload: ``--conversations`` conversations share one ``--system-tokens`` system prompt; each
of ``--turns`` turns adds ``--user-tokens`` user tokens and ``--new-tokens`` greedy output tokens
(``ignore_eos``), so turn t's prompt is turn t-1's prompt, its answer and the new user tokens, sent
to the router's ``/generate`` as ``input_ids`` (random ids), or with ``text`` as text (windows of
the tiny corpus; the answer's ``text`` joins the history). Every request but ``nokey``'s carries
``X-SMG-Routing-Key: conv-<i>``, what the ``manual`` policy routes by (the others ignore it).
Requests go one at a time, turn by turn, the conversations of a turn in a seeded shuffled order (a
fixed order would let ``round_robin`` keep every conversation on one decode by parity alone), so
the daemon that served each request is the one whose ``kvferry_requests_total`` moved. The first
pair of a prompt form makes its history from its answers; later pairs of that form send the same
prompts, and ``outputs_equal`` says whether their answers equal the first pair's.

One JSON line per pair, over the turns from the second on: ``prefill_hit_fraction`` and
``decode_hit_fraction`` (the sum of ``meta_info.cached_tokens_prefill`` / ``cached_tokens_decode``
over the sum of prompt tokens); ``*_hit_bound``, the same had every turn reached the daemon that
served the conversation's previous turn (the prefill holds the previous prompt, the decode the
previous prompt and answer but its last token; in whole pages); ``*_history_*``, the same for the
tokens past the system prompt (``shared_prefix_tokens``: any daemon that served any conversation
holds it, so this part is what stickiness adds); ``kept_prefill`` / ``kept_decode``, the
conversations that stayed on one daemon for every turn; the requests each daemon served; per
conversation the daemon index of each turn (``routes``); the first turn's prefill hit; and
``cache_aware_random_picks``, how often the router logged that a ``cache_aware`` policy had no
prefix tree for the model and picked a worker at random (the routers run at ``--log-level debug``).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import common_prefix, emit, flush_cache, git_hash, hardware  # noqa: E402
from kvferry.common.daemon.procs import Proc, http_json, router_proc, worker_proc  # noqa: E402

DEFAULT_PAIRS = ("cache_aware:round_robin,cache_aware:cache_aware,round_robin:random,round_robin:round_robin,"
                 "power_of_two:power_of_two,cache_aware:manual,manual:manual,manual:manual:min_group,"
                 "manual:manual:nokey,cache_aware:cache_aware:text")
OPTIONS = ("text", "nokey", "random", "min_load", "min_group")
# what sglang-router logs (at debug level) when a cache_aware policy has no prefix tree for the model
# and picks a worker at random instead
NO_TREE = "No tree found for model"
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


def requests_served(proc: Proc) -> float:
    """``kvferry_requests_total`` summed over its outcomes."""
    status, text = http_json(proc.url + "/metrics", timeout_s=30)
    if status != 200:
        raise SystemExit(f"{proc.url}/metrics: HTTP {status}")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvferry_requests_total"))


def served_by(procs: list[Proc], before: list[float], timeout_s: float = 30.0) -> tuple[int, list[float]]:
    """Which of ``procs`` counted one more request than ``before`` (its counter moves when its
    leg ends, which for a prefill may be just after the client got its answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = [requests_served(p) for p in procs]
        moved = [i for i, (a, b) in enumerate(zip(now, before)) if a > b]
        if len(moved) == 1 and sum(now) - sum(before) == 1:
            return moved[0], now
        if len(moved) > 1 or sum(now) - sum(before) > 1:
            raise SystemExit(f"more than one request counted: {before} -> {now}")
        if time.monotonic() > deadline:
            raise SystemExit(f"no daemon counted the request within {timeout_s}s: {before} -> {now}")
        time.sleep(0.05)


def page_floor(n: int, page: int) -> int:
    return n // page * page


class Workload:
    """One prompt form's conversations: turn t of conversation c, as the body part that carries the
    prompt (``input_ids`` or ``text``) and as token ids. The first pair run in a form makes its
    history from its answers; later pairs of that form send the same prompts."""

    def __init__(self, form: str, a, rng: random.Random, tokenizer):
        self.form, self.tokenizer = form, tokenizer
        self.bodies: list[list[dict]] = []  # [turn][conversation]
        self.ids: list[list[list[int]]] = []
        self.answers: list[list[list[int]]] | None = None  # the first pair's output ids
        if form == "ids":
            tokens = lambda n: [rng.randrange(5, 500) for _ in range(n)]  # noqa: E731
            self.system = tokens(a.system_tokens)
            self.users = [[tokens(a.user_tokens) for _ in range(a.turns)] for _ in range(a.conversations)]
        else:  # windows of the tiny corpus as text, each user message after a newline
            from bench.spec import corpus_prompts

            self.system = tokenizer.decode(corpus_prompts(tokenizer, 1, a.system_tokens, rng.randrange(1 << 30))[0])
            self.users = [["\n" + tokenizer.decode(w) for w in
                           corpus_prompts(tokenizer, a.turns, a.user_tokens, rng.randrange(1 << 30))]
                          for _ in range(a.conversations)]

    def add_turn(self, t: int, answers: list[dict] | None) -> None:
        """Turn ``t``'s prompts from turn t-1's answers (the /generate responses)."""
        if self.form == "ids":
            prompts = [(self.system if t == 0 else self.ids[t - 1][c] + answers[c]["output_ids"]) + u[t]
                       for c, u in enumerate(self.users)]
            self.bodies.append([{"input_ids": p} for p in prompts])
            self.ids.append(prompts)
        else:
            texts = [(self.system if t == 0 else self.bodies[t - 1][c]["text"] + answers[c]["text"]) + u[t]
                     for c, u in enumerate(self.users)]
            self.bodies.append([{"text": x} for x in texts])
            self.ids.append([self.tokenizer.encode(x) for x in texts])  # as the daemons tokenize it


def parse_pair(spec: str) -> dict:
    """``PREFILL:DECODE[:OPT[+OPT]]``, OPT ``text`` (prompts as text), ``nokey`` (no routing key
    header) or a manual ``--assignment-mode``."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not all(parts[:2]):
        raise SystemExit(f"--pairs: want PREFILL:DECODE[:OPT[+OPT]], got {spec!r}")
    opts = parts[2].split("+") if len(parts) == 3 else []
    modes = [o for o in opts if o in ("random", "min_load", "min_group")]
    if any(o not in OPTIONS for o in opts) or len(modes) > 1:
        raise SystemExit(f"--pairs: unknown option in {spec!r} ({', '.join(OPTIONS)})")
    return {"prefill_policy": parts[0], "decode_policy": parts[1], "prompt_form": "text" if "text" in opts else "ids",
            "routing_key": "nokey" not in opts, "assignment_mode": modes[0] if modes else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default=DEFAULT_PAIRS,
                    help="comma list of PREFILL_POLICY:DECODE_POLICY[:OPT[+OPT]]; OPT: text (prompts sent as "
                         "text, not input_ids), nokey (no X-SMG-Routing-Key header), random|min_load|min_group "
                         "(the manual policy's --assignment-mode)")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--router-args", default="", help="more sglang-router flags for every pair")
    ap.add_argument("--model", help="checkpoint folder (default: the embedded tiny model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every daemon")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-total-tokens", type=int, help="KV pool of each daemon (default: every "
                                                         "conversation's last turn, plus 4096)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one request may take")
    ap.add_argument("--log-dir", help="keep the daemons' and routers' logs here (default: a temporary folder)")
    a = ap.parse_args()
    pairs = [parse_pair(p) for p in a.pairs.split(",") if p]
    if not pairs:
        raise SystemExit("--pairs: no pair")
    last_prompt = a.system_tokens + a.turns * (a.user_tokens + a.new_tokens)
    max_total = a.max_total_tokens or a.conversations * (last_prompt + a.new_tokens) + 4096
    if a.model:
        target = a.model
    else:
        from bench.spec import tiny_dirs

        target = tiny_dirs()[0]
    from kvferry.common.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(target)
    dtype = a.dtype if a.dtype != "auto" else "float32" if a.device == "cpu" else "bfloat16"
    rng = random.Random(a.seed)
    workloads = {form: Workload(form, a, rng, tokenizer) for form in ("ids", "text")}
    orders = [rng.sample(range(a.conversations), a.conversations) for _ in range(a.turns)]
    sampling = {"max_new_tokens": a.new_tokens, "temperature": 0, "ignore_eos": True}
    common = {"conversations": a.conversations, "turns": a.turns, "system_tokens": a.system_tokens,
              "user_tokens": a.user_tokens, "new_tokens": a.new_tokens, "device": a.device, "dtype": dtype,
              "model": Path(target).name, "prefills": 2, "decodes": 2, "hw": hardware([a.device]), "git": git_hash()}

    with tempfile.TemporaryDirectory(prefix="kvferry-router-policies-") as tmp:
        logs = Path(a.log_dir or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        flags = ["--device", a.device, "--dtype", dtype, "--max-total-tokens", str(max_total), "--log-level", "warning"]
        env = {"OMP_NUM_THREADS": str(a.threads), "KVFERRY_DISABLE_PREFIX_CACHE": "false"}
        procs: list[Proc] = []
        try:
            prefills = [worker_proc("prefill", target, port=None, log_dir=logs, env=env, extra=flags,
                                    pick_bootstrap_port=True) for _ in range(2)]
            decodes = [worker_proc("decode", target, port=None, log_dir=logs, env=env, extra=flags) for _ in range(2)]
            for p in prefills + decodes:
                procs.append(p.start())
            for p in prefills + decodes:
                p.wait_ready(600)
            status, info = http_json(decodes[0].url + "/server_info", timeout_s=30)
            page = int(info["page_size"]) if status == 200 else 1
            warm_up(a, logs, prefills, decodes, sampling)
            for pair in pairs:
                for p in prefills + decodes:
                    flush_cache(p.url)
                extra = ["--prefill-policy", pair["prefill_policy"], "--decode-policy", pair["decode_policy"],
                         "--log-level", "debug", *a.router_args.split()]
                if pair["assignment_mode"]:
                    extra += ["--assignment-mode", pair["assignment_mode"]]
                router = router_proc([(p.url, p.bootstrap_port) for p in prefills], [d.url for d in decodes],
                                     port=None, log_dir=logs, extra=extra)
                log_start = router.log_path.stat().st_size if router.log_path.exists() else 0
                procs.append(router.start())
                try:
                    router.wait_ready(120, path="/readiness")
                    got = run_pair(a, router, prefills, decodes, workloads[pair["prompt_form"]], orders, sampling,
                                   page, pair["routing_key"])
                    with open(router.log_path, "rb") as log:
                        log.seek(log_start)
                        fallbacks = log.read().decode(errors="replace").count(NO_TREE)
                    emit({"bench": "router_policies", **pair, **got, "cache_aware_random_picks": fallbacks,
                          "router_args": a.router_args, "page_size": page, **common})
                finally:
                    router.stop(30)
                    procs.remove(router)
        finally:
            for p in reversed(procs):
                p.stop(30)


def warm_up(a, logs: Path, prefills: list[Proc], decodes: list[Proc], sampling: dict) -> None:
    """One request over every (prefill, decode) link, so that each decode has registered with each
    prefill before the first measured turn: a decode's first request to a prefill takes no decode
    hit (it learns only from the registration that the prefill writes a room's suffix alone).
    Prefill round robin, decode random, until every link was taken; at most 32 requests."""
    router = router_proc([(p.url, p.bootstrap_port) for p in prefills], [d.url for d in decodes], port=None,
                         log_dir=logs, extra=["--prefill-policy", "round_robin", "--decode-policy", "random",
                                              "--log-level", "warn"])
    router.start()
    try:
        router.wait_ready(120, path="/readiness")
        counts = {"prefill": [requests_served(p) for p in prefills], "decode": [requests_served(d) for d in decodes]}
        links: set[tuple[int, int]] = set()
        for i in range(32):
            status, out = http_json(router.url + "/generate", {"input_ids": [5 + i] * 32, "sampling_params": sampling},
                                    timeout_s=a.timeout)
            if status != 200:
                raise SystemExit(f"warm-up {router.url}/generate: HTTP {status}: {str(out)[:300]}")
            p, counts["prefill"] = served_by(prefills, counts["prefill"])
            d, counts["decode"] = served_by(decodes, counts["decode"])
            links.add((p, d))
            if len(links) == len(prefills) * len(decodes):
                return
        raise SystemExit(f"warm-up: 32 requests took only the links {sorted(links)} (prefill, decode)")
    finally:
        router.stop(30)


def run_pair(a, router: Proc, prefills: list[Proc], decodes: list[Proc], w: Workload, orders: list[list[int]],
             sampling: dict, page: int, routing_key: bool) -> dict:
    first_pair = w.answers is None
    counts = {"prefill": [requests_served(p) for p in prefills], "decode": [requests_served(d) for d in decodes]}
    where = {side: [[-1] * a.conversations for _ in range(a.turns)] for side in ("prefill", "decode")}
    outs: list[list[dict]] = [[{} for _ in range(a.conversations)] for _ in range(a.turns)]
    for t in range(a.turns):
        if first_pair:
            w.add_turn(t, outs[t - 1] if t else None)
        for c in orders[t]:
            headers = {ROUTING_KEY_HEADER: f"conv-{c}"} if routing_key else {}
            status, out = http_json(router.url + "/generate", {**w.bodies[t][c], "sampling_params": sampling},
                                    timeout_s=a.timeout, headers=headers)
            if status != 200:
                raise SystemExit(f"{router.url}/generate: HTTP {status}: {str(out)[:300]}")
            if out["meta_info"]["prompt_tokens"] != len(w.ids[t][c]):
                raise SystemExit(f"turn {t} conversation {c}: the daemon counted {out['meta_info']['prompt_tokens']} "
                                 f"prompt tokens, the local tokenizer {len(w.ids[t][c])}")
            outs[t][c] = out
            for side, procs in (("prefill", prefills), ("decode", decodes)):
                where[side][t][c], counts[side] = served_by(procs, counts[side])
    answers = [[o["output_ids"] for o in row] for row in outs]
    if first_pair:
        w.answers = answers
    later = [(t, c) for t in range(1, a.turns) for c in range(a.conversations)]
    prompt_tokens = sum(len(w.ids[t][c]) for t, c in later)
    # what a daemon that served the conversation's previous turn holds of this one: the prefill the
    # previous prompt, the decode the previous prompt and answer but the answer's last token (whose
    # KV is never computed); in whole pages, and at most all but the prompt's last token
    def bound(t: int, c: int, held: list[int]) -> int:
        return page_floor(min(common_prefix(w.ids[t][c], held), len(w.ids[t][c]) - 1), page)

    bounds = {"prefill": {(t, c): bound(t, c, w.ids[t - 1][c]) for t, c in later},
              "decode": {(t, c): bound(t, c, w.ids[t - 1][c] + answers[t - 1][c][:-1]) for t, c in later}}
    hits = {side: {(t, c): int(outs[t][c]["meta_info"].get(f"cached_tokens_{side}", 0)) for t, c in later}
            for side in ("prefill", "decode")}
    # the system prompt every conversation begins with, in whole pages: any daemon that served any
    # conversation holds it, so the hits past it are those a conversation's own history gave
    shared = page_floor(min(common_prefix(w.ids[0][0], x) for x in w.ids[0]) if len(w.ids[0]) > 1 else 0, page)
    history_tokens = sum(len(w.ids[t][c]) - shared for t, c in later)

    def fraction(tokens: dict, past: int, total: int) -> float:
        return round(sum(max(x - past, 0) for x in tokens.values()) / max(total, 1), 3)

    kept = {side: sum(len({where[side][t][c] for t in range(a.turns)}) == 1 for c in range(a.conversations))
            for side in ("prefill", "decode")}
    turn1 = sum(len(x) for x in w.ids[0])
    figures = {"prompt_tokens": prompt_tokens, "shared_prefix_tokens": shared}
    for side in ("prefill", "decode"):
        figures |= {f"{side}_hit_tokens": sum(hits[side].values()),
                    f"{side}_hit_fraction": fraction(hits[side], 0, prompt_tokens),
                    f"{side}_hit_bound": fraction(bounds[side], 0, prompt_tokens),
                    f"{side}_history_hit_fraction": fraction(hits[side], shared, history_tokens),
                    f"{side}_history_hit_bound": fraction(bounds[side], shared, history_tokens)}
    return {**figures,
            "kept_decode": kept["decode"], "kept_prefill": kept["prefill"],
            "requests_by_prefill": [sum(x == i for row in where["prefill"] for x in row) for i in range(len(prefills))],
            "requests_by_decode": [sum(x == i for row in where["decode"] for x in row) for i in range(len(decodes))],
            "turn1_prefill_hit_fraction": round(sum(int(o["meta_info"].get("cached_tokens_prefill", 0))
                                                    for o in outs[0]) / max(turn1, 1), 3),
            # per conversation, the daemon index of each turn
            "routes": {side: ["".join(str(where[side][t][c]) for t in range(a.turns)) for c in range(a.conversations)]
                       for side in ("prefill", "decode")},
            "outputs_equal": answers == w.answers}


if __name__ == "__main__":
    main()
