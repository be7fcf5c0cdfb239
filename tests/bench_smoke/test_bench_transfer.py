"""bench/transfer.py end to end at a tiny size: two real processes, real NIXL, one JSON line per layout.

No timing thresholds: this machine's figures are noise at this size. What must hold is the output
contract and the geometry (bytes and merged descriptors follow from the layout alone); the bench
itself fails if any warm-up WRITE lands anywhere but where the plan says.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
LAYERS, TOKENS, PAGE_BYTES = 2, 64, 16 * 8 * 128 * 2  # page: 16 tokens x 8 heads x 128 dims x bf16
KEYS = {"bench", "device", "layout", "kv_layout", "decode_kv_layout", "tokens", "bytes", "descriptors",
        "raw_descriptors", "raw_nixl_gbps", "kvferry_gbps", "memcpy_gbps", "ratio_vs_raw", "kvferry_ms", "raw_ms",
        "index_ms", "num_threads", "git", "hw"}
SCATTERED = {"nixl_same_descs_ms", "ratio_vs_same_descs"}  # the fragmented and churned lines only


@pytest.fixture(scope="module")
def lines() -> list[dict]:
    proc = subprocess.run([sys.executable, "bench/transfer.py", "--layers", str(LAYERS), "--tokens", str(TOKENS),
                           "--iters", "2"], cwd=REPO, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = [line for line in proc.stdout.splitlines() if line.strip()]
    return [json.loads(line) for line in out]  # any non-JSON line on stdout fails here


def test_one_line_per_layout_with_every_key(lines):
    assert [r["layout"] for r in lines] == ["contiguous", "fragmented", "churned"]
    for r in lines:
        assert KEYS <= r.keys(), KEYS - r.keys()
        assert (SCATTERED <= r.keys()) == (r["layout"] != "contiguous")
        assert r["bench"] == "transfer" and r["device"] == "cpu" and r["tokens"] == TOKENS
        assert r["git"] and r["hw"]


def test_figures_are_positive_and_consistent(lines):
    for r in lines:
        for key in ("raw_nixl_gbps", "kvferry_gbps", "memcpy_gbps", "ratio_vs_raw", "kvferry_ms", "raw_ms"):
            assert r[key] > 0, (key, r[key])
        assert r["kvferry_gbps"] == pytest.approx(r["bytes"] / r["kvferry_ms"] / 1e6, rel=0.01)
        assert r["raw_nixl_gbps"] == pytest.approx(r["bytes"] / r["raw_ms"] / 1e6, rel=0.01)
        assert r["index_ms"] >= 0  # built before the WRITE (as KvWriter.prepare does), not part of kvferry_ms
        if r["layout"] != "contiguous":
            assert r["nixl_same_descs_ms"] > 0 and r["ratio_vs_same_descs"] > 0


def test_bytes_and_descriptors_follow_the_geometry(lines):
    num_pages, num_regions = TOKENS // 16, 2 * LAYERS
    contiguous, fragmented, churned = lines
    for r in lines:
        assert r["bytes"] == num_regions * num_pages * PAGE_BYTES
        assert (r["kv_layout"], r["decode_kv_layout"]) == ("page-major", "page-major")  # the default
    # page-major pools: the whole contiguous prompt is one block on both sides, plus the aux record
    assert contiguous["descriptors"] == 1 + 1 and contiguous["raw_descriptors"] == 1
    # fragmented: one block per page at most (random pages may still touch), plus the aux record
    assert 1 + 1 < fragmented["descriptors"] <= num_pages + 1
    assert 1 + 1 <= churned["descriptors"] <= num_pages + 1  # the allocator's runs, however they fell


def test_layer_major_descriptors():
    proc = subprocess.run([sys.executable, "bench/transfer.py", "--layers", str(LAYERS), "--tokens", str(TOKENS),
                           "--iters", "1", "--kv-layout", "layer-major"], cwd=REPO, capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    contiguous, fragmented, _ = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    num_pages, num_regions = TOKENS // 16, 2 * LAYERS
    # contiguous: one merged run per region, plus the aux record; raw is one descriptor per region
    assert contiguous["descriptors"] == num_regions + 1 and contiguous["raw_descriptors"] == num_regions
    assert num_regions + 1 < fragmented["descriptors"] <= num_regions * num_pages + 1
