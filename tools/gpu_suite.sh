#!/bin/bash
# The GPU test suite (docs/TESTING.md) on a machine with any number of CUDA GPUs and torch (no
# vLLM needed, nothing downloaded): the GPU cases (marked gpu or multi_gpu; the CPU suite is
# scripts/test.sh's), then the environment and a pass/fail summary. With 2 or more GPUs that includes the multi_gpu tests: NCCL ranks, one GPU
# each; every heap (PyTorch symmetric memory, and NVSHMEM when its wheel was carried: see
# tools/gpu_env.sh) with per-layer slots, overflow reads, the shared slot pool and NVSHMEM's RMA
# path; moonep-ab, moonep-balance and the soak on NCCL ranks, spawned and under torchrun.
#
# Usage (repo root): bash tools/gpu_suite.sh [extra pytest args]
#   SUITE=gpu        (default) the GPU cases only: tests marked gpu or multi_gpu (-m "gpu or
#                    multi_gpu"; the CPU suite is scripts/test.sh's, not run again here); multi_gpu
#                    tests skip with < 2 GPUs
#   SUITE=multi_gpu  only tests/distributed/test_multi_gpu.py (estimated 4 minutes on 2 H200s)
#   SUITE=all        every test but the slow ones (the CPU suite too: past 250 s on one H200 with
#                    SUITE_WORKERS=12)
#   SUITE_WORKERS    pytest-xdist workers sharing the GPU (default 8; 1 = one process): most of the
#                    time is Triton compiling each case's kernels on the CPU (a fresh machine has no
#                    cache), which spreads over the cores. xdist travels as a wheel in .whl/ where
#                    it cannot be installed (tools/gpu_env.sh); without it the run is one process
#   PYTEST_PATHS     narrows the run; SUITE_TIMEOUT (seconds) bounds pytest;
#                    VLLM_MOONEP_TEST_CALL_TIMEOUT_S (default here 180) bounds one call on rank processes,
#                    whose report then carries the silent ranks' Python stacks
#   AB=1             also moonep-ab --device cuda on the full-size presets: one GPU per rank over
#                    NCCL, spawned ranks and a torchrun launch (1 GPU: one rank); AB_PRESETS,
#                    AB_LAYERS, AB_TOKENS, AB_IMPL, AB_HEAP (nvshmem: the NVSHMEM heap's memory), AB_TIMEOUT
# Files in $OUT (at most 8 come back from the device tool): environment.txt, setup.log,
# gpu-suite.log, gpu-suite.xml, failures.txt (each failure as it happens: a run stopped by
# SUITE_TIMEOUT writes no summary), multi_gpu_figures.json (memory and soak figures), ab.log.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source tools/gpu_env.sh >/tmp/gpu_env.out 2>&1
tee "$OUT/environment.txt" </tmp/gpu_env.out
python3 - <<'PY' | tee -a "$OUT/environment.txt"
import platform, torch
try:
    import triton; tv = triton.__version__
except Exception as e:
    tv = f"absent ({e})"
print(f"python {platform.python_version()}, torch {torch.__version__}, triton {tv}")
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
v = torch.cuda.nccl.version() if n else "-"
print(f"cuda available: {torch.cuda.is_available()}, devices: {n}, nccl: {'.'.join(map(str, v)) if isinstance(v, tuple) else v}")
for i in range(n):
    p = torch.cuda.get_device_properties(i)
    print(f"gpu {i}: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
print("multi_gpu tests: " + ("run (NCCL, one GPU per rank)" if n >= 2 else f"skip (need 2 GPUs, have {n})"))
PY
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader 2>/dev/null | tee -a "$OUT/environment.txt"
nvidia-smi topo -m 2>/dev/null | head -5 >>"$OUT/environment.txt"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1  # the one-GPU tests' rank processes share the GPU
export VLLM_MOONEP_TEST_CALL_TIMEOUT_S=${VLLM_MOONEP_TEST_CALL_TIMEOUT_S:-180}
case "${SUITE:-gpu}" in
  gpu) paths=${PYTEST_PATHS:-tests}; limit=${SUITE_TIMEOUT:-360}; select="gpu or multi_gpu";;
  multi_gpu) paths=${PYTEST_PATHS:-tests/distributed/test_multi_gpu.py}; limit=${SUITE_TIMEOUT:-360}; select="not slow";;
  all) paths=${PYTEST_PATHS:-tests}; limit=${SUITE_TIMEOUT:-480}; select="not slow";;
  *) echo "gpu_suite: SUITE must be gpu, multi_gpu or all, got ${SUITE}"; exit 2;;
