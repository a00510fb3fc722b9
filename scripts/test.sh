#!/usr/bin/env bash
# The project's test command (README; .ci/run calls it), in stages:
#   setup      .venv (scripts/setup.sh)
#   typecheck  mypy, strict on the engine's and the layouts' public API (scripts/typecheck.sh)
#   pytest     the suite but the `slow` tests (CPU ranks over gloo; GPU tests skip without a GPU), on
#              $PYTEST_WORKERS (default 2) pytest-xdist workers, a test file per worker at a time
#              (--dist loadfile: a module's fixtures and rank pools stay in one process)
#   slow       the `slow` tests: the soak and the fault cases that wait out a collective's bound
#   torchrun   the distributed tests once more through two torchrun agents on loopback
#              (--nnodes 2), so the multi-node launch path runs (scripts/torchrun_loopback.sh)
# With arguments, they go to one pytest run in place of the pytest and slow stages
# (`bash scripts/test.sh tests/unit -x`). Every pytest run exits 5 when it ran nothing, and
# with set -e that fails the command, as it should.
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
times=()
stage() {  # stage NAME COMMAND...: run it, keep its wall time for the closing line
  local name=$1 t0; shift
  t0=$(date +%s)
  echo "=== test.sh: $name ==="
  "$@"
  times+=("$name $(( $(date +%s) - t0 ))s")
}
start=$(date +%s)
stage setup bash scripts/setup.sh
# a type error fails the run here, before the (much longer) tests
stage typecheck bash scripts/typecheck.sh
workers=${PYTEST_WORKERS:-2}
parallel=()
if [ "$workers" -gt 1 ]; then
  # in collection order (tests/conftest.py puts the long interpreter modules first), not xdist's by-size one
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
if [ $# -gt 0 ]; then
  stage pytest .venv/bin/python -m pytest -q "$@"
else
  stage pytest .venv/bin/python -m pytest -q -m "not slow" "${parallel[@]}"
  stage slow .venv/bin/python -m pytest -q -m slow
fi
stage "torchrun 2-node" bash scripts/torchrun_loopback.sh
summary=$(IFS=,; echo "${times[*]}")
echo "test.sh: ${summary//,/, }, total $(( $(date +%s) - start ))s"
