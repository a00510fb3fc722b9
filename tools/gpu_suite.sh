#!/bin/bash
# The one-GPU test suite (docs/TESTING.md): on a machine with a CUDA GPU and torch (no vLLM
# needed, nothing downloaded), run every test that runs there: the `gpu` tests (Triton kernels,
# grouped GEMM paths against float64, the engine and the MoE step on CUDA with 2 and 4 rank
# processes sharing the GPU over gloo, PyTorch symmetric memory across processes) and the rest
# of the CPU suite, then print the environment and a pass/fail summary.
# Usage (repo root): bash tools/gpu_suite.sh [extra pytest args]; PYTEST_PATHS narrows the run;
# AB=1 also runs moonep-ab --device cuda.
set -u
source tools/gpu_env.sh
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
python3 - <<'PY' | tee "$OUT/environment.txt"
import platform, torch
try:
    import triton; tv = triton.__version__
except Exception as e:
    tv = f"absent ({e})"
print(f"python {platform.python_version()}, torch {torch.__version__}, triton {tv}")
print(f"cuda available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
PY
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader 2>/dev/null | tee -a "$OUT/environment.txt"
start=$(date +%s)
timeout ${SUITE_TIMEOUT:-420} python3 -m pytest ${PYTEST_PATHS:-tests} -q -rfEs -p no:cacheprovider -m "not slow" \
  --junitxml="$OUT/gpu-suite.xml" "$@" 2>&1 | tee "$OUT/gpu-suite.log" | tail -40
rc=${PIPESTATUS[0]}
echo "gpu_suite: pytest exit $rc in $(( $(date +%s) - start ))s"
python3 - "$OUT/gpu-suite.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as e:
    print(f"no junit report: {e}"); sys.exit(0)
suite = root if root.tag == "testsuite" else root.find("testsuite")
gpu = [tc for tc in suite.iter("testcase") if "gpu" in tc.get("classname", "") or "cuda" in tc.get("name", "")]
def status(tc):
    for k in ("failure", "error", "skipped"):
        if tc.find(k) is not None:
            return k
    return "passed"
from collections import Counter
print("summary, all tests:", dict(Counter(status(tc) for tc in suite.iter("testcase"))))
print("summary, GPU tests (tests/gpu and *_cuda):", dict(Counter(status(tc) for tc in gpu)))
PY
if [ "${AB:-0}" = "1" ]; then
  for preset in ${AB_PRESETS:-qwen3-30b-a3b kimi-k2}; do
    timeout ${AB_TIMEOUT:-150} python3 -m vllm_moonep.tools.ab --device cuda --ranks 1 --preset "$preset" \
      --layers ${AB_LAYERS:-8} --tokens ${AB_TOKENS:-1 256 4096} --maxvio 0 2 --steps 10 --warmup 3 \
      --configs replicated symmetric symmetric-shared --impl ${AB_IMPL:-auto} --out "$OUT/ab-$preset" --no-plots \
      2>&1 | grep -v "it/s" | tee "$OUT/ab-$preset.log" | tail -22
  done
fi
exit $rc
