"""bench/transfer.py end to end at a tiny size: two real processes, real NIXL, one JSON line per layout,
each with the staged path's figures beside the direct ones.

No timing thresholds: this machine's figures are noise at this size. What must hold is the output
contract and the geometry (bytes and merged descriptors follow from the layout alone); the bench
itself fails if any warm-up WRITE lands anywhere but where the plan says, the staged room included
(gathered, written in chunks, scattered by the decode process: its pages are hashed against the prefill's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry.common.wire.aux_record import AUX_RECORD_V3_BYTES

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
LAYERS, TOKENS, PAGE_BYTES = 2, 64, 16 * 8 * 128 * 2  # page: 16 tokens x 8 heads x 128 dims x bf16
KEYS = {"bench", "device", "layout", "kv_layout", "decode_kv_layout", "tokens", "bytes", "descriptors",
        "raw_descriptors", "raw_nixl_gbps", "kvferry_gbps", "memcpy_gbps", "ratio_vs_raw", "kvferry_ms", "raw_ms",
        "index_ms", "num_threads", "git", "hw"}
SCATTERED = {"nixl_same_descs_ms", "ratio_vs_same_descs"}  # the fragmented and churned lines only
STAGED = {"staged_plan_ms", "staged_ms", "staged_write_ms", "staged_scatter_ms", "staged_e2e_ms", "staged_gbps",
          "ratio_staged_vs_raw", "ratio_staged_vs_direct", "staged_beats_direct", "staged_chunks",
          "staging_chunk_bytes", "runs", "crossover_runs", "chooser", "chooser_reason", "per_desc_us",
          "copy_ns_per_byte", "per_write_us", "model_direct_ms", "model_staged_ms"}
CHUNK = PAGE_BYTES * 2 * LAYERS  # one page-major page (K and V of every layer): the room in 4 chunks, buffers reused


@pytest.fixture(scope="module")
def lines() -> list[dict]:
    proc = subprocess.run([sys.executable, "bench/transfer.py", "--layers", str(LAYERS), "--tokens", str(TOKENS),
                           "--iters", "2", "--staging-chunk-bytes", str(CHUNK)], cwd=REPO, capture_output=True,
                          text=True, timeout=150)
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
        assert r["cache_form"] == "kv" and r["bytes_per_token"] == num_regions * PAGE_BYTES // 16
    # page-major pools: the whole contiguous prompt is one block on both sides, plus the aux record
    assert contiguous["descriptors"] == 1 + 1 and contiguous["raw_descriptors"] == 1
    # fragmented: one block per page at most (random pages may still touch), plus the aux record
    assert 1 + 1 < fragmented["descriptors"] <= num_pages + 1
    assert 1 + 1 <= churned["descriptors"] <= num_pages + 1  # the allocator's runs, however they fell


def test_staged_line(lines):
    """Every page pattern is also moved staged (the bench checked the decode's pages after it): the
    room in chunks of whole pages, the decode's scatter inside staged_ms, the chooser's decision."""
    num_pages = TOKENS // 16
    for r in lines:
        assert STAGED <= r.keys(), STAGED - r.keys()
        for key in ("staged_ms", "staged_write_ms", "staged_scatter_ms", "staged_e2e_ms", "staged_gbps",
                    "ratio_staged_vs_raw", "ratio_staged_vs_direct", "per_desc_us", "copy_ns_per_byte",
                    "per_write_us", "model_direct_ms", "model_staged_ms"):
            assert r[key] > 0, (key, r[key])
        assert r["staged_ms"] == pytest.approx(r["bytes"] / r["staged_gbps"] / 1e6, rel=0.01)
        assert r["staged_e2e_ms"] >= r["staged_write_ms"] and r["staged_plan_ms"] >= 0
        assert r["staging_chunk_bytes"] == CHUNK and r["staged_chunks"] == num_pages  # one 2-layer page a chunk
        assert r["crossover_runs"] >= 2 and r["runs"] == r["descriptors"] - 1  # the aux record apart
        assert r["chooser"] in ("staged", "direct") and isinstance(r["staged_beats_direct"], bool)
        assert (r["chooser"] == "direct") == (r["chooser_reason"] != "")
        if r["chooser"] == "direct":
            assert r["chooser_reason"] == "few_runs" and r["runs"] < r["crossover_runs"]
        # the chooser stages exactly where its model of the two paths says staged is faster
        assert (r["chooser"] == "staged") == (r["model_staged_ms"] < r["model_direct_ms"]), r


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
    # staged from a layer-major pool: one run per page per region, in one chunk at the default 32 MiB
    assert fragmented["staged_ms"] > 0 and fragmented["staged_chunks"] == 1
    assert fragmented["runs"] == fragmented["descriptors"] - 1


MLA_LAYERS, MLA_TOKENS, MLA_PAGE_BYTES = 4, 128, 16 * 576 * 2  # page: 16 tokens x (512 + 64) latent x bf16


def test_mla_rooms():
    """--cache-form mla: LatentCache pools (one latent region per layer) on both sides, each room moved
    direct, as raw NIXL and staged, its bytes checked on the decode after each warm-up (the bench exits
    non-zero otherwise). 4 layers of 128 tokens: a prefill pool large enough for the chooser's costs."""
    chunk = MLA_PAGE_BYTES * MLA_LAYERS  # one page-major page: every layer's latent page
    proc = subprocess.run([sys.executable, "bench/transfer.py", "--cache-form", "mla", "--layers", str(MLA_LAYERS),
                           "--tokens", str(MLA_TOKENS), "--iters", "1", "--staging-chunk-bytes", str(chunk)],
                          cwd=REPO, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [r["layout"] for r in lines] == ["contiguous", "fragmented", "churned"]
    num_pages = MLA_TOKENS // 16
    for r in lines:
        assert KEYS | STAGED <= r.keys(), (KEYS | STAGED) - r.keys()
        assert r["cache_form"] == "mla" and r["layers"] == MLA_LAYERS and r["kv_dtype"] == "bfloat16"
        assert r["bytes_per_token"] == MLA_LAYERS * 1152  # DeepSeek-V3: 576 bf16 values per token and layer
        assert r["bytes"] == num_pages * 16 * r["bytes_per_token"]
        for key in ("raw_nixl_gbps", "kvferry_gbps", "ratio_vs_raw", "kvferry_ms", "raw_ms", "staged_ms",
                    "ratio_staged_vs_raw"):
            assert r[key] > 0, (key, r[key])
        assert r["staged_chunks"] == num_pages and r["runs"] == r["descriptors"] - 1
        assert r["crossover_runs"] >= 2  # the costs were measured from the latent pool
    contiguous, fragmented, _ = lines
    # page-major latent pages interleave like K/V ones: the contiguous room is one block, plus the aux record
    assert contiguous["descriptors"] == 1 + 1 and contiguous["raw_descriptors"] == 1
    assert 1 + 1 < fragmented["descriptors"] <= num_pages + 1


@pytest.mark.parametrize("flags, message", [
    (["--kv-dtype", "float8_e4m3fn"], "model dtype only"),
    (["--prefill-tp", "2"], "dense K/V feeds only"),
], ids=["fp8", "tp"])
def test_mla_refuses(flags, message):
    """What the daemons do not serve for an MLA model is refused before any pool is built."""
    proc = subprocess.run([sys.executable, "bench/transfer.py", "--cache-form", "mla", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


TP_KEYS = {"bench", "device", "prefill_tp", "decode_tp", "prefill_page_size", "decode_page_size", "tokens", "feeds",
           "feed_ranks", "bytes", "bytes_per_feed", "descriptors", "descriptors_per_feed", "raw_descriptors",
           "kvferry_ms", "raw_ms", "same_descs_ms", "descs_ms", "kvferry_gbps", "raw_nixl_gbps", "ratio_vs_raw",
           "ratio_vs_same_descs", "feeds_in_daemons", "git", "hw"}
AUX_BYTES = AUX_RECORD_V3_BYTES  # the aux record (AuxSlots default slot) rides on the (0, 0) feed


def tp_line(*flags: str) -> dict:
    proc = subprocess.run([sys.executable, "bench/transfer.py", "--layers", str(LAYERS), "--tokens", str(TOKENS),
                           "--iters", "1", *flags], cwd=REPO, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert TP_KEYS <= line.keys(), TP_KEYS - line.keys()
    assert line["bench"] == "transfer_tp" and line["tokens"] == TOKENS and line["git"] and line["hw"]
    for key in ("kvferry_ms", "raw_ms", "same_descs_ms", "kvferry_gbps", "raw_nixl_gbps", "ratio_vs_raw",
                "ratio_vs_same_descs"):
        assert line[key] > 0, (key, line[key])
    assert line["descs_ms"] >= 0 and line["raw_descriptors"] == line["feeds"]
    assert line["bytes"] == sum(line["bytes_per_feed"]) and line["descriptors"] == sum(line["descriptors_per_feed"])
    return line


def test_tp_feeds_equal_page_sizes():
    """Prefill TP 2 into decode TP 1, 16-token pages: two feeds, each one rank's 4 heads of every page of
    every region (a page item holds its heads outermost, so 4 heads are one block on both sides; the
    next region is not, on the decode), the aux record on feed (0, 0). The bench itself fails unless
    the decode holds the prefill's bytes for every head and token."""
    line = tp_line("--prefill-tp", "2", "--decode-tp", "1")
    num_pages, num_regions = TOKENS // 16, 2 * LAYERS
    assert line["feed_ranks"] == [[0, 0], [1, 0]] and line["feeds_in_daemons"]
    half = num_regions * num_pages * PAGE_BYTES // 2
    assert line["bytes_per_feed"] == [half + AUX_BYTES, half]
    assert line["descriptors_per_feed"] == [num_regions * num_pages + 1, num_regions * num_pages]


def test_tp_feeds_different_page_sizes():
    """Prefill TP 1 (16-token pages) into decode TP 2 (32-token pages): one copy per head per 16-token
    segment of each region, heads of one prefill page contiguous on the prefill only."""
    line = tp_line("--prefill-tp", "1", "--decode-tp", "2", "--decode-page-size", "32")
    num_pages, num_regions = TOKENS // 16, 2 * LAYERS
    assert (line["prefill_page_size"], line["decode_page_size"]) == (16, 32)
    assert line["feed_ranks"] == [[0, 0], [0, 1]]
    half = num_regions * num_pages * PAGE_BYTES // 2
    assert line["bytes_per_feed"] == [half + AUX_BYTES, half]
    # 4 heads per decode rank, 4 segments (one per prefill page) per region: heads stay apart on the decode's rows
    assert line["descriptors_per_feed"] == [num_regions * num_pages * 4 + 1, num_regions * num_pages * 4]
