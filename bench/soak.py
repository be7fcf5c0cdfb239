"""Soak under faults: short requests through sglang-router (PD mode) in front of real prefill and
decode daemons (tiny checkpoint, loopback) while faults are injected, one at a time.

    python bench/soak.py [--requests 2000] [--concurrency 64] [--topology 2x2|1x1] [--fault-share 0.05]
                         [--max-faults 50] [--fault-kinds kill,freeze,restart] [--freeze-s 3]

Each request: one of ``--num-prompts`` seeded prompts, 8 new tokens, greedy, checked against the
colocated engine's output (computed once per prompt).
- ``ok``: 200 with that output. ``errors``: an error status with a message (``error_codes`` by
  status and router code). ``answered`` = ok + errors. ``wrong``: 200 with another output.
  ``lost`` = wrong + no answer within ``--client-timeout-s`` + an error without a message.
- Faults cycle through ``--fault-kinds``: ``kill`` (SIGKILL, start again at the same ports),
  ``freeze`` (SIGSTOP for ``--freeze-s``), ``restart`` (SIGTERM, 2 s drain, start again). Kills
  and restarts hit the second prefill and decode (the prefill in 1x1), freezes every daemon in
  turn. The first comes once 10% of the load is answered; after a window (injection to recovery)
  of w s the next waits w * (1 - s) / s, so faults are active for a share s (``--fault-share``)
  of the run. ``faults``: those injected before the load ended; ``requests_during_faults``: the
  requests in flight during a window.
- ``max_recovery_s``: per fault, injection to the first request served by the affected daemon,
  probed every 0.25 s with both legs sent straight to it and a healthy peer (``fault_log``).
- ``leaked_pages``: after the load and a bounded settle, the sum over daemons of idle free pages
  at first start minus free pages now (a restarted daemon has a fresh pool of the same size).
  ``rss_growth_mb``: the largest VmRSS growth from the end of warm-up to the end among the
  daemons never killed or restarted.

Router: ``--prefill-policy round_robin --decode-policy random`` (round_robin alone pins prefill i
to decode i, docs/routers.md), the default 5 attempts made explicit, and
``--disable-circuit-breaker``: with it on, ten failed attempts during one kill open the circuit of
both legs' workers for 60 s, and the run would measure the breaker's ``server_selection_failed``
instead of the daemons' recovery. Health checks stay at the defaults (a dead daemon keeps getting
attempts, which fail and are retried elsewhere). Daemon deadlines are short (KV wait 4 s,
transfer wait 5 s, WRITE 2 s, heartbeat 0.5 s x 3) so recovery is quick; the prefill waits longer
than the decode, so an orphaned decode's abort is heard first. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, git_hash, hardware  # noqa: E402
from bench.spec import tiny_dirs  # noqa: E402
from kvferry.common.daemon.procs import Proc, free_port, http_json, router_proc, worker_proc  # noqa: E402

logger = logging.getLogger("bench.soak")

SAMPLING = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
COMMON_FLAGS = ["--xfer-timeout-s", "2", "--register-timeout-s", "3", "--heartbeat-interval-s", "0.5",
                "--heartbeat-misses", "3", "--request-timeout-s", "30", "--drain-timeout-s", "2",
                "--max-total-tokens", "16384"]
PREFILL_FLAGS = COMMON_FLAGS + ["--transfer-wait-timeout-s", "5"]
DECODE_FLAGS = COMMON_FLAGS + ["--kv-wait-timeout-s", "4"]
ROUTER_FLAGS = ["--prefill-policy", "round_robin", "--decode-policy", "random", "--retry-max-retries", "5",
                "--disable-circuit-breaker", "--log-level", "warn"]  # warn still logs each failed attempt
PROBE_INTERVAL_S = 0.25


def listen_port(taken: set[int]) -> int:
    """A free port below the ephemeral range. A daemon restarted at its old ports must find them
    free, and a port of the ephemeral range may meanwhile become the source port of any outgoing
    connection (the clients', the router's, UCX's)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(max(1024, low - 12000), low), 500):  # unseeded: runs side by side
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in taken:
            taken.add(port)
            return port
    return free_port()


def vm_rss_mb(pid: int) -> float:
    (line,) = [x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:")]
    return int(line.split()[1]) / 1024  # kB


def free_pages(proc: Proc) -> dict:
    status, info = http_json(proc.url + "/server_info", timeout_s=10)
    if status != 200:
        raise RuntimeError(f"{proc.name}: /server_info answered {status}: {info}")
    return info["free_pages"]


class Fleet:
    """The daemons and the router. ``baseline`` is each daemon's idle free pages at first start."""

    def __init__(self, target: str, log_dir: Path, num_pairs: int):
        env, ports = {"OMP_NUM_THREADS": "1"}, set()
        self.prefills = [worker_proc("prefill", target, port=listen_port(ports), log_dir=log_dir, env=env,
                                     bootstrap_port=listen_port(ports), extra=PREFILL_FLAGS)
                         for _ in range(num_pairs)]
        self.decodes = [worker_proc("decode", target, port=listen_port(ports), log_dir=log_dir, env=env,
                                    extra=DECODE_FLAGS) for _ in range(num_pairs)]
        for p in self.prefills:
            p.bootstrap_port = int(p.args[p.args.index("--bootstrap-port") + 1])
        self.log_dir, self.router, self.baseline = log_dir, None, {}

    @property
    def daemons(self) -> list[Proc]:
        return self.prefills + self.decodes

    def start(self) -> None:
        for p in self.daemons:
            p.start()
        for p in self.daemons:
            p.wait_ready(300)
            self.baseline[p.name] = free_pages(p)
        self.router = router_proc([(p.url, p.bootstrap_port) for p in self.prefills], [d.url for d in self.decodes],
                                  port=free_port(), log_dir=self.log_dir, extra=ROUTER_FLAGS).start()
        self.router.wait_ready(120, path="/readiness")

    def stop(self) -> None:
        for p in ([self.router] if self.router else []) + self.daemons:
            p.signal(signal.SIGCONT)  # a frozen process cannot act on SIGTERM
            p.stop(20)

    def leaked_pages(self) -> dict[str, int]:
        """Pages each daemon holds beyond its baseline (only the daemons that hold some)."""
        now = {p.name: free_pages(p) for p in self.daemons}
        held = {name: sum(n - now[name].get(m, 0) for m, n in base.items()) for name, base in self.baseline.items()}
        return {name: num for name, num in held.items() if num}

    def router_failed_attempts(self) -> int:
        """Attempts the router saw fail (and retried, or answered with an error), from its log."""
        lines = self.router.log_path.read_text(errors="replace").splitlines()
        return sum("ERROR" in line and "pd_router" in line for line in lines)

    def settle(self, bound_s: float) -> dict[str, int]:
        """Wait (bounded) for every pool to be back at its baseline; returns what is still held."""
        deadline = time.monotonic() + bound_s
        while (leaked := self.leaked_pages()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return leaked


@dataclass(frozen=True)
class Outcome:
    """One client request: ``category`` is ok, error, wrong or lost; ``detail`` the code or reason."""

    category: str
    detail: str
    started_s: float
    ended_s: float


@dataclass(frozen=True)
class FaultRecord:
    kind: str
    target: str
    at_s: float
    recovery_s: float | None
    note: str = ""


def classify(url: str, ids: list[int], want: list[int], timeout_s: float) -> tuple[str, str]:
    """Send one request to the router; returns (category, detail) as ``Outcome`` holds them."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", "/generate", json.dumps({"input_ids": ids, "sampling_params": SAMPLING}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        status, code, raw = resp.status, resp.getheader("x-smg-error-code", ""), resp.read().decode(errors="replace")
    except TimeoutError:
        return "lost", f"no answer within {timeout_s:g}s"
    except (OSError, http.client.HTTPException) as exc:
        return "lost", f"connection: {type(exc).__name__}"
    finally:
        conn.close()
    if status == 200:
        try:
            got = json.loads(raw)["output_ids"]
        except (ValueError, KeyError, TypeError):
            return "wrong", "200 without output_ids"
        return ("ok", "") if got == want else ("wrong", "200 with another output")
    if len(raw.strip()) >= 10:  # the router's {"error": {"code", "message"}}, or a daemon's text
        return "error", f"{status} {code}".strip()
    return "lost", f"{status} without a message"


class Load:
    """Runs the client requests; ``num_done`` is what the fault schedule follows."""

    def __init__(self, url: str, prompts: list[list[int]], refs: list[list[int]], timeout_s: float, t0: float):
        self.url, self.prompts, self.refs, self.timeout_s, self.t0 = url, prompts, refs, timeout_s, t0
        self.num_done, self.is_over, self._lock = 0, threading.Event(), threading.Lock()

    def one(self, index: int) -> Outcome:
        started = time.monotonic() - self.t0
        category, detail = classify(self.url, self.prompts[index], self.refs[index], self.timeout_s)
        with self._lock:
            self.num_done += 1
        return Outcome(category, detail, started, time.monotonic() - self.t0)

    def run(self, indices: list[int], concurrency: int) -> list[Outcome]:
        pool = ThreadPoolExecutor(concurrency)
        try:
            return list(pool.map(self.one, indices))
        finally:
            self.is_over.set()
            pool.shutdown(wait=False, cancel_futures=True)  # on SIGTERM, do not send the rest


def fault_plan(kinds: list[str], num_faults: int, fleet: Fleet) -> list[tuple[str, Proc]]:
    """Kills and restarts alternate over the victims (kill starting with the first, restart with the
    second); freezes go round every daemon, so long-lived daemons see faults too."""
    victims = [fleet.prefills[-1], fleet.decodes[-1]] if len(fleet.decodes) > 1 else [fleet.prefills[0]]
    everyone = [p for pair in zip(fleet.decodes, fleet.prefills) for p in pair]
    offset, used, plan = {"kill": 0, "restart": 1, "freeze": 0}, Counter(), []
    for i in range(num_faults):
        kind = kinds[i % len(kinds)]
        pool = everyone if kind == "freeze" else victims
        plan.append((kind, pool[(used[kind] + offset[kind]) % len(pool)]))
        used[kind] += 1
    return plan


class Injector(threading.Thread):
    """Injects the planned faults one at a time and measures each one's recovery; after a fault's
    window (injection to recovery) of w seconds, the next waits w * (1 - share) / share, so faults
    are active for about ``--fault-share`` of the run."""

    def __init__(self, fleet: Fleet, load: Load, plan, num_requests: int, a, probe: tuple[list[int], list[int]]):
        super().__init__(daemon=True)
        self.fleet, self.load, self.plan, self.a, self.probe = fleet, load, plan, a, probe
        self.first_at = max(1, num_requests // 10)  # the first fault once 10% of the load is answered
        self.records: list[FaultRecord] = []
        self._legs = ThreadPoolExecutor(2)

    def run(self) -> None:
        next_at = 0.0  # monotonic time before which no fault starts
        for kind, proc in self.plan:
            while not self.load.is_over.is_set() and \
                    (self.load.num_done < self.first_at or time.monotonic() < next_at):
                time.sleep(0.1)
            if self.load.is_over.is_set():
                return
            started = time.monotonic()
            self.records.append(self.inject(kind, proc))
            window_s = time.monotonic() - started
            next_at = time.monotonic() + window_s * (1 - self.a.fault_share) / self.a.fault_share
            logger.info("fault %d: %s", len(self.records), self.records[-1])

    def inject(self, kind: str, proc: Proc) -> FaultRecord:
        started = time.monotonic()
        if kind == "freeze":
            proc.signal(signal.SIGSTOP)
            try:
                time.sleep(self.a.freeze_s)
            finally:
                proc.signal(signal.SIGCONT)
        elif kind == "kill":
            proc.signal(signal.SIGKILL)
            proc.popen.wait(10)
            proc.start()
        else:  # restart
            proc.stop(15)
            proc.start()
        recovery_s, note = self.recover(proc, started)
        return FaultRecord(kind, proc.name, round(started - self.load.t0, 2), recovery_s, note)

    def recover(self, proc: Proc, started: float) -> tuple[float | None, str]:
        """Probe ``proc`` with a healthy peer until a request through it succeeds (bounded)."""
        deadline, num_starts = started + self.a.recovery_bound_s, 0
        while time.monotonic() < deadline:
            if not proc.is_alive():  # it did not come back: say so, start it again (a few times)
                num_starts += 1
                logger.error("%s exited with %s after the fault:\n%s", proc.name, proc.popen.returncode, proc.tail())
                if num_starts > 3:
                    return None, f"exited {num_starts} times after the fault"
                proc.start()
            if self.probe_once(proc):
                return round(time.monotonic() - started, 2), f"restarted {num_starts} extra times" if num_starts else ""
            time.sleep(PROBE_INTERVAL_S)
        return None, f"no request through it succeeded within {self.a.recovery_bound_s:g}s"

    def probe_once(self, proc: Proc) -> bool:
        is_prefill = proc in self.fleet.prefills
        prefill = proc if is_prefill else self.fleet.prefills[0]
        decode = self.fleet.decodes[0] if is_prefill else proc
        ids, want = self.probe
        body = {"input_ids": ids, "sampling_params": SAMPLING, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": random.getrandbits(63)}
        legs = [self._legs.submit(http_json, p.url + "/generate", body, timeout_s=15) for p in (prefill, decode)]
        try:
            (p_status, _), (d_status, d_answer) = [leg.result() for leg in legs]
        except (OSError, http.client.HTTPException):
            return False  # not listening yet, or reset by the fault
        return p_status == 200 and d_status == 200 and isinstance(d_answer, dict) and \
            d_answer.get("output_ids") == want


def references(target: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of the colocated engine, once per distinct prompt."""
    import torch

    from kvferry.common.engine.colocated import ColocatedEngine
    from kvferry.common.engine.factory import build_runner
    from kvferry.common.api.sampling_schema import sglang_params
    from kvferry.common.text.tokenizer import Tokenizer

    torch.set_num_threads(1)
    engine = ColocatedEngine(build_runner(target, None, page_size=16, max_total_tokens=16384),
                             Tokenizer.from_dir(target))
    return [r.output_ids for r in engine.generate(prompts, sglang_params(SAMPLING))]


def during_faults(outcomes: list[Outcome], records: list[FaultRecord], end_s: float) -> int:
    """Requests whose lifetime overlaps a fault's window (injection to recovery)."""
    windows = [(r.at_s, r.at_s + (r.recovery_s if r.recovery_s is not None else end_s)) for r in records]
    return sum(any(o.started_s < hi and o.ended_s > lo for lo, hi in windows) for o in outcomes)


def soak(a, fleet: Fleet, prompts: list[list[int]], refs: list[list[int]]) -> dict:
    rng = random.Random(a.seed)
    t0 = time.monotonic()
    load = Load(fleet.router.url, prompts, refs, a.client_timeout_s, t0)
    warm = load.run([rng.randrange(len(prompts)) for _ in range(a.warmup)], a.concurrency)
    if any(o.category != "ok" for o in warm):
        raise SystemExit(f"warm-up failed before any fault: {Counter((o.category, o.detail) for o in warm)}")
    rss_warm = {p.name: (p.pid, vm_rss_mb(p.pid)) for p in fleet.daemons}
    load = Load(fleet.router.url, prompts, refs, a.client_timeout_s, time.monotonic())
    injector = Injector(fleet, load, fault_plan(a.fault_kinds.split(","), a.max_faults, fleet), a.requests, a,
                        (prompts[0], refs[0]))
    injector.start()
    outcomes = load.run([rng.randrange(len(prompts)) for _ in range(a.requests)], a.concurrency)
    duration_s = time.monotonic() - load.t0
    injector.join(a.recovery_bound_s + 120)
    leaked = fleet.settle(a.settle_s)
    growth = {p.name: round(vm_rss_mb(p.pid) - rss_warm[p.name][1], 1) for p in fleet.daemons
              if p.pid == rss_warm[p.name][0]}  # long-lived: the same process as at the end of warm-up
    counts = Counter(o.category for o in outcomes)
    recoveries = [r.recovery_s for r in injector.records]
    return {"bench": "soak", "requests": a.requests, "concurrency": a.concurrency, "faults": len(injector.records),
            "answered": counts["ok"] + counts["error"], "ok": counts["ok"], "errors": counts["error"],
            "wrong": counts["wrong"], "lost": counts["lost"] + counts["wrong"],
            "leaked_pages": sum(leaked.values()), "rss_growth_mb": max(growth.values(), default=None),
            "idle_free_pages": sum(n for base in fleet.baseline.values() for n in base.values()),
            "max_recovery_s": None if None in recoveries else max(recoveries, default=None),
            "duration_s": round(duration_s, 1), "topology": a.topology, "fault_share": a.fault_share,
            "max_faults": a.max_faults, "warmup": a.warmup,
            "requests_during_faults": during_faults(outcomes, injector.records, duration_s),
            "error_codes": dict(Counter(o.detail for o in outcomes if o.category == "error")),
            "lost_reasons": dict(Counter(o.detail for o in outcomes if o.category in ("lost", "wrong"))),
            "router_failed_attempts": fleet.router_failed_attempts(), "leaked_pages_by_daemon": leaked,
            "rss_growth_mb_by_daemon": growth,
            "fault_log": [asdict(r) for r in injector.records], "router_flags": " ".join(ROUTER_FLAGS)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--topology", choices=("2x2", "1x1"), default="2x2", help="prefills x decodes")
    ap.add_argument("--fault-share", type=float, default=0.05, help="share of the run with a fault active")
    ap.add_argument("--max-faults", type=int, default=50)
    ap.add_argument("--fault-kinds", default="kill,freeze,restart", help="cycled in this order")
    ap.add_argument("--freeze-s", type=float, default=3.0)
    ap.add_argument("--warmup", type=int, help="requests before the RSS baseline (default: 2 x concurrency)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--client-timeout-s", type=float, default=60.0)
    ap.add_argument("--recovery-bound-s", type=float, default=90.0)
    ap.add_argument("--settle-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", help="keep the daemons' and router's logs here (default: a temporary folder, "
                                      "kept only when something was lost, wrong or leaked)")
    a = ap.parse_args()
    a.warmup = 2 * a.concurrency if a.warmup is None else a.warmup
    if not set(a.fault_kinds.split(",")) <= {"kill", "freeze", "restart"}:
        ap.error(f"--fault-kinds: got {a.fault_kinds!r}; expected a list of kill, freeze, restart")
    if not 0 < a.fault_share < 1:
        ap.error(f"--fault-share must be in (0, 1), got {a.fault_share}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the daemons are stopped on the way out
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(8, 41))] for _ in range(a.num_prompts)]
    target = tiny_dirs()[0]
    refs = references(target, prompts)
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="kvferry-soak-"))
    fleet = Fleet(target, log_dir, 2 if a.topology == "2x2" else 1)
    is_clean, git = False, git_hash()  # the tree the daemons start from (restarts read it again)
    try:
        fleet.start()
        record = soak(a, fleet, prompts, refs)
        is_clean = not (record["lost"] or record["leaked_pages"])
        emit({**record, "log_dir": None if is_clean and not a.log_dir else str(log_dir),
              "git": git, "hw": hardware(["cpu"])})
    finally:
        fleet.stop()
        if is_clean and not a.log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
