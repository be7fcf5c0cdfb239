"""bench/staging.py end to end at a tiny size: two real NIXL agents (UCX, DRAM) in two processes (the
decode a spawned child, as on CUDA), one JSON line per room size. No timing thresholds; the bench itself fails if a warm-up (direct or staged) lands
anything but the room's bytes on the decode's pages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
KEYS = {"bench", "device", "page_kib", "pages", "bytes", "direct_ms", "write1_ms", "gather_ms", "scatter_ms",
        "staged_ms", "pipelined_ms", "memcpy_ms", "staged_vs_write1", "pipelined_vs_write1", "chunks", "per_desc_us", "direct_gbps", "memcpy_gbps", "staged_vs_direct", "staging_pays",
        "copy_elem_bytes", "iters", "threads", "git", "hw"}


def test_one_line_per_room_size():
    proc = subprocess.run([sys.executable, "bench/staging.py", "--pages", "8,32", "--iters", "2", "--page-kib", "4",
                           "--chunks", "3"],
                          cwd=REPO, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]  # JSON only on stdout
    assert [r["pages"] for r in lines] == [8, 32]
    for r in lines:
        assert KEYS <= r.keys(), KEYS - r.keys()
        assert (r["bench"], r["device"], r["iters"], r["page_kib"]) == ("staging", "cpu", 2, 4)
        assert r["bytes"] == r["pages"] * 4096
        assert r["copy_elem_bytes"] == 8  # 4 KiB pages: whole-page rows of 8-byte elements
        assert r["staging_pays"] == (r["staged_vs_direct"] > 1.0)
        assert r["chunks"] == 3  # 8 pages: chunks of 3, 3, 2; 32 pages: 11, 11, 10
