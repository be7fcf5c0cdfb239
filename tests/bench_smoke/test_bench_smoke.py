"""The benchmarks run end to end at tiny sizes and print the JSON they promise (no timing checks:
figures on a shared CI machine mean nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.cluster import tiny_model_dirs

REPO = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str) -> list[dict]:
    tiny_model_dirs()  # made once, under the lock the benchmarks share
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return [json.loads(line) for line in lines]


def test_spec_bench_prints_one_json_line():
    (record,) = run_bench("spec.py", "--new-tokens", "12", "--reps", "1", "--batch", "2")
    assert record["bench"] == "spec"
    assert {"k", "acceptance_rate", "tokens_per_s_plain", "tokens_per_s_spec", "speedup", "hw", "git"} <= record.keys()
    assert record["k"] == 4 and record["batch"] == 2 and record["outputs_equal"] is True
    assert 0 < record["acceptance_rate"] <= 1
    assert record["tokens_per_s_plain"] > 0 and record["tokens_per_s_spec"] > 0 and record["speedup"] > 0


def test_extend_bench_prints_one_json_line_per_case():
    records = run_bench("extend.py", "--model", tiny_model_dirs()[0], "--device", "cpu", "--dtype", "float32",
                        "--cases", "2x24@40,1x8@16", "--reps", "1", "--kv-budget-gib", "0.01")
    assert [(r["chunks"], r["new_tokens"], r["cached_tokens"]) for r in records] == [(2, 24, 40), (1, 8, 16)]
    for r in records:
        assert r["bench"] == "extend" and {"hw", "git", "matmul_tflops"} <= r.keys()
        # the scratch reference: whole prompts of cached + new tokens, as many as hold the case's new tokens
        assert r["scratch_prompt_tokens"] == r["cached_tokens"] + r["new_tokens"]
        assert r["scratch_prompts"] == max(1, round(r["chunks"] * r["new_tokens"] / r["scratch_prompt_tokens"]))
        assert r["extend_ms"] > 0 and r["scratch_ms"] > 0 and r["extend_kernel_ms"] > 0 and r["gemm_floor_ms"] > 0
        tokens = r["chunks"] * r["new_tokens"]
        assert abs(r["extend_us_per_token"] * tokens / 1e3 - r["extend_ms"]) <= 0.01 + 0.005 * tokens / 1e3


def test_e2e_bench_prints_one_json_line_per_configuration():
    records = run_bench("e2e.py", "--prompt-tokens", "20,40", "--concurrency", "2", "--new-tokens", "3",
                        "--reps", "1", "--churn", "8",
                        "--prefill-args", "--staging-bytes 1048576 --staging-chunk-bytes 131072 "
                                          "--staging-crossover-runs 1",
                        "--decode-args", "--staging-bytes 16777216")
    assert [(r["pool"], r["prompt_tokens"], r["concurrency"]) for r in records] == [
        ("fresh", 20, 2), ("fresh", 40, 2), ("churned", 20, 2), ("churned", 40, 2)]
    assert records[-1]["churn_requests"] == 8
    for r in records:  # every room of the warm-up and the measured wave was staged, and counted
        assert r["rooms_by_path"] == {"staged": 2 * 2}, r["rooms_by_path"]
    keys = {"ttft_ms_p50_colocated", "ttft_ms_p50_disagg", "ttft_overhead_ms", "kv_transfer_ms_p50",
            "tokens_per_s_colocated", "tokens_per_s_disagg", "overhead_minus_transfer_ms",
            "kv_wait_ms_p50", "prefill_answer_ms_p50", "ttft_ms_p50_inprocess"}
    for r in records:
        assert r["bench"] == "e2e" and r["colocated_mode"] == "http" and keys <= r.keys()
        assert r["ttft_ms_p50_colocated"] > 0 and r["ttft_ms_p50_disagg"] > 0
        assert r["kv_transfer_ms_p50"] > 0  # every wave's WRITE showed up in the prefill's metrics
        assert r["tokens_per_s_colocated"] > 0 and r["tokens_per_s_disagg"] > 0



def test_multiturn_bench_prints_one_json_line_per_turn_and_side():
    records = run_bench("multiturn.py", "--conversations", "2", "--system-tokens", "64", "--turns", "3",
                        "--user-tokens", "32", "--new-tokens", "4", "--sides", "off,on,local",
                        "--local-prefill-tokens", "64")
    turns = [r for r in records if r["turn"] != "all"]
    assert [(r["turn"], r["side"]) for r in turns] == [(t, s) for t in (1, 2, 3) for s in ("off", "on", "local")]
    by = {(r["turn"], r["side"]): r for r in turns}
    for t in (1, 2, 3):
        off = by[t, "off"]
        assert off["prefill_hits"] == off["decode_hits"] == 0 and off["computed"] == off["prompt_tokens"]
        for side in ("on", "local"):
            r = by[t, side]
            assert r["outputs_equal"] is True, (t, side)  # greedy answers equal the caches-off side's
            assert r["prompt_tokens"] == off["prompt_tokens"]
            assert r["batch_tokens"] == r["computed"], json.dumps(r)  # the prefill's batches ran what it computed
            if t > 1:  # the previous turn's prompt (prefill) and prompt + answer (decode) were held
                assert r["decode_hits"] > 0 and r["meta_cached_tokens"] > 0, json.dumps(r)
                if side == "on":
                    assert r["prefill_hits"] > 0 and r["computed"] + r["prefill_hits"] == r["prompt_tokens"]
                else:  # a local room's prefill leg computes nothing if the decode's word came before its forward
                    assert r["computed"] + r["prefill_hits"] <= r["prompt_tokens"], json.dumps(r)
                assert r["ttft_p50_vs_off"] > 0
        if t > 1:
            assert 0 < by[t, "on"]["bytes_written"] < off["bytes_written"]
            assert by[t, "local"]["bytes_written"] == 0 and by[t, "local"]["local_rooms"] == 2
    summary = {r["side"]: r for r in records if r["turn"] == "all"}
    assert summary.keys() == {"on", "local"} and all(s["outputs_equal"] for s in summary.values())
    assert summary["on"]["computed"] < summary["on"]["computed_off"]


def test_router_policies_bench_prints_one_json_line_per_pair():
    records = run_bench("router_policies.py", "--conversations", "2", "--turns", "2", "--system-tokens", "64",
                        "--user-tokens", "32", "--new-tokens", "4", "--pairs", "round_robin:random,manual:manual")
    assert [(r["prefill_policy"], r["decode_policy"]) for r in records] == [("round_robin", "random"),
                                                                           ("manual", "manual")]
    keys = {"prefill_hit_fraction", "decode_hit_fraction", "prefill_hit_bound", "decode_hit_bound",
            "prefill_history_hit_fraction", "decode_history_hit_fraction", "kept_prefill", "kept_decode",
            "requests_by_prefill", "requests_by_decode", "routes", "cache_aware_random_picks", "hw", "git"}
    for r in records:
        assert r["bench"] == "router_policies" and keys <= r.keys(), r
        assert r["outputs_equal"] is True and r["cache_aware_random_picks"] == 0
        assert sum(r["requests_by_prefill"]) == sum(r["requests_by_decode"]) == 2 * 2
        assert r["shared_prefix_tokens"] == 64  # the system prompt, in whole 16-token pages
        for side in ("prefill", "decode"):  # a hit never exceeds what the conversation's own daemon held
            assert 0 <= r[f"{side}_hit_fraction"] <= r[f"{side}_hit_bound"] < 1
    sticky = records[1]  # one routing key per conversation: each keeps its prefill and its decode
    assert sticky["kept_prefill"] == sticky["kept_decode"] == 2
    assert all(len(set(route)) == 1 for side in ("prefill", "decode") for route in sticky["routes"][side])
    # the decode held each conversation's previous prompt and answer, the prefill its previous prompt
    assert sticky["decode_history_hit_fraction"] == sticky["decode_history_hit_bound"] > 0
    assert sticky["prefill_history_hit_fraction"] == sticky["prefill_history_hit_bound"] > 0


def test_fused_quant_bench_checks_every_configuration_against_the_separate_pair():
    """``--dry-run``: tiny widths under Triton's interpreter; each configuration's output is compared
    with the separate kernel + per-token quant before it is timed (a mismatch fails the run)."""
    records = run_bench("fused_quant.py", "--dry-run", "--rows", "3")
    assert [(r["case"], r["rows"]) for r in records] == [("norm", 3), ("silu", 3)]
    for r in records:
        assert r["bench"] == "fused_quant" and {"best", "best_us", "default_us", "baseline_us", "git"} <= r.keys()
        assert r["best_us"] == min(r["all"].values())


def test_moe_align_bench_checks_the_kernel_against_the_torch_sort():
    """``--dry-run`` under Triton's interpreter: each warp count's tensors equal the torch path's."""
    records = run_bench("moe_align.py", "--dry-run", "--cases", "64x128x16,300x64x16", "--warps", "4")
    assert [(r["slots"], r["experts"], r["block_m"]) for r in records] == [(64, 128, 16), (300, 64, 16)]
    assert all(r["bench"] == "moe_align" and r["best_warps"] == 4 and "torch_us" in r for r in records)


