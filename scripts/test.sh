#!/usr/bin/env bash
# The project's test command (README; .ci/run calls it): set up .venv, type-check the package
# (scripts/typecheck.sh: mypy, strict on the engine's and the layouts' public API), run the whole
# pytest suite (CPU ranks over gloo; GPU tests skip without a GPU), then run the distributed tests
# once more through two torchrun agents on loopback (--nnodes 2), so the multi-node launch path runs.
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
t0=$(date +%s)
bash scripts/setup.sh
t1=$(date +%s)
# a type error fails the run here, before the (much longer) tests
bash scripts/typecheck.sh
t1b=$(date +%s)
# pytest exits 5 when it collected nothing: with set -e that fails the run, as it should.
.venv/bin/python -m pytest -q "$@"
t2=$(date +%s)
bash scripts/torchrun_loopback.sh
t3=$(date +%s)
echo "test.sh: setup $((t1 - t0))s, typecheck $((t1b - t1))s, pytest $((t2 - t1b))s, torchrun 2-node $((t3 - t2))s, total $((t3 - t0))s"
