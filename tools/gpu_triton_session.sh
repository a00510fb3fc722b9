#!/bin/bash
# One device call: install (or link) the package, run the GPU tests, then the expert benchmark.
# Usage (repo root, on the GPU machine): bash tools/gpu_triton_session.sh [bench args...]
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! python3 -m pip install --no-deps --no-build-isolation --no-index -e . -q >"$OUT/pip.log" 2>&1; then
  mkdir -p /tmp/pp/vllm_moonep && cp -r packages/vllm_moonep/. /tmp/pp/vllm_moonep/
  for p in engine:packages/engine common:common replicated:replicated symmetric:symmetric tools:tools vllm_plugin:packages/vllm_plugin; do
    ln -sfn "$PWD/${p#*:}" "/tmp/pp/vllm_moonep/${p%%:*}"
  done
  export PYTHONPATH=/tmp/pp
fi
python3 -c "import vllm_moonep.common.grouped_gemm.triton_kernels as t, triton, torch; print('import ok', triton.__version__, torch.__version__)" || exit 3
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
if [ -z "$SKIP_TESTS" ]; then
  timeout 240 python3 -m pytest tests/gpu/test_triton_grouped_gemm.py -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
timeout ${BENCH_TIMEOUT:-420} python3 -m vllm_moonep.tools.bench_experts "$@" 2>&1 | tee "$OUT/bench.log"
