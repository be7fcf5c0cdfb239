#!/usr/bin/env bash
# One pass on the GPU machine: install the carried wheels, check the GPU path, then measure.
#   bash bench/gpu_run.sh [tests|engine|transfer|transfer-small|transfer-mla|chooser|staging|spec|e2e|e2e-cache|multiturn|prefix-ttft|extend|
#                          xfer-threads|fp8-a|fp8-b|fp8-rows|decode-fusions|fused-quant|fused-tune|moe-align|summary|pdl|pdl-tests|launch|gemv-one-row|tiles|l2|gemv-cold|late-sum|attn|mla|merge|moe-routed|moe|moe-e2e|moe-tune|gemv|gemv-fp8|decode-gemms|all]   (results land in $OUT, default ./gpu-out)
# The machine has torch with CUDA but no NIXL, pyzmq, FastAPI...: those travel in .whl/
# (bash ../shared/tools/device-wheels.sh xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 gguf==0.19.0: the
# GPU image has neither xgrammar nor gguf). NVLink multicast stays off. The device's copy of the tree may hold an
# older .git than its files: KVFERRY_GIT=<the local `git describe --always --dirty`> names the tree in every line.
set -uo pipefail
what=${1:-all}
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, sys, importlib.metadata as m; print("python", sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "nixl", m.version("nixl_cu13"))'
} 2>&1 | tee "$out/env.txt"
# each step has its own time limit, so that one slow step still leaves the others' results in $OUT
if [[ $what == tests || $what == all ]]; then
  # tests/gpu includes the Triton kernels against the torch path and the CUDA-graph engine
  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_nixl_engine.py \
    tests/unit/test_model_vs_transformers.py tests/unit/test_attn_backend.py 2>&1 | tee "$out/tests.txt" | tail -25
fi
if [[ $what == transfer-small ]]; then  # the sizes where a ratio is a few tens of µs: more iterations
  timeout 150 python3 bench/transfer.py --device cuda --tokens 1024,4096 --iters 30 \
    2>>"$out/transfer.err" | tee -a "$out/transfer.jsonl"
fi
if [[ $what == transfer-mla ]]; then  # DeepSeek-V3's latent rooms (61 layers x 1,152 B a token): goal >= 0.9 of raw NIXL
  timeout 200 python3 bench/transfer.py --device cuda --cache-form mla --tokens 1024,4096,16384 --iters 10 \
    2>>"$out/transfer-mla.err" | tee -a "$out/transfer-mla.jsonl"
fi
if [[ $what == chooser ]]; then  # issue 24 item 10: the staging chooser against both paths' measured times (~2 min)
  timeout 150 python3 bench/transfer.py --device cuda --tokens 4096,16384 --iters 5 \
    2>>"$out/chooser.err" | tee -a "$out/chooser.jsonl"
  python3 -c 'import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    ok = (r["chooser"] == "staged") == r["staged_beats_direct"]
    print(r["tokens"], r["layout"], "runs", r["runs"], "direct_ms", r["kvferry_ms"], "staged_ms", r["staged_ms"],
          "chooser", r["chooser"], "model", r["model_direct_ms"], r["model_staged_ms"], "per_write_us",
          r["per_write_us"], "AGREES" if ok else "DISAGREES")' "$out/chooser.jsonl" | tee "$out/chooser.txt"
fi
if [[ $what == transfer || $what == all ]]; then
  # every line also carries the room staged as the daemons stage it (staged_ms, ratio_staged_vs_raw, chooser)
  timeout 200 python3 bench/transfer.py --device cuda --tokens 1024,4096,16384 --iters 10 \
    2>>"$out/transfer.err" | tee -a "$out/transfer.jsonl"
  # NIXL's UCX thread pool splits a request of >= 1,024 descriptors over its workers
  timeout 100 python3 bench/transfer.py --device cuda --tokens 16384 --iters 5 --num-threads 4 \
    2>>"$out/transfer.err" | tee -a "$out/transfer.jsonl"
fi
if [[ $what == staging || $what == all ]]; then
  # issue 17: the kernels against the torch reference first; then, in two processes (cuda_ipc), the Triton
  # gather/scatter (a sweep of their configurations, the fastest kept) and torch's index ops beside a
  # scattered, a one-descriptor, a staged and a pipelined staged WRITE of 2 MiB pages (a Llama-3-8B
  # page-major block of 16 tokens); one room size a call, each with its own limit
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_staging.py 2>&1 \
    | tee "$out/staging-tests.txt" | tail -5
  sweep=${STAGING_SWEEP:-1024x4x1,4096x8x1,4096x8x4,8192x8x2,8192x16x4,16384x16x1,2048x4x8,4096x4x8}
  timeout 150 python3 bench/staging.py --device cuda --page-kib 2048 --pages 256 --iters 10 --chunks 8 \
    --triton-block "$sweep" 2>>"$out/staging.err" | tee -a "$out/staging.jsonl"
  timeout 190 python3 bench/staging.py --device cuda --page-kib 2048 --pages 1024 --iters 10 --chunks 8 \
    --triton-block "$sweep" 2>>"$out/staging.err" | tee -a "$out/staging.jsonl"
fi
m8b=/tmp/m8b
if [[ $what == spec || $what == e2e || $what == e2e-churn || $what == engine || $what == xfer-threads || $what == multiturn \
    || $what == e2e-cache || $what == extend || $what == all ]] \
    && [[ ! -f $m8b/draft/config.json ]]; then
  timeout 200 python3 -m kvferry.common.cli make-tiny-model $m8b --preset llama-3.1-8b 2>&1 | tail -2
fi
if [[ $what == e2e-churn ]]; then
  # issue 17: TTFT overhead of disaggregation at 64 concurrent 1k-token requests on a fresh pool and after
  # 1,000 requests of churn (random lengths, out-of-order ends), with staging on (the CUDA default) and off
  for side in ${E2E_SIDES:-on off}; do
    args=""; [[ $side == off ]] && args="--staging-bytes 0"
    timeout ${E2E_TIMEOUT:-240} python3 bench/e2e.py --device cuda --model $m8b/target --prompt-tokens 1024 \
      --concurrency 64 --new-tokens 16 --reps ${E2E_REPS:-3} --churn ${E2E_CHURN:-1000} --no-inprocess \
      --prefill-args "$args" --decode-args "$args" 2>>"$out/e2e.err" | tee -a "$out/e2e-churn.jsonl"
  done
fi
if [[ $what == engine || $what == all ]]; then
  # decode steps and prefill against the roofline measured in the same run; then the torch path without
  # graphs (the engine before the Triton kernels) at a few points, for comparison
  timeout ${ENGINE_TIMEOUT:-200} python3 bench/engine.py --model $m8b/target 2>>"$out/engine.err" | tee -a "$out/engine.jsonl"
  [[ ${ENGINE_BASELINE:-1} == 1 ]] && timeout 120 python3 bench/engine.py --model $m8b/target \
    --attention-backend torch --disable-cuda-graph --batches 1,64 --contexts 1024 --prefill 8192 --steps 10 \
    2>>"$out/engine.err" | tee -a "$out/engine.jsonl"
fi
if [[ $what == spec || $what == all ]]; then
  # float32 on the GPU: speculative and plain greedy must agree token for token (the tiny pair)
  timeout 60 python3 bench/spec.py --device cuda --dtype float32 --batch 4 --reps 3 \
    2>>"$out/spec.err" | tee -a "$out/spec.jsonl"
  for batch in 1 8; do
    timeout 100 python3 bench/spec.py --device cuda --model $m8b/target --draft $m8b/draft --batch $batch \
      --reps 5 2>>"$out/spec.err" | tee -a "$out/spec.jsonl"
  done
fi
if [[ $what == e2e || $what == all ]]; then
  # three 8B servers share one GPU: each KV pool holds 150k tokens (18 GiB), so waves of more than
  # 140k prompt tokens (64 x 8k) are skipped; the in-process floor would be a fourth model copy
  timeout ${E2E_TIMEOUT:-450} python3 bench/e2e.py --device cuda --model $m8b/target --draft $m8b/draft \
    --prompt-tokens ${E2E_PROMPTS:-1024,8192} --concurrency ${E2E_CONC:-1,16,64} --reps ${E2E_REPS:-3} \
    --max-total-tokens 150000 --max-wave-tokens 140000 --no-inprocess 2>"$out/e2e.err" | tee "$out/e2e.jsonl"
