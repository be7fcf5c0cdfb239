#!/usr/bin/env bash
# One pass on the GPU machine: install the carried wheels, check the GPU path, then measure.
#   bash bench/gpu_run.sh [tests|transfer|e2e|all]   (results land in $OUT, default ./gpu-out)
# The machine has torch with CUDA but no NIXL, pyzmq, FastAPI...: those travel in .whl/
# (bash ../shared/tools/device-wheels.sh ...). NVLink multicast stays off.
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
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_nixl_engine.py tests/unit/test_model_vs_transformers.py \
    2>&1 | tee "$out/tests.txt" | tail -25
fi
if [[ $what == transfer || $what == all ]]; then
  python3 bench/transfer.py --device cuda --tokens 1024,4096,16384 2>"$out/transfer.err" | tee "$out/transfer.jsonl"
  python3 bench/transfer.py --device cuda --tokens 1024,4096,16384 --num-threads 4 2>>"$out/transfer.err" \
    | tee -a "$out/transfer.jsonl"
fi
if [[ $what == e2e || $what == all ]]; then
  python3 -m common.cli make-tiny-model /tmp/m8b --preset llama-3.1-8b 2>&1 | tail -2
  python3 bench/e2e.py --device cuda --model /tmp/m8b/target --draft /tmp/m8b/draft \
    --prompt-tokens 1024,8192 --concurrency 1,16,64 2>"$out/e2e.err" | tee "$out/e2e.jsonl"
fi