def test_gemv_tune_bench_sweeps_under_the_interpreter_and_says_how_l2_was():
    """``--dry-run``: each configuration is checked against the default's output before it is timed;
    every line says whether the weights were read cold (copies rotated past L2, the default) or hot."""
    records = run_bench("gemv_tune.py", "--dry-run", "--cases", "bf16", "--weights", "qkv")
    assert [(r["case"], r["weight"], r["l2"]) for r in records] == [("bf16", "qkv", "cold")]
    assert {"best", "best_us", "default_us", "baseline_us"} <= records[0].keys()
    assert "late_sum" in records[0]["best"]
    hot = run_bench("gemv_tune.py", "--dry-run", "--cases", "bf16", "--weights", "qkv", "--hot")
    assert [r["l2"] for r in hot] == ["hot"]


def test_gemv_tune_sweeps_the_late_sum_for_one_row_and_writes_it_into_the_table(tmp_path, monkeypatch):
    """One-row configurations come both ways (a sum every K step, late_sum 0, and once after the loop, 1); the
    dot path's only as 0, which it ignores. A table entry keeps the winner's late_sum as its sixth value."""
    from bench import gemv_tune
    from kvferry.common.kernels import gemv_tiles

    one_row = gemv_tune.gemv_configs(False, quick=True)
    assert {c.late_sum for c in one_row} == {0, 1}
    assert {c._replace(late_sum=0) for c in one_row if c.late_sum} == {c for c in one_row if not c.late_sum}
    assert {c.late_sum for rows in (4, 32) for c in gemv_tune.gemv_configs(True, quick=True, rows=rows)} == {0}
    path = tmp_path / "tiles.json"
    monkeypatch.setitem(gemv_tune.TABLE, "path", str(path))
    best = gemv_tiles.GemvConfig(8, 512, 4, 3, 1, late_sum=1)
    gemv_tune.table_entry("bf16", 1, 2048, 4096, {"best": best._asdict(), "best_us": 9.0, "default_us": 10.0})
    assert gemv_tiles.read_table(str(path)) == {("bf16", 1, 2048, 4096): best}


def test_attn_tune_bench_sweeps_under_the_interpreter_over_pool_copies():
    """``--dry-run``: the decode attention's tiles and split counts, each checked against the default's output
    before it is timed, each captured call reading the next copy of the pool (a line says ``cold``)."""
    records = run_bench("attn_tune.py", "--dry-run")
    assert [(r["batch"], r["context"], r["l2"]) for r in records] == [(2, 40, "cold")]
    assert {"best", "best_us", "default_us", "by_splits"} <= records[0].keys()


def test_gemv_tune_rotation_gives_each_call_the_next_copy():
    """The cold sweep's calls read copies round robin, so a graph of calls never rereads the copy just read."""
    from bench.gemv_tune import Rotation

    copies = ["a", "b", "c"]
    rotation = Rotation(copies)
    assert [rotation() for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]
