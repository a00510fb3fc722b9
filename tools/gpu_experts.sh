#!/bin/bash
# One device call: install (or link) the package, run the GPU tests, then the expert benchmark.
# Usage (repo root, on the GPU machine): bash tools/gpu_experts.sh [bench args...]
source tools/gpu_env.sh
python3 -c "import vllm_moonep.common.grouped_gemm.triton_kernels as t, triton, torch; print('import ok', triton.__version__, torch.__version__)" || exit 3
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
if [ -z "$SKIP_TESTS" ]; then
  timeout 240 python3 -m pytest tests/gpu/test_triton_grouped_gemm.py -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
timeout ${BENCH_TIMEOUT:-420} python3 -m vllm_moonep.tools.bench_experts "$@" 2>&1 | tee "$OUT/bench.log"
