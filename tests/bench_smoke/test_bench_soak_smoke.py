"""bench/soak.py end to end at a tiny size: 20 requests through sglang-router in front of one
prefill and one decode, the prefill killed and started again at its ports while they run. Every
request gets an answer, none is wrong, no page stays allocated (no timing checks: figures on a
shared CI machine mean nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.cluster import tiny_model_dirs

REPO = Path(__file__).resolve().parents[2]
KEYS = {"bench", "requests", "concurrency", "faults", "answered", "ok", "errors", "wrong", "lost", "leaked_pages",
        "rss_growth_mb", "max_recovery_s", "duration_s", "git", "hw", "fault_log", "error_codes", "lost_reasons"}


def test_soak_bench_survives_a_kill_without_losing_requests(tmp_path):
    tiny_model_dirs()  # made once, under the lock the benchmarks share
    args = ["--requests", "20", "--concurrency", "4", "--warmup", "4", "--topology", "1x1", "--max-faults", "1",
            "--fault-kinds", "kill", "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.strip()]
    record = json.loads(line)
    assert KEYS <= record.keys(), KEYS - record.keys()
    assert record["bench"] == "soak" and record["requests"] == 20 and record["concurrency"] == 4
    assert record["answered"] + record["lost"] == 20 and record["answered"] == record["ok"] + record["errors"]
    assert record["lost"] == 0 and record["wrong"] == 0, (record["lost_reasons"], proc.stderr[-4000:])
    assert record["leaked_pages"] == 0, record["leaked_pages_by_daemon"]
    assert record["idle_free_pages"] > 0  # the pools were read: a zero leak is not a vacuous one
    assert record["ok"] > 0
    (fault,) = record["fault_log"]
    assert record["faults"] == 1 and fault["kind"] == "kill" and fault["target"].startswith("prefill:")
    assert fault["recovery_s"] is not None and record["max_recovery_s"] == fault["recovery_s"] > 0
    assert record["rss_growth_mb"] is not None  # the decode was never killed: its RSS is tracked