fi
if [[ $what == multiturn ]]; then
  # issue 26: conversations through sglang-router (carry its wheel: device-wheels.sh sglang-router==0.3.2 orjson
  # setproctitle), caches off and on (and the decode's local prefill with MT_SIDES=off,on,local), one side's
  # daemons on the GPU at a time; the 8B preset's defaults (16 x 2,048 + 8 turns x (512 + 64)). First the tiny
  # checkpoint in float32, where greedy answers with caches on must equal those with caches off
  timeout 150 python3 bench/multiturn.py --device cuda --dtype float32 --preset cpu --sides off,on,local \
    --local-prefill-tokens 128 2>>"$out/multiturn.err" | tee -a "$out/multiturn-tiny-fp32.jsonl"
  timeout ${MT_TIMEOUT:-480} python3 bench/multiturn.py --device cuda --model $m8b/target --apart \
    --sides ${MT_SIDES:-off,on} --local-prefill-tokens ${MT_LOCAL:-1024} --log-dir "$out/multiturn-logs" \
    --prefill-args "${MT_PREFILL_ARGS:-}" --decode-args "${MT_DECODE_ARGS:-}" \
    2>>"$out/multiturn.err" | tee -a "$out/multiturn.jsonl"
fi
if [[ $what == prefix-ttft ]]; then
  # issue 26 in one call: the 8B checkpoint is written in the background while the GPU tests of the prefix
  # extend (SDPA after a cached prefix) and of the aligned plan rows run, and the tiny float32 multiturn (off,
  # on) runs over its own Triton cache, whose compiles are listed with their times beside the turns' (a
  # kernel compiled after the warm-up stalls a turn); then the 8B multiturn, off and on, one side at a time.
  # PT_TESTS=0 / PT_TINY=0 skip the tests / the tiny run (a device call brings back at most 8 files)
  timeout 240 python3 -m kvferry.common.cli make-tiny-model $m8b --preset llama-3.1-8b > "$out/m8b.log" 2>&1 &
  m8b_pid=$!
  if [[ ${PT_TESTS:-1} == 1 ]]; then
    timeout ${TESTS_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py \
      tests/gpu/test_prefix_extend_gpu.py tests/gpu/test_triton_fp8_kv.py 2>&1 | tee "$out/prefix-tests.txt" | tail -4
  fi
  stamp() { while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "${line:0:90}"; done; }
  compiles() { find "$1" -name '*.json' ! -name '__grp__*' -printf '%T@ %f\n' | sort -n; }
  if [[ ${PT_TINY:-1} == 1 ]]; then
    TRITON_CACHE_DIR=/tmp/tc-tiny timeout 120 python3 bench/multiturn.py --device cuda --dtype float32 --preset cpu \
      --sides off,on 2>>"$out/multiturn.err" | tee -a "$out/multiturn-tiny-fp32.jsonl" \
      | stamp > "$out/multiturn-tiny-times.txt"
    compiles /tmp/tc-tiny > "$out/multiturn-tiny-compiles.txt"
  fi
  wait $m8b_pid; tail -2 "$out/m8b.log"
  TRITON_CACHE_DIR=/tmp/tc-8b timeout ${MT_TIMEOUT:-330} python3 bench/multiturn.py --device cuda --model $m8b/target \
    --apart --sides ${MT_SIDES:-off,on} --local-prefill-tokens ${MT_LOCAL:-1024} \
    2>>"$out/multiturn.err" | tee -a "$out/multiturn.jsonl" | stamp > "$out/multiturn-8b-times.txt"
  compiles /tmp/tc-8b > "$out/multiturn-8b-compiles.txt"
fi
if [[ $what == extend ]]; then
  # issue 26: a wave of prefix hits' extends (576 new tokens over 2.6 k / 7.2 k cached, the multiturn's turns 2 and 8)
  # against the same new tokens from scratch and against the Triton extend kernel, with the top CUDA kernels
  timeout ${EXTEND_TIMEOUT:-240} python3 bench/extend.py --model $m8b/target --profile \
    --cases ${EXTEND_CASES:-14x576@2560,14x576@7168,9x576@2560} 2>>"$out/extend.err" | tee -a "$out/extend.jsonl"
fi
if [[ $what == e2e-cache ]]; then
  # issue 26: single-turn figures with the prefix cache on (the default) and off, same run: random prompts never hit,
  # so this is the cache's own cost (match, insert, eviction on admission)
  for side in ${E2E_SIDES:-on off}; do
    args=""; [[ $side == off ]] && args="--disable-prefix-cache"
    timeout ${E2E_TIMEOUT:-150} python3 bench/e2e.py --device cuda --model $m8b/target --prompt-tokens 1024 \
      --concurrency ${E2E_CONC:-1,16} --reps ${E2E_REPS:-3} --no-inprocess --prefill-args="$args" --decode-args="$args" \
      2>>"$out/e2e-cache.err" | sed "s/^{/{\"prefix_cache\": \"$side\", /" | tee -a "$out/e2e-cache.jsonl"
  done
fi
if [[ $what == xfer-threads ]]; then
  # concurrent rooms: WRITEs in flight at once on the prefill, 2 against 8 (the GPU default since), same waves
  for n in 2 8; do
    timeout 150 python3 bench/e2e.py --device cuda --model $m8b/target --prompt-tokens 1024 --concurrency 16 \
      --reps 5 --max-total-tokens 40000 --no-inprocess --prefill-args "--xfer-threads $n" \
      2>>"$out/xfer-threads.err" | tee -a "$out/xfer-threads.jsonl"
  done
fi
# issue 28: FP8 on the 8B preset, in two calls (each under the device's 10-minute limit; a fresh machine each time,
# so each builds its checkpoints: the FP8 ones from the same seed as /tmp/m8b, in parallel with it).
# fp8-a: the FP8 kernel and graph tests, then bench/engine.py for bf16, FP8 weights (per channel) and FP8 weights +
# FP8 KV side by side, each run measuring its own rooflines (HBM copy, bf16 matmul, FP8 _scaled_mm at 8192^3), and
# an FP8 room against a bf16 one in bench/transfer.py. fp8-b: 128x128-block FP8 in bench/engine.py, and a
# converting pair (bf16 prefill -> FP8 decode) against an FP8 -> FP8 pair in bench/e2e.py.
fp8c=/tmp/m8b-fp8c fp8b=/tmp/m8b-fp8b
fp8_build() {  # /tmp/m8b and the FP8 checkpoints named, all in parallel
  local q pids=()
  if [[ ! -f $m8b/draft/config.json ]]; then
    ( start=$(date +%s); timeout 300 python3 -m kvferry.common.cli make-tiny-model $m8b --preset llama-3.1-8b 2>&1 \
        | tail -1; echo "built bf16 in $(( $(date +%s) - start )) s" ) &
    pids+=($!)
  fi
  for q in "$@"; do
    [[ -f /tmp/m8b-fp8${q:0:1}/target/config.json ]] && continue
    ( start=$(date +%s); timeout 300 python3 -m kvferry.common.cli make-tiny-model /tmp/m8b-fp8${q:0:1} \
        --preset llama-3.1-8b --quantize fp8-$q 2>&1 | tail -1; echo "built fp8-$q in $(( $(date +%s) - start )) s" ) &
    pids+=($!)
  done
  wait "${pids[@]}"
}
build_models() {  # $1, a comma list such as ,ds,fp8,: those steps' models (fp8, ds, qwen) built in the background
  local preset
  [[ $1 == *,fp8,* ]] && { fp8_build channel > "$out/build.txt" 2>&1 & }
  for preset in $([[ $1 == *,ds,* ]] && echo deepseek-v2-lite) $([[ $1 == *,qwen,* ]] && echo qwen3-30b-a3b); do
    [[ -f /tmp/$preset/target/config.json ]] && continue
    ( timeout 300 python3 -m kvferry.common.cli make-tiny-model /tmp/$preset --preset $preset 2>&1 | tail -1 ) \
      >> "$out/build.txt" &
  done
}
fp8_engine() {  # label, then bench/engine.py arguments
  local label=$1; shift
  timeout ${ENGINE_TIMEOUT:-200} python3 bench/engine.py --batches ${FP8_BATCHES:-1,8,64,128} \
    --contexts ${FP8_CONTEXTS:-1024,8192} --prefill ${FP8_PREFILL:-1024,8192,32768} "$@" 2>>"$out/fp8-engine.err" \
    | sed "s/^{/{\"variant\": \"$label\", /" | tee -a "$out/fp8-engine.jsonl"
}
if [[ $what == fp8-a ]]; then
  fp8_build channel &
  build=$!
  timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_fp8_gemm.py \
    tests/gpu/test_triton_fp8_kv.py tests/gpu/test_engine_graphs.py tests/unit/test_fp8_gemm.py 2>&1 \
    | tee "$out/fp8-tests.txt" | tail -8
  wait $build
  fp8_engine bf16 --model $m8b/target
  fp8_engine fp8-channel --model $fp8c/target
  fp8_engine fp8-channel+fp8-kv --model $fp8c/target --kv-cache-dtype fp8_e4m3
  for dt in bfloat16 float8_e4m3fn; do
    timeout 100 python3 bench/transfer.py --device cuda --tokens 4096,16384 --iters 10 --kv-dtype $dt \
      2>>"$out/fp8-transfer.err" | tee -a "$out/fp8-transfer.jsonl"
  done
fi
if [[ $what == fp8-b ]]; then
  # the whole GPU suite (every kernel against its reference, graphs) while the checkpoints build; then bf16, per-channel
  # and block FP8 side by side at the points (batch 1 and 64 at 1k, prefill 8k), and the converting pair
  fp8_build channel block &
  build=$!
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/tests.txt" | tail -15
  wait $build
  for v in bf16:$m8b fp8-channel:$fp8c fp8-block:$fp8b; do
    fp8_engine ${v%%:*} --model ${v#*:}/target --batches 1,64 --contexts 1024 --prefill 8192
  done
  fp8_engine fp8-channel+fp8-kv --model $fp8c/target --batches 1,64 --contexts 1024 --prefill "" --kv-cache-dtype fp8_e4m3
  for pair in "convert:" "fp8:--kv-cache-dtype fp8_e4m3"; do
    timeout ${E2E_TIMEOUT:-120} python3 bench/e2e.py --device cuda --model $m8b/target --prompt-tokens 1024 \
      --concurrency 1,16 --reps ${E2E_REPS:-3} --max-total-tokens 60000 --no-inprocess \
      --prefill-args="${pair#*:}" --decode-args="--kv-cache-dtype fp8_e4m3" 2>>"$out/fp8-e2e.err" \
      | sed "s/^{/{\"pair\": \"${pair%%:*}\", /" | tee -a "$out/fp8-e2e.jsonl"
  done
fi
if [[ $what == moe ]]; then
  # issue 29: the GPU-sized MoE and MLA presets (random weights, bf16) against their rooflines: a decode step reads the
  # dense weights plus the experts the batch touches (bench/_roofline.py) and the KV (the latent rows for DeepSeek)
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    ( start=$(date +%s); timeout 300 python3 -m kvferry.common.cli make-tiny-model /tmp/$preset --preset $preset 2>&1 \
        | tail -1; echo "built $preset in $(( $(date +%s) - start )) s" ) &
  done
  # meanwhile the MoE and MLA kernels against their references in real shapes, and DeepSeek's graphs
  timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_triton_mla.py \
    tests/gpu/test_mla_prefill_gpu.py tests/gpu/test_triton_moe.py tests/gpu/test_deepseek_graphs.py 2>&1 | tee "$out/moe-tests.txt" | tail -8
  wait
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    timeout ${ENGINE_TIMEOUT:-150} python3 bench/engine.py --model /tmp/$preset/target --batches 1,8,64,128 \
      --contexts 1024,8192 --prefill 1024,8192 2>>"$out/moe-engine.err" | tee -a "$out/moe-engine.jsonl"
  done
fi
if [[ $what == gemv ]]; then
  # the decode-sized GEMMs (common/kernels/triton_gemv.py): their kernels against the references, a sweep of their tile
  # configurations beside what they replace (bench/gemv_tune.py), then the MoE presets' decode steps and an MLA room
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    ( start=$(date +%s); timeout 300 python3 -m kvferry.common.cli make-tiny-model /tmp/$preset --preset $preset 2>&1 \
        | tail -1; echo "built $preset in $(( $(date +%s) - start )) s" ) &
  done
  timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_triton_gemv.py \
    tests/gpu/test_triton_moe.py tests/gpu/test_triton_fp8_gemm.py ${GEMV_TESTS:-} 2>&1 | tee "$out/gemv-tests.txt" | tail -8
  timeout ${TUNE_TIMEOUT:-200} python3 bench/gemv_tune.py ${TUNE_ARGS:-} 2>>"$out/gemv-tune.err" | tee -a "$out/gemv-tune.jsonl" \
    | cut -c1-400
  wait
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    timeout ${ENGINE_TIMEOUT:-120} python3 bench/engine.py --model /tmp/$preset/target --batches ${GEMV_BATCHES:-1,4,8,64} \
      --contexts 1024 --prefill ${GEMV_PREFILL:-8192} 2>>"$out/gemv-engine.err" | tee -a "$out/gemv-engine.jsonl"
  done
  timeout 150 python3 bench/transfer.py --device cuda --cache-form mla --tokens 1024,4096,16384 --iters 10 \
    2>>"$out/transfer-mla.err" | tee -a "$out/transfer-mla.jsonl"
fi
if [[ $what == gemv-fp8 ]]; then
  # the 8B preset in bf16 and both FP8 formats with the decode-sized GEMMs, side by side; the GEMV sweep timed in CUDA
  # graphs; DeepSeek's prefill in the expanded MLA form
  fp8_build channel block &
  build=$!
  ( timeout 200 python3 -m kvferry.common.cli make-tiny-model /tmp/deepseek-v2-lite --preset deepseek-v2-lite 2>&1 \
      | tail -1 ) &
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_triton_gemv.py \
    tests/gpu/test_triton_fp8_gemm.py tests/gpu/test_engine_graphs.py tests/gpu/test_mla_prefill_gpu.py \
    tests/gpu/test_triton_mla.py tests/gpu/test_deepseek_graphs.py tests/gpu/test_triton_moe.py 2>&1 \
    | tee "$out/gemv-fp8-tests.txt" | tail -12
  timeout ${TUNE_TIMEOUT:-150} python3 bench/gemv_tune.py ${TUNE_ARGS:-} 2>>"$out/gemv-tune.err" \
    | tee -a "$out/gemv-tune.jsonl" | cut -c1-300
  wait
  for v in bf16:$m8b fp8-channel:$fp8c fp8-block:$fp8b; do
    fp8_engine ${v%%:*} --model ${v#*:}/target --batches 1,8,64 --contexts 1024 --prefill 8192
  done
  timeout ${ENGINE_TIMEOUT:-120} python3 bench/engine.py --model /tmp/deepseek-v2-lite/target --batches 1,64 \
    --contexts 1024 --prefill 1024,8192 2>>"$out/gemv-engine.err" | tee -a "$out/gemv-engine.jsonl"
fi
if [[ $what == decode-gemms ]]; then
  # one pass over the decode-sized GEMMs with their tuned tiles and the fused MoE's grouped GEMM table: the kernel and
  # graph tests while every checkpoint builds, the grouped GEMM sweep at prefill sizes, the FP8 GEMV sweep, then
  # bench/engine.py on the 8B preset (bf16, both FP8 formats) and both MoE presets
  fp8_build channel block &
  build=$!
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    ( timeout 300 python3 -m kvferry.common.cli make-tiny-model /tmp/$preset --preset $preset 2>&1 | tail -1 ) &
  done
  timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_triton_gemv.py \
    tests/gpu/test_triton_moe.py tests/gpu/test_deepseek_graphs.py tests/gpu/test_triton_fused.py \
    tests/gpu/test_engine_graphs.py::test_fp8_weights_graphs_agree 2>&1 | tee "$out/decode-gemms-tests.txt" | tail -12
  timeout ${MOE_TUNE_TIMEOUT:-150} python3 bench/moe_tune.py --tokens ${MOE_TUNE_TOKENS:-1024,8192} \
    2>>"$out/moe-tune.err" | tee -a "$out/moe-tune.jsonl" | cut -c1-200
  timeout ${TUNE_TIMEOUT:-100} python3 bench/gemv_tune.py --cases fp8 2>>"$out/gemv-tune.err" \
    | tee -a "$out/gemv-tune.jsonl" | cut -c1-200
  wait
  for v in bf16:$m8b fp8-channel:$fp8c fp8-block:$fp8b; do
    ENGINE_TIMEOUT=70 fp8_engine ${v%%:*} --model ${v#*:}/target --batches 1,8,64 --contexts 1024 --prefill 8192
  done
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    timeout 70 python3 bench/engine.py --model /tmp/$preset/target --batches 1,8,64 --contexts 1024 --prefill 8192 \
      2>>"$out/moe-engine.err" | sed "s/^{/{\"preset\": \"$preset\", /" | tee -a "$out/moe-engine.jsonl"
  done
fi
build_and_test() {  # result file, a -k expression, test paths: the tests (-v, so that a timeout still names them)
  # while /tmp/m8b, both FP8 checkpoints and both MoE presets build
  local file=$1 expr=$2; shift 2
  fp8_build channel block &
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    ( timeout 300 python3 -m kvferry.common.cli make-tiny-model /tmp/$preset --preset $preset 2>&1 | tail -1 ) &
  done
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -v -p no:cacheprovider --tb=short -k "$expr" "$@" > "$out/$file" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/$file" | tail -12
  wait
}
if [[ $what == fp8-rows ]]; then
  # issues 28/29: the weight-only FP8 GEMV past 16 rows (the K split, its shapes by takes_rows) and the one-launch
  # q/k norm, router and MLA rows: their GPU tests while every checkpoint builds; then the 8B decode steps with the
  # GEMV's row bound at its default and at 16 side by side, one decode step's CUDA kernels (--profile) for bf16,
  # both FP8 formats and both MoE presets, and last the GEMV sweep at 64 rows with x in FP8 beside it (--w8a8)
  build_and_test fp8-rows-tests.txt "${ROWS_K:-split_k or fits or fp8_x or takes or config or 40 or 128 or dense}" \
    tests/gpu/test_triton_gemv.py tests/gpu/test_triton_fused.py tests/gpu/test_triton_moe.py tests/gpu/test_triton_mla.py \
    tests/gpu/test_engine_graphs.py::test_fp8_weights_graphs_agree tests/gpu/test_deepseek_graphs.py
  budget="--kv-budget-gib 16"
  ENGINE_TIMEOUT=50 fp8_engine bf16 --model $m8b/target --batches 1,64 --contexts 1024 --prefill "" --profile 1,64 $budget
  ENGINE_TIMEOUT=80 fp8_engine fp8-channel --model $fp8c/target --batches ${ROWS_BATCHES:-1,8,32,64} \
    --contexts 1024 --prefill "" --fp8-gemv-rows 16 --profile 1,64 $budget
  ENGINE_TIMEOUT=50 fp8_engine fp8-block --model $fp8b/target --batches 1,64 --contexts 1024 --prefill "" \
    --fp8-gemv-rows 16 --profile 64 $budget
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    timeout 50 python3 bench/engine.py --model /tmp/$preset/target --batches 1,64 --contexts 1024 --prefill "" \
      --profile 1,64 $budget 2>>"$out/moe-engine.err" | sed "s/^{/{\"preset\": \"$preset\", /" \
      | tee -a "$out/moe-engine.jsonl" | cut -c1-200
  done
  timeout ${TUNE_TIMEOUT:-70} python3 bench/gemv_tune.py --cases fp8 --rows ${TUNE_ROWS:-64} --w8a8 --narrow \
    2>>"$out/moe-engine.err" | tee -a "$out/gemv-tune.jsonl" | cut -c1-160
fi
if [[ $what == decode-fusions ]]; then
  # the final pass over the same tree: the GPU tests of the new kernels and routes while every checkpoint builds;
  # bench/engine.py on the 8B preset (bf16, FP8 per channel with its W8A8 route past 16 rows against the old bound
  # of 16, FP8 blocks, FP8 weights + FP8 KV) and both MoE presets; then the varlen flash call's causal flag broken
  # on purpose (tests/MUTATIONS.md) and its tests run against the break
  build_and_test final-tests.txt \
    "${FINAL_K:-fp8_x or past_16 or fits or split_k or normalises or softmax_topk or latent_rows or tiny_deepseek or graphs}" \
    tests/gpu/test_triton_gemv.py tests/gpu/test_triton_fused.py tests/gpu/test_triton_moe.py tests/gpu/test_triton_mla.py \
    tests/gpu/test_engine_graphs.py tests/gpu/test_deepseek_graphs.py
  budget="--kv-budget-gib 16"
  ENGINE_TIMEOUT=45 fp8_engine bf16 --model $m8b/target --batches 1,8,64 --contexts 1024 --prefill "" $budget
  ENGINE_TIMEOUT=70 fp8_engine fp8-channel --model $fp8c/target --batches 1,8,32,64 --contexts 1024 --prefill "" \
    --fp8-gemv-rows 16 --profile 64 $budget
  ENGINE_TIMEOUT=45 fp8_engine fp8-block --model $fp8b/target --batches 1,8,64 --contexts 1024 --prefill "" $budget
  ENGINE_TIMEOUT=45 fp8_engine fp8-channel+fp8-kv --model $fp8c/target --batches 1,64 --contexts 1024 --prefill "" \
    --kv-cache-dtype fp8_e4m3 $budget
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    timeout 45 python3 bench/engine.py --model /tmp/$preset/target --batches 1,8,64 --contexts 1024 --prefill "" \
      --profile 1 $budget 2>>"$out/moe-engine.err" | sed "s/^{/{\"preset\": \"$preset\", /" \
      | tee -a "$out/moe-engine.jsonl" | cut -c1-200
  done
  f=common/layers/attn_backend.py
  cp $f /tmp/attn_backend.py.orig
  sed -i 's/plan.max_query, max_k, 0.0, True, False/plan.max_query, max_k, 0.0, False, False/' $f
  if ! cmp -s $f /tmp/attn_backend.py.orig; then
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py -k long_chunks_after_a_prefix \
      2>&1 | tail -3 | sed 's/^/mutation (varlen causal off): /' | tee "$out/mutation.txt"
  fi
  cp /tmp/attn_backend.py.orig $f
fi
if [[ $what == fused-quant ]]; then
  # issue 28: the per-token quant of the W8A8 linears fused into the norm and silu kernels that feed them: their GPU
  # tests (bit for bit against the separate quant) while the checkpoints build; the 8B FP8 per-channel decode steps
  # and the 8k prefill fused and unfused side by side (--fp8-unfused-quant), a batch-64 step's kernels both ways;
  # then both MoE presets' batch-64 step profiles with a distinct token per sequence
  fp8_build channel &
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    ( timeout 300 python3 -m kvferry.common.cli make-tiny-model /tmp/$preset --preset $preset 2>&1 | tail -1 ) &
  done
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -v -p no:cacheprovider --tb=short \
    -k "${FUSED_K:-quantizes_its_rows or fused_into or token_quant or scaled_mm_path or past_16 or fp8_x or fp8_weights_graphs or rms_norm or silu}" \
    tests/gpu/test_triton_fused.py tests/gpu/test_engine_graphs.py tests/gpu/test_triton_fp8_gemm.py \
    tests/gpu/test_triton_gemv.py tests/unit/test_fp8_gemm.py > "$out/fused-quant-tests.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/fused-quant-tests.txt" | tail -12
  wait
  budget="--kv-budget-gib 16"
  ENGINE_TIMEOUT=150 fp8_engine fp8-channel --model /tmp/m8b-fp8c/target --batches ${FUSED_BATCHES:-1,32,64} \
    --contexts 1024 --prefill 8192 --profile 64 --fp8-unfused-quant $budget | cut -c1-160
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    timeout 60 python3 bench/engine.py --model /tmp/$preset/target --batches 64 --contexts 1024 --prefill "" \
      --profile 64 $budget 2>>"$out/moe-engine.err" | sed "s/^{/{\"preset\": \"$preset\", /" \
      | tee -a "$out/moe-engine.jsonl" | cut -c1-160
  done
fi
if [[ $what == fused-tune ]]; then
  # issue 28: the fused quant kernels' launch configurations beside the separate pair (bench/fused_quant.py), while the
  # FP8 checkpoint builds; then the 8B FP8 per-channel decode steps fused (with the silu configuration that won at 64
  # rows) and unfused side by side, a batch-64 step's kernels both ways
  fp8_build channel &
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_fused.py 2>&1 | tail -2 | tee "$out/fused-tests.txt"
  timeout 120 python3 bench/fused_quant.py --rows ${TUNE_ROWS:-32,64,1024} 2>>"$out/fused-quant.err" \
    | tee -a "$out/fused-quant.jsonl" | cut -c1-220
  wait
  silu=$(python3 -c 'import json, sys
best = [json.loads(l)["best"] for l in open(sys.argv[1]) if "\"silu\"" in l and json.loads(l)["rows"] == 64]
print(",".join(map(str, best[0])) if best else "")' "$out/fused-quant.jsonl")
  echo "silu quant config: ${silu:-default}"
  ENGINE_TIMEOUT=150 fp8_engine fp8-channel --model /tmp/m8b-fp8c/target --batches ${FUSED_BATCHES:-1,32,64} \
    --contexts 1024 --prefill 8192 --profile 64 --fp8-unfused-quant ${silu:+--silu-quant-config $silu} \
    --kv-budget-gib 16 | cut -c1-160
fi
if [[ $what == moe-align ]]; then
  # issue 29: the MoE slots sorted by expert in one launch (triton_moe._align_kernel) for decode-sized batches: the MoE
  # kernel tests and DeepSeek's graphs while both presets build; then both presets' decode steps with the kernel and with
  # the torch sort side by side (--moe-align-torch), a batch-64 step's kernels both ways
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    ( timeout 300 python3 -m kvferry.common.cli make-tiny-model /tmp/$preset --preset $preset 2>&1 | tail -1 ) &
  done
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -v -p no:cacheprovider --tb=short -k "${ALIGN_K:-align or tiny or graphs}" \
    tests/gpu/test_triton_moe.py tests/gpu/test_deepseek_graphs.py > "$out/moe-align-tests.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/moe-align-tests.txt" | tail -12
  timeout 90 python3 bench/moe_align.py 2>>"$out/moe-engine.err" | tee -a "$out/moe-align.jsonl" | cut -c1-220
  warps=$(python3 -c 'import json, sys
best = [json.loads(l)["best_warps"] for l in open(sys.argv[1]) if json.loads(l)["slots"] == 512]
print(best[0] if best else "")' "$out/moe-align.jsonl")
  echo "align warps: ${warps:-default}"
  wait
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    timeout 120 python3 bench/engine.py --model /tmp/$preset/target --batches ${ALIGN_BATCHES:-8,64} --contexts 1024 \
      --prefill "" --profile 64 --moe-align-torch ${warps:+--moe-align-warps $warps} --kv-budget-gib 16 2>>"$out/moe-engine.err" \
      | sed "s/^{/{\"preset\": \"$preset\", /" | tee -a "$out/moe-engine.jsonl" | cut -c1-160
  done
fi
if [[ $what == summary ]]; then
  # issues 28/29 in one short pass (an H200 when one is lent): the 8B FP8 per-channel decode steps with the quant fused
  # and unfused, both MoE presets with the one-launch slot sort and the torch sort, side by side; batch 1 read last
  fp8_build channel &
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    ( timeout 300 python3 -m kvferry.common.cli make-tiny-model /tmp/$preset --preset $preset 2>&1 | tail -1 ) &
  done
  wait
  ENGINE_TIMEOUT=100 fp8_engine fp8-channel --model /tmp/m8b-fp8c/target --batches 64,1 --contexts 1024 --prefill "" \
    --fp8-unfused-quant --kv-budget-gib 16 | cut -c1-120
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    timeout 60 python3 bench/engine.py --model /tmp/$preset/target --batches 64,8,1 --contexts 1024 --prefill "" \
      --moe-align-torch --kv-budget-gib 16 2>>"$out/moe-engine.err" | sed "s/^{/{\"preset\": \"$preset\", /" \
      | tee -a "$out/moe-engine.jsonl" | cut -c1-120
  done
fi
if [[ $what == pdl-tests ]]; then  # PDL's correctness on the GPU: every order against plain launches, bit for bit
  timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pdl.py tests/unit/test_pdl.py \
    tests/gpu/test_triton_gemv.py tests/gpu/test_triton_moe.py tests/gpu/test_deepseek_graphs.py \
    tests/gpu/test_engine_graphs.py 2>&1 | tee "$out/pdl-tests.txt" | tail -15
fi
if [[ $what == pdl ]]; then
  # every Triton kernel of a step launched with programmatic dependent launch (kernels/pdl.py), against the same
  # kernels in PDL order 1 and launched plainly (--pdl-ab: graphs recaptured), side by side: the 8B FP8 per-channel
  # step at batch 64 and 1, both MoE presets at 64, 8 and 1, batch 1's kernels listed each way; meanwhile the tests
  # that replay graphs and the GEMV's (its weight prefetch)
  fp8_build channel &
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    ( timeout 300 python3 -m kvferry.common.cli make-tiny-model /tmp/$preset --preset $preset 2>&1 | tail -1 ) &
  done
  timeout ${TESTS_TIMEOUT:-180} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pdl.py tests/unit/test_pdl.py \
    tests/gpu/test_engine_graphs.py tests/gpu/test_deepseek_graphs.py tests/gpu/test_triton_gemv.py tests/gpu/test_triton_moe.py \
    > "$out/pdl-tests.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/pdl-tests.txt" | tail -12
  wait
  ENGINE_TIMEOUT=${PDL_FP8_TIMEOUT:-150} fp8_engine fp8-channel --model /tmp/m8b-fp8c/target --batches 64,1 \
    --contexts 1024 --prefill "" --profile 1 --pdl-ab --kv-budget-gib 16 | cut -c1-120
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    timeout ${PDL_MOE_TIMEOUT:-85} python3 bench/engine.py --model /tmp/$preset/target --batches 64,8,1 --contexts 1024 \
      --prefill "" --profile 1 --pdl-ab --kv-budget-gib 16 2>>"$out/moe-engine.err" \
      | sed "s/^{/{\"preset\": \"$preset\", /" | tee -a "$out/moe-engine.jsonl" | cut -c1-120
  done
fi
if [[ $what == launch ]]; then
  # tree 1d4dd4b ran this with --attn-merge-ab (the decode attention's splits merged by its last programs: measured
  # slower, reverted); now: the one-row GEMV tiles of the H100 sweep against the earlier ones (--gemv-configs-ab) and
  # the greedy picks in the decode graph against torch's (--greedy-graph-ab), in the same process (graphs
  # recaptured): the 8B FP8 per-channel step at batch 64 and 1, both MoE presets at 64, 8 and 1, batch 1's kernels
  # listed; meanwhile the GEMV, overlap and host-sync tests
  fp8_build channel &
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    ( timeout 300 python3 -m kvferry.common.cli make-tiny-model /tmp/$preset --preset $preset 2>&1 | tail -1 ) &
  done
  timeout ${TESTS_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_overlap.py \
    tests/gpu/test_host_syncs.py tests/gpu/test_triton_gemv.py tests/gpu/test_engine_graphs.py \
    > "$out/launch-tests.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/launch-tests.txt" | tail -12
  wait
  ENGINE_TIMEOUT=${LAUNCH_FP8_TIMEOUT:-140} fp8_engine fp8-channel --model /tmp/m8b-fp8c/target --batches 64,1 \
    --contexts 1024 --prefill "" --profile 1 --gemv-configs-ab ${LAUNCH_AB:-} --kv-budget-gib 16 | cut -c1-120
  for preset in ${LAUNCH_MOE:-qwen3-30b-a3b deepseek-v2-lite}; do
    timeout ${LAUNCH_MOE_TIMEOUT:-75} python3 bench/engine.py --model /tmp/$preset/target --batches 64,8,1 --contexts 1024 \
      --prefill "" --profile 1 --gemv-configs-ab ${LAUNCH_AB:-} --kv-budget-gib 16 2>>"$out/moe-engine.err" \
      | sed "s/^{/{\"preset\": \"$preset\", /" | tee -a "$out/moe-engine.jsonl" | cut -c1-120
  done
  # LAUNCH_TUNE=seconds: then the one-row GEMV sweep below, in what is left of the call
fi
if [[ $what == gemv-one-row || ( $what == launch && -n ${LAUNCH_TUNE:-} ) ]]; then
  # the one-row GEMVs of the batch-1 steps over the sweep, in CUDA graphs: the 8B FP8 projections (per-row scales) and
  # lm_head, the MoE presets' attention and lm_head, and their experts at one token
  timeout ${LAUNCH_TUNE:-${TUNE_TIMEOUT:-280}} python3 bench/gemv_tune.py --cases bf16,moe,fp8 --rows 1 --scales row --tokens 1 \
    --iters 20 2>>"$out/gemv-one-row.err" | tee -a "$out/gemv-one-row.jsonl" | cut -c1-250
fi
if [[ $what == gemv-cold ]]; then
  # the decode GEMVs' tiles swept with each call reading its weight from HBM (copies rotated past L2, as a step
  # reads them): the MoE presets' one-row projections and experts, the 8B FP8 64-row W8A8 projections (COLD_ONE_ROW=1:
  # its one-row ones too). The shapes whose best tiles beat the rules by 3 % go into a tile table, and the steps
  # (COLD_STEPS, default ds,fp8; qwen too) then run with it (KVFERRY_GEMV_TILES) beside the rules alone (--gemv-table-ab).
  # The models build meanwhile. One error file for the whole mode: a call returns at most 8 files
  steps=,${COLD_STEPS-ds,fp8},
  build_models "$steps"
  table=$out/gemv-tiles.json
  g="python3 bench/gemv_tune.py --iters 20 --table-out $table"
  timeout ${COLD_BF16_TIMEOUT:-110} $g --cases bf16 \
    --weights ${COLD_BF16_WEIGHTS:-dsv2_qkv_a,dsv2_o,dsv2_gate_up,dsv2_down,qwen3_qkv,qwen3_o} \
    2>>"$out/gemv-cold.err" | tee -a "$out/gemv-cold.jsonl" | cut -c1-200
  timeout ${COLD_W8A8_TIMEOUT:-130} $g --cases fp8 --rows 64 --scales row --w8a8-wide 2>>"$out/gemv-cold.err" \
    | tee -a "$out/gemv-cold.jsonl" | cut -c1-200
  timeout ${COLD_MOE_TIMEOUT:-80} $g --cases moe --tokens 1 2>>"$out/gemv-cold.err" \
    | tee -a "$out/gemv-cold.jsonl" | cut -c1-200
  [[ ${COLD_ONE_ROW:-0} == 1 ]] && timeout ${COLD_FP8_TIMEOUT:-120} $g --cases fp8 --rows 1 --scales row \
    2>>"$out/gemv-cold.err" | tee -a "$out/gemv-cold.jsonl" | cut -c1-200
  grep -v "^skip" "$out/gemv-cold.err" | tail -5
  wait
  [[ -f $table ]] && export KVFERRY_GEMV_TILES=$table && cat "$table"
  [[ $steps == *,ds,* ]] && timeout ${COLD_DS_TIMEOUT:-100} python3 bench/engine.py \
    --model /tmp/deepseek-v2-lite/target --batches ${COLD_DS_BATCHES:-1} --contexts 1024 --prefill "" \
    ${COLD_AB:---gemv-table-ab} --kv-budget-gib 16 2>>"$out/gemv-cold.err" \
    | sed "s/^{/{\"preset\": \"deepseek-v2-lite\", /" | tee -a "$out/moe-engine.jsonl" | cut -c1-120
  [[ $steps == *,fp8,* ]] && ENGINE_TIMEOUT=${COLD_FP8_STEP_TIMEOUT:-150} fp8_engine fp8-channel \
    --model /tmp/m8b-fp8c/target --batches ${COLD_FP8_BATCHES:-64,1} --contexts 1024 --prefill "" \
    ${COLD_AB:---gemv-table-ab} --kv-budget-gib 16 | cut -c1-120
  [[ $steps == *,qwen,* ]] && timeout ${COLD_QWEN_TIMEOUT:-90} python3 bench/engine.py \
    --model /tmp/qwen3-30b-a3b/target --batches 1 --contexts 1024 --prefill "" \
    ${COLD_AB:---gemv-table-ab} --kv-budget-gib 16 2>>"$out/gemv-cold.err" \
    | sed "s/^{/{\"preset\": \"qwen3-30b-a3b\", /" | tee -a "$out/moe-engine.jsonl" | cut -c1-120
  tail -3 "$out/gemv-cold.err"
fi
if [[ $what == late-sum ]]; then
  # the one-row GEMVs' late sum as each shape's tiles choose it (GemvConfig.late_sum): the GEMV and router tests,
  # the cold one-row sweep with late_sum swept (LATE_SWEEP_TIMEOUT; 1 skips it), then the steps with --late-sum-ab
  # (every one-row GEMV summing every K step) and --late-all-ab (every one summing late), the MoE models also with
  # --moe-norm-sum-ab (LATE_AB): LATE_STEPS, default ds,qwen,fp8 (LATE_FP8_BATCHES, default 1,64); the models build
  # meanwhile
  steps=,${LATE_STEPS-ds,qwen,fp8},
  build_models "$steps"
  # LATE_TESTS: more test files to run first (split on spaces); LATE_K: the -k expression for the GEMV tests
  timeout ${TESTS_TIMEOUT:-60} python3 -m pytest -q -p no:cacheprovider ${LATE_TESTS:-} tests/gpu/test_triton_gemv.py \
    tests/gpu/test_triton_moe.py -k "${LATE_K:-late_sum or dense_gemv or moe_gemv_equals or router}" \
    > "$out/late-tests.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/late-tests.txt" | tail -4
  timeout ${LATE_SWEEP_TIMEOUT:-100} python3 bench/gemv_tune.py --iters 20 --quick --cases bf16,moe,fp8 --rows 1 \
    --scales row --tokens 1 --weights ${LATE_WEIGHTS:-dsv2_qkv_a,dsv2_o,dsv2_gate_up,dsv2_down,qkv,o,gate_up,down} \
    2>>"$out/late.err" | tee -a "$out/late-sweep.jsonl" | cut -c1-200
  wait
  ab="${LATE_AB:---late-sum-ab --late-all-ab --moe-norm-sum-ab}"
  [[ $steps == *,ds,* ]] && timeout ${LATE_DS_TIMEOUT:-120} python3 bench/engine.py --model /tmp/deepseek-v2-lite/target \
    --batches 1 --contexts 1024 --prefill "" $ab --kv-budget-gib 16 2>>"$out/late.err" \
    | sed "s/^{/{\"preset\": \"deepseek-v2-lite\", /" | tee -a "$out/moe-engine.jsonl" | cut -c1-120
  [[ $steps == *,qwen,* ]] && timeout ${LATE_QWEN_TIMEOUT:-120} python3 bench/engine.py --model /tmp/qwen3-30b-a3b/target \
    --batches 1 --contexts 1024 --prefill "" $ab --kv-budget-gib 16 2>>"$out/late.err" \
    | sed "s/^{/{\"preset\": \"qwen3-30b-a3b\", /" | tee -a "$out/moe-engine.jsonl" | cut -c1-120
  [[ $steps == *,fp8,* ]] && ENGINE_TIMEOUT=${LATE_FP8_TIMEOUT:-150} fp8_engine fp8-channel --model /tmp/m8b-fp8c/target \
    --batches ${LATE_FP8_BATCHES:-1,64} --contexts 1024 --prefill "" --late-sum-ab --kv-budget-gib 16 | cut -c1-120
  tail -3 "$out/late.err"
fi
if [[ $what == l2 ]]; then
  # what asking L2 for a weight during an idle window saves the GEMV after it (bench/l2_prefetch.py)
  timeout ${L2_TIMEOUT:-200} python3 bench/l2_prefetch.py ${L2_ARGS:-} 2>>"$out/l2-prefetch.err" \
    | tee -a "$out/l2-prefetch.jsonl" | cut -c1-400
  tail -5 "$out/l2-prefetch.err"
fi
if [[ $what == tiles ]]; then
  # issue 28's batch-64 step: the W8A8 dot past 16 rows alone (x quantized beforehand, as the fused norms and silu hand
  # it over) over wider tiles, and the decode attention's split kernel over its tiles and split counts, while the FP8
  # checkpoint builds; the W8A8 GEMV tests; then the 8B FP8 step at 64 and 1 (tree d8d7159 ran this with the A/Bs of
  # two fusions since reverted: bench/RESULTS.md); TILES_PROFILE=seconds: batch 64's kernels without PDL
  fp8_build channel > "$out/build.txt" 2>&1 &
  build=$!
  timeout ${TUNE_TIMEOUT:-170} python3 bench/gemv_tune.py --cases fp8 --rows ${TUNE_ROWS:-64} --scales row --w8a8-wide \
    --iters 20 2>>"$out/tiles.err" | tee -a "$out/gemv-w8a8.jsonl" | cut -c1-250
  timeout ${ATTN_TIMEOUT:-80} python3 bench/attn_tune.py --batches ${ATTN_BATCHES:-64,1,8} --contexts 1024 \
    2>>"$out/tiles.err" | tee -a "$out/attn-tune.jsonl" | cut -c1-250
  timeout ${TESTS_TIMEOUT:-70} python3 -m pytest -q -p no:cacheprovider -k "fp8_x or w8a8 or split_k or refuses" \
    tests/gpu/test_triton_gemv.py > "$out/tiles-tests.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/tiles-tests.txt" | tail -8
  wait $build
  ENGINE_TIMEOUT=${TILES_ENGINE_TIMEOUT:-150} fp8_engine fp8-channel --model /tmp/m8b-fp8c/target --batches 64,1 \
    --contexts 1024 --prefill "" --kv-budget-gib 16 | cut -c1-120
  [[ -n ${TILES_PROFILE:-} ]] && KVFERRY_PDL=0 ENGINE_TIMEOUT=$TILES_PROFILE fp8_engine fp8-channel-no-pdl \
    --model /tmp/m8b-fp8c/target --batches 64 --contexts 1024 --prefill "" --profile 64 --kv-budget-gib 16 | cut -c1-120
fi
if [[ $what == attn ]]; then
  # issue 28: the decode attention's split kernel over its tiles, split counts and fewest keys a split at 1k and 8k
  # (bench/attn_tune.py, by_splits), while the FP8 and DeepSeek checkpoints build; the attention, FP8-KV, MLA and graph
  # tests; then the 8B FP8 and DeepSeek-V2-Lite steps at 64 and 1 with the tree's split rule and tiles against
  # tree d8d7159's (--attn-tiles-ab)
  fp8_build channel > "$out/build.txt" 2>&1 &
  ( timeout 300 python3 -m kvferry.common.cli make-tiny-model /tmp/deepseek-v2-lite --preset deepseek-v2-lite 2>&1 \
    | tail -1 ) >> "$out/build.txt" &
  timeout ${ATTN_TIMEOUT:-150} python3 bench/attn_tune.py --batches ${ATTN_BATCHES:-1,8,64} --contexts ${ATTN_CONTEXTS:-1024,8192} \
    2>>"$out/attn.err" | tee -a "$out/attn-tune.jsonl" | cut -c1-200
  timeout ${TESTS_TIMEOUT:-110} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py \
    tests/gpu/test_triton_fp8_kv.py tests/gpu/test_triton_mla.py tests/gpu/test_engine_graphs.py > "$out/attn-tests.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/attn-tests.txt" | tail -8
  wait
  ENGINE_TIMEOUT=${ATTN_ENGINE_TIMEOUT:-100} fp8_engine fp8-channel --model /tmp/m8b-fp8c/target --batches 64,1 \
    --contexts 1024 --prefill "" --attn-tiles-ab --kv-budget-gib 16 | cut -c1-120
  timeout ${ATTN_MOE_TIMEOUT:-70} python3 bench/engine.py --model /tmp/deepseek-v2-lite/target --batches 64,1 --contexts 1024 \
    --prefill "" --attn-tiles-ab --kv-budget-gib 16 2>>"$out/attn.err" \
    | sed "s/^{/{\"preset\": \"deepseek-v2-lite\", /" | tee -a "$out/moe-engine.jsonl" | cut -c1-120
fi
if [[ $what == mla ]]; then
  # issue 29: the MLA decode kernel over its tiles, split counts and fewest keys a split (bench/attn_tune.py --mla),
  # while the DeepSeek and FP8 checkpoints build; the MLA, absorbed-projection and router-GEMV tests; the
  # DeepSeek-V2-Lite step at 64 and 1 with the absorbed projections in one launch each and the tree's MLA tiles
  # against the einsums and tree 0fd301d's tiles (--mla-ab, the batch-1 kernels profiled); the 8B FP8 step
  fp8_build channel > "$out/build.txt" 2>&1 &
  ( timeout 300 python3 -m kvferry.common.cli make-tiny-model /tmp/deepseek-v2-lite --preset deepseek-v2-lite 2>&1 \
    | tail -1 ) >> "$out/build.txt" &
  timeout ${MLA_TUNE_TIMEOUT:-150} python3 bench/attn_tune.py --mla --batches ${MLA_BATCHES:-1,8,64} \
    --contexts ${MLA_CONTEXTS:-1024,8192} --splits 1,4,8,16,32 2>>"$out/mla.err" | tee -a "$out/mla-tune.jsonl" | cut -c1-200
  timeout ${TESTS_TIMEOUT:-110} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_mla.py \
    "tests/gpu/test_triton_gemv.py::test_dense_gemv_of_an_fp32_router_weight_returns_fp32" > "$out/mla-tests.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/mla-tests.txt" | tail -8
  wait
  timeout ${MLA_ENGINE_TIMEOUT:-120} python3 bench/engine.py --model /tmp/deepseek-v2-lite/target --batches 64,1 \
    --contexts 1024 --prefill "" --mla-ab --profile ${MLA_PROFILE:-1} --kv-budget-gib 16 2>>"$out/mla.err" \
    | sed "s/^{/{\"preset\": \"deepseek-v2-lite\", /" | tee -a "$out/moe-engine.jsonl" | cut -c1-120
  ENGINE_TIMEOUT=${MLA_FP8_TIMEOUT:-100} fp8_engine fp8-channel --model /tmp/m8b-fp8c/target --batches 64,1 \
    --contexts 1024 --prefill "" --kv-budget-gib 16 | cut -c1-120
fi
if [[ $what == merge ]]; then
  # issues 28 and 29: the decode attention's splits merged as one tile (the tree's) against one after another
  # (--merge-ab), rope_store over a few programs a token against one (--rope-ab, Qwen3 and FP8), the MLA tiles and
  # absorbed projections against tree 0fd301d's (--mla-ab), DeepSeek's shared experts in the routed experts'
  # launches against a dense SwiGLU of their own (--shared-ab), MLA's rows in absorb_q's launch (--mla-rows-ab) and
  # the step's cos/sin in one launch against torch's ops (--cos-sin-ab), the greedy picks in one launch
  # against torch's ops (--picks-ab), in the DeepSeek-V2-Lite,
  # Qwen3-30B-A3B (batch-1 kernels profiled) and 8B FP8 steps; first the attention, MLA, MoE and graph tests
  # MERGE_ONLY (a comma list of tests, ds, pdl, qwen, fp8; default all but pdl): the steps to run; MERGE_DS_AB and
  # MERGE_QWEN_AB: the A/B flags of those steps. Only their models are built, meanwhile the tests run (skipped where
  # a call before on the same warm machine built them)
  only=,${MERGE_ONLY:-tests,ds,qwen,fp8},
  [[ $only == *,fp8,* ]] && { fp8_build channel > "$out/build.txt" 2>&1 & }
  merge_presets=""
  [[ $only == *,ds,* || $only == *,pdl,* ]] && merge_presets=deepseek-v2-lite
  [[ ${MERGE_QWEN:-1} == 1 && $only == *,qwen,* ]] && merge_presets+=" qwen3-30b-a3b"
  for preset in $merge_presets; do
    [[ -f /tmp/$preset/target/config.json ]] && continue
    ( timeout 300 python3 -m kvferry.common.cli make-tiny-model /tmp/$preset --preset $preset 2>&1 | tail -1 ) \
      >> "$out/build.txt" &
  done
  # MERGE_TESTS: the test list in place of the default one (file names only: split on spaces); MERGE_K: a -k expression
  [[ $only == *,tests,* ]] && timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider ${MERGE_K:+-k "$MERGE_K"} \
    ${MERGE_TESTS:-tests/gpu/test_triton_attention.py tests/gpu/test_triton_mla.py tests/gpu/test_triton_moe.py \
    tests/gpu/test_triton_fused.py tests/gpu/test_deepseek_graphs.py tests/gpu/test_triton_sample.py \
    tests/gpu/test_overlap.py} \
    ${MERGE_TESTS_MORE-tests/gpu/test_triton_fp8_kv.py tests/gpu/test_engine_graphs.py tests/gpu/test_triton_fp8_layers.py} \
    > "$out/merge-tests.txt" 2>&1
  [[ $only == *,tests,* ]] && grep -E "FAILED|ERROR|passed|failed" "$out/merge-tests.txt" | tail -8
  wait
  [[ $only == *,ds,* ]] && timeout ${MERGE_DS_TIMEOUT:-220} python3 bench/engine.py \
    --model /tmp/deepseek-v2-lite/target --batches ${MERGE_BATCHES:-64,8,1} --contexts 1024 --prefill "" \
    ${MERGE_DS_AB:---mla-ab --merge-ab --shared-ab --mla-rows-ab --cos-sin-ab --picks-ab} \
    ${MERGE_DS_PROFILE---profile 1} \
    --kv-budget-gib 16 2>>"$out/merge.err" \
    | sed "s/^{/{\"preset\": \"deepseek-v2-lite\", /" | tee -a "$out/moe-engine.jsonl" | cut -c1-120
  # pdl: the batch-1 step's kernels with PDL off too (each kernel's own time, not its wait)
  [[ $only == *,pdl,* ]] && timeout ${MERGE_PDL_TIMEOUT:-90} python3 bench/engine.py \
    --model /tmp/deepseek-v2-lite/target --batches 1 --contexts 1024 --prefill "" --pdl-ab --profile 1 \
    --kv-budget-gib 16 2>>"$out/merge.err" | sed "s/^{/{\"preset\": \"deepseek-v2-lite\", /" \
    | tee -a "$out/moe-engine.jsonl" | cut -c1-120
  [[ ${MERGE_QWEN:-1} == 1 && $only == *,qwen,* ]] && timeout ${MERGE_QWEN_TIMEOUT:-100} python3 bench/engine.py \
    --model /tmp/qwen3-30b-a3b/target --batches ${MERGE_BATCHES:-64,8,1} --contexts 1024 --prefill "" \
    ${MERGE_QWEN_AB:---merge-ab --rope-ab --cos-sin-ab --picks-ab} ${MERGE_PROFILE---profile 1} --kv-budget-gib 16 2>>"$out/merge.err" \
    | sed "s/^{/{\"preset\": \"qwen3-30b-a3b\", /" | tee -a "$out/moe-engine.jsonl" | cut -c1-120
  # MERGE_FP8_AB: the FP8 step's A/B flags; MERGE_FP8_PROFILE=seconds: then batch 64's kernels without PDL
  [[ $only == *,fp8,* ]] && ENGINE_TIMEOUT=${MERGE_FP8_TIMEOUT:-110} fp8_engine fp8-channel \
    --model /tmp/m8b-fp8c/target --batches ${MERGE_FP8_BATCHES:-64,1} --contexts 1024 --prefill "" \
    ${MERGE_FP8_AB:---merge-ab --rope-ab --cos-sin-ab --picks-ab} --kv-budget-gib 16 | cut -c1-120
  [[ $only == *,fp8,* && -n ${MERGE_FP8_PROFILE:-} ]] && KVFERRY_PDL=0 ENGINE_TIMEOUT=$MERGE_FP8_PROFILE fp8_engine \
    fp8-channel-no-pdl --model /tmp/m8b-fp8c/target --batches 64 --contexts 1024 --prefill "" --profile 64 \
    --kv-budget-gib 16 | cut -c1-120
fi
if [[ $what == moe-routed ]]; then
  # both MoE presets' decode steps with a distinct token per sequence (bench/engine.py's last_token: before, every
  # sequence decoded the same token and the router sent the whole batch to the same experts), beside the roofline of
  # the experts routed; meanwhile the W8A8 route's tests against the CPU reference
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    ( timeout 200 python3 -m kvferry.common.cli make-tiny-model /tmp/$preset --preset $preset 2>&1 | tail -1 ) &
  done
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_gemv.py::test_fp8_linear_past_16_rows \
    tests/gpu/test_triton_fp8_gemm.py::test_scaled_mm_path_equals_reference 2>&1 | tail -4 | tee "$out/routed-tests.txt"
  wait
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    timeout 50 python3 bench/engine.py --model /tmp/$preset/target --batches 1,8,64 --contexts 1024 --prefill "" \
      --kv-budget-gib 16 2>>"$out/moe-routed.err" | sed "s/^{/{\"preset\": \"$preset\", /" \
      | tee -a "$out/moe-routed.jsonl" | cut -c1-120
  done
fi
if [[ $what == moe-e2e ]]; then
  # issue 29: the MoE (Qwen3-MoE) and MLA (DeepSeek) presets disaggregated against colocated in bench/e2e.py
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    ( timeout 200 python3 -m kvferry.common.cli make-tiny-model /tmp/$preset --preset $preset 2>&1 | tail -1 ) &
  done
  wait
  for preset in qwen3-30b-a3b deepseek-v2-lite; do
    timeout ${E2E_TIMEOUT:-110} python3 bench/e2e.py --device cuda --model /tmp/$preset/target --prompt-tokens 1024 \
      --concurrency 1,16 --reps ${E2E_REPS:-3} --max-total-tokens 40000 --no-inprocess 2>>"$out/moe-e2e.err" \
      | sed "s/^{/{\"preset\": \"$preset\", /" | tee -a "$out/moe-e2e.jsonl"
  done
fi
if [[ $what == moe-tune ]]; then
  # the fused MoE's grouped GEMMs: its tests (every configuration of the table against the torch reference), then
  # bench/moe_tune.py's sweep of tile configurations for the Qwen3-30B-A3B and DeepSeek-V2-Lite shapes (~2-3 min)
  timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_triton_moe.py 2>&1 \
    | tee "$out/moe-tune-tests.txt" | tail -5
  timeout 240 python3 bench/moe_tune.py --tokens ${MOE_TUNE_TOKENS:-64,128,1024,4096,8192,16384} \
    2>>"$out/moe-tune.err" | tee -a "$out/moe-tune.jsonl"
fi