esac
workers=${SUITE_WORKERS:-8}
parallel=()
if [ "$workers" -gt 1 ]; then
  if python3 -c "import xdist" 2>/dev/null; then
    parallel=(-n "$workers" --dist worksteal)
  else
    echo "gpu_suite: pytest-xdist does not import here: one process (carry its wheel and execnet's in .whl/)"
  fi
fi
export VLLM_MOONEP_TEST_FAILURES="$OUT/failures.txt"
: >"$VLLM_MOONEP_TEST_FAILURES"
start=$(date +%s)
timeout "$limit" python3 -m pytest $paths -q -rfEs -p no:cacheprovider -m "$select" --durations=40 "${parallel[@]}" \
  --junitxml="$OUT/gpu-suite.xml" "$@" 2>&1 | tee "$OUT/gpu-suite.log" | tail -45
rc=${PIPESTATUS[0]}
echo "gpu_suite: pytest exit $rc in $(( $(date +%s) - start ))s ($NGPU GPUs, nvshmem4py: $NVSHMEM_STATUS)"
if [ -s "$VLLM_MOONEP_TEST_FAILURES" ]; then
  echo "gpu_suite: failures as they happened ($OUT/failures.txt):"; grep "^FAILED " "$VLLM_MOONEP_TEST_FAILURES"
fi
python3 - "$OUT/gpu-suite.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
from collections import Counter
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as e:
    print(f"no junit report: {e}"); sys.exit(0)
suite = root if root.tag == "testsuite" else root.find("testsuite")
def status(tc):
    for k in ("failure", "error", "skipped"):
        if tc.find(k) is not None:
            return k
    return "passed"
cases = list(suite.iter("testcase"))
gpu = [tc for tc in cases if "gpu" in tc.get("classname", "") or "cuda" in tc.get("name", "")]
multi = [tc for tc in cases if "test_multi_gpu" in tc.get("classname", "")]
print("summary, all tests:", dict(Counter(status(tc) for tc in cases)))
print("summary, GPU tests (tests/gpu, *_cuda, multi_gpu):", dict(Counter(status(tc) for tc in gpu)))
if multi:
    print("summary, multi_gpu:", dict(Counter(status(tc) for tc in multi)))
    for tc in multi:
        s = tc.find("skipped")
        if s is not None:
            print(f"  skipped {tc.get('name')}: {s.get('message', '')[:160]}")
PY
if [ "${AB:-0}" = "1" ]; then
  ranks=1
  for r in 8 4 2; do [ "$NGPU" -ge "$r" ] && { ranks=$r; break; }; done
  : >"$OUT/ab.log"
  for preset in ${AB_PRESETS:-qwen3-30b-a3b kimi-k2}; do
    args=(--device cuda --ranks "$ranks" --preset "$preset" --layers "${AB_LAYERS:-8}" --tokens ${AB_TOKENS:-1 256 4096}
          --maxvio 0 2 --steps 10 --warmup 3 --impl "${AB_IMPL:-auto}" --heap "${AB_HEAP:-auto}" --no-plots)
    echo "=== moonep-ab $preset, $ranks spawned ranks ===" | tee -a "$OUT/ab.log"
    timeout "${AB_TIMEOUT:-240}" python3 -m vllm_moonep.tools.ab "${args[@]}" \
      --configs replicated symmetric symmetric-shared --out "/tmp/ab-$preset" 2>&1 \
      | grep -v "it/s\|point/s" | tee -a "$OUT/ab.log" | sed -n '1,24p'
    if [ "$ranks" -ge 2 ]; then
      echo "=== moonep-ab $preset, torchrun --nproc-per-node $ranks ===" | tee -a "$OUT/ab.log"
      timeout "${AB_TIMEOUT:-240}" python3 -m torch.distributed.run --standalone --nproc-per-node "$ranks" \
        -m vllm_moonep.tools.ab "${args[@]}" --configs replicated symmetric --out "/tmp/ab-tr-$preset" 2>&1 \
        | grep -v "it/s\|point/s" | tee -a "$OUT/ab.log" | sed -n '1,22p'
    fi
  done
fi
exit $rc
